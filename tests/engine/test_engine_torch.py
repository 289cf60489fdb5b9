"""The engine end to end on the default model (fp32, torch backend), driven step by step."""

from __future__ import annotations

import pytest

from nxdserve.engine.models import greedy_head
from nxdserve.errors import InvalidRequestError, RequestTooLongError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.engine import PROMPTS, run_to_completion, shared_core, tokenize

CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}  # small budget: prompts get split
PREFILL_FIRST = {"enable_chunked_prefill": False}


def greedy(max_tokens: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_greedy_is_identical_across_modes_and_batch_sizes() -> None:
    chunked, prefill_first = shared_core(**CHUNKED), shared_core(**PREFILL_FIRST)
    prompts = tokenize(chunked, PROMPTS)
    batched_chunked = [o.outputs[0].token_ids for o in run_to_completion(chunked, prompts, greedy())]
    batched_pf = [o.outputs[0].token_ids for o in run_to_completion(prefill_first, prompts, greedy())]
    alone = [run_to_completion(chunked, [p], greedy())[0].outputs[0].token_ids for p in prompts]
    assert batched_chunked == batched_pf
    assert batched_chunked == alone
    assert all(len(t) == 16 for t in alone)


def test_seeded_sampling_is_reproducible_across_batch_compositions() -> None:
    core = shared_core(**CHUNKED)
    prompts = tokenize(core, PROMPTS[:8])

    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=12, ignore_eos=True)

    alone = run_to_completion(core, [prompts[0]], seeded(1234))[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12 + i, ignore_eos=True) for i in range(7)]
    batch = [*prompts[1:4], prompts[0], *prompts[4:8]]
    mixed = run_to_completion(core, batch, [*others[:3], seeded(1234), *others[3:]])
    assert mixed[3].outputs[0].token_ids == alone
    other_seed = run_to_completion(core, [prompts[0]], seeded(4321))[0].outputs[0].token_ids
    assert other_seed != alone


def _find_boundary_stop(core: object, prompt: list[int]) -> tuple[str, str]:
    """A stop string that spans two tokens of the greedy output, and the text before it."""
    out = run_to_completion(core, [prompt], greedy(max_tokens=24))[0].outputs[0]  # type: ignore[arg-type]
    tok = core.tokenizer  # type: ignore[attr-defined]
    pieces = [tok.decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    for i in range(3, len(pieces) - 1):
        a, b = pieces[i - 1], pieces[i]
        if len(b) - len(a) >= 2 and len(a) >= 2 and b.startswith(a):
            stop = a[-2:] + b[len(a) : len(a) + 2]
            if out.text.find(stop) == len(a) - 2:
                return stop, out.text[: len(a) - 2]
    raise AssertionError("no suitable token boundary found")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(include: bool) -> None:
    core = shared_core(**CHUNKED)
    prompt = tokenize(core, ["Once upon a time, in a land far away,"])[0]
    stop, before = _find_boundary_stop(core, prompt)
    params = greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=include)
    params.output_kind = OutputKind.DELTA
    request = core.make_request(prompt, params)
    core.add_request(request)
    deltas = []
    final = None
    while core.has_unfinished:
        for out in core.step():
            deltas.append(out.outputs[0].text)
            if out.finished:
                final = out
    assert final is not None
    expected = before + stop if include else before
    assert "".join(deltas) == expected
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    # Holdback: no delta emitted before the end ever ran past the text that precedes the stop.
    emitted = ""
    for d in deltas[:-1]:
        emitted += d
        assert before.startswith(emitted)
    assert core.scheduler.num_free_slots == core.num_slots


def test_bad_input_gives_typed_errors_and_engine_keeps_serving() -> None:
    core = shared_core(**CHUNKED)
    good = tokenize(core, ["Hello"])[0]
    with pytest.raises(InvalidRequestError, match="non-empty"):
        core.make_request([], greedy())
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        core.make_request([1, core.vocab_size + 5], greedy())
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        core.make_request([-1, 2], greedy())
    with pytest.raises(RequestTooLongError, match="maximum context length is 256"):
        core.make_request(good, greedy(max_tokens=300))
    with pytest.raises(RequestTooLongError):
        core.make_request([5] * 256, SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        core.make_request(good, SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequestError, match="top_p"):
        core.make_request(good, SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequestError, match="empty string"):
        core.make_request(good, SamplingParams(stop=[""]))
    with pytest.raises(InvalidRequestError, match="logprobs"):
        core.make_request(good, SamplingParams(logprobs=21))
    out = run_to_completion(core, [good], greedy(max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4 and core.scheduler.num_free_slots == core.num_slots


def test_abort_frees_the_slot_and_is_idempotent() -> None:
    core = shared_core(**CHUNKED)
    request = core.make_request(tokenize(core, ["Tell me a long story."])[0], greedy(max_tokens=100))
    core.add_request(request)
    core.step()
    core.step()
    assert core.scheduler.num_free_slots == core.num_slots - 1
    outs = core.abort([request.request_id])
    assert outs and outs[0].outputs[0].finish_reason == "abort"
    assert core.abort([request.request_id, "unknown"]) == []
    assert core.scheduler.num_free_slots == core.num_slots and not core.has_unfinished
    # The backend's batch learns of the free with the next plan: the next request's step.
    batch = core.backend.batch
    assert batch is not None and batch.request_ids.count(request.request_id) == 1
    run_to_completion(core, tokenize(core, ["Hi"]), greedy(max_tokens=1))
    assert request.request_id not in batch.request_ids


@pytest.mark.parametrize("mode", [CHUNKED, PREFILL_FIRST], ids=["chunked", "prefill-first"])
def test_runs_to_exactly_max_model_len(mode: dict[str, object]) -> None:
    core = shared_core(**mode)
    prompt = tokenize(core, ["Count: " + " ".join(str(i) for i in range(200))])[0][:250]
    out = run_to_completion(core, [prompt], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(prompt) + len(out.outputs[0].token_ids) == 256


def test_logprobs_and_prompt_logprobs() -> None:
    core = shared_core(**CHUNKED)
    prompt = tokenize(core, ["The capital of France is"])[0]
    out = run_to_completion(core, [prompt], greedy(max_tokens=5, logprobs=3, prompt_logprobs=2))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 5
    for token, entry in zip(out.outputs[0].token_ids, lps, strict=True):
        first = next(iter(entry))
        assert first == token and entry[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(entry) <= 4 and all(lp.logprob <= 0 for lp in entry.values())
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert next(iter(entry)) == token


def test_min_tokens_and_stop_token_ids() -> None:
    core = shared_core(**CHUNKED)
    prompt = tokenize(core, ["Say hi."])[0]
    free = run_to_completion(core, [prompt], greedy(max_tokens=8))[0].outputs[0].token_ids
    stop_id = free[2]
    out = run_to_completion(core, [prompt], greedy(max_tokens=8, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free[: free.index(stop_id) + 1]
    masked = run_to_completion(core, [prompt], greedy(max_tokens=8, stop_token_ids=[stop_id], min_tokens=6))[0]
    assert stop_id not in masked.outputs[0].token_ids[:6]


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(include: bool) -> None:
    # vLLM's detokenizer: a request that ends on a stop token id keeps the id in token_ids, but its text only
    # with include_stop_str_in_output (otherwise, with special tokens kept, "<|im_end|>" ends every text).
    core = shared_core(**CHUNKED)
    prompt = tokenize(core, ["Say hi."])[0]
    free = run_to_completion(core, [prompt], greedy(max_tokens=8))[0].outputs[0]
    cut = next(j for j in range(2, 8) if free.token_ids[j] not in free.token_ids[:j])
    stop_id, kept = free.token_ids[cut], free.token_ids[:cut]
    out = run_to_completion(
        core, [prompt], greedy(max_tokens=8, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    )[0].outputs[0]
    assert out.token_ids == [*kept, stop_id]
    expected = core.tokenizer.decode([*kept, stop_id] if include else kept)
    assert out.text == expected


@pytest.mark.skipif(not greedy_head.available(), reason="no AVX512-VNNI/BF16 C kernels here")
def test_greedy_tokens_from_the_lm_head_screen_equal_the_full_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 (the screen's dtype), 16 prompts decoding together: the screen answers the plain greedy steps, and
    # every token equals the one the full head's logits give.
    core = shared_core(**CHUNKED, dtype="bfloat16")
    screen = core.backend.runner.model.greedy_head  # type: ignore[attr-defined]
    prompts = tokenize(core, PROMPTS)
    calls = []
    original = screen.argmax

    def counted(hidden: object, vocab: int) -> object:
        got = original(hidden, vocab)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(screen, "argmax", counted)
    with_screen = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, greedy(24))]
    assert calls and all(calls)
    monkeypatch.setattr(greedy_head, "enabled", False)
    calls.clear()
    full_head = [o.outputs[0].token_ids for o in run_to_completion(core, prompts, greedy(24))]
    assert calls and not any(calls)
    assert with_screen == full_head
