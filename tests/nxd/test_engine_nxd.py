"""The engine end to end with ``--backend nxd`` on the NxD emulator, checked against the torch backend.

The emulator runs the same reference network as the torch backend, so in fp32 every greedy output
must be identical; any adapter mistake (wrong KV line, a pad row over a live line, a sampling row for
the wrong request, a padding rule broken) changes tokens and fails these comparisons.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.errors import ConfigError, InvalidRequestError, RequestTooLongError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import MAX_MODEL_LEN, admit, greedy, make_core, run, tokens

# Short, long, one-token, repeated and near-maximum prompts (the longest is 200 of 256 positions).
PROMPTS = [
    [5, 6, 7, 8, 9],
    [100] * 20,
    [1],
    list(range(10, 150)),
    [42, 7] * 30,
    list(range(300, 500)),
]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def reference(model: str) -> Iterator[EngineCore]:
    yield make_core(model, "torch", enable_chunked_prefill=False)


@pytest.fixture(scope="module")
def nxd(model: str) -> Iterator[EngineCore]:
    yield make_core(model)  # default config: chunked requested, so this also covers the fallback


@pytest.fixture(scope="module")
def expected(reference: EngineCore) -> list[list[int]]:
    return tokens(run(reference, PROMPTS, greedy(24)))


def test_greedy_matches_torch_in_both_modes(model: str, nxd: EngineCore, expected: list[list[int]]) -> None:
    assert tokens(run(nxd, PROMPTS, greedy(24))) == expected
    prefill_first = make_core(model, enable_chunked_prefill=False)
    assert tokens(run(prefill_first, PROMPTS, greedy(24))) == expected
    # One at a time: other slots and batch sizes change nothing.
    assert [tokens(run(nxd, [p], greedy(24)))[0] for p in PROMPTS[:3]] == expected[:3]


def test_chunked_prefill_falls_back_to_prefill_first(model: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nxdserve"):
        core = make_core(model, max_num_seqs=2, max_num_batched_tokens=64)
    assert "no chunked prefill (removed in 0.8); scheduling prefill-first" in caplog.text
    assert not core.scheduler.chunked and core.scheduler.token_budget >= MAX_MODEL_LEN
    caps = core.capabilities
    assert (caps.mixed_prefill_decode, caps.chunked_prefill, caps.max_prefills_per_step) == (False, False, 1)
    assert caps.max_prompt_len == MAX_MODEL_LEN and caps.decode_all_live_slots


def test_steps_follow_nxd_call_shapes(nxd: EngineCore) -> None:
    app = nxd.backend.app  # type: ignore[attr-defined]
    app.calls.clear()
    run(nxd, PROMPTS[:3], greedy(4))
    cte = [c for c in app.calls if c["tag"] == "context_encoding_model"]
    tkg = [c for c in app.calls if c["tag"] == "token_generation_model"]
    assert len(cte) == 3 and all(c["batch"] == 1 for c in cte)  # one prompt per call
    assert all(c["seq_ids"] == sorted(c["seq_ids"]) for c in tkg)  # rows sorted by seq_id
    assert all(min(c["positions"]) > 0 for c in tkg)  # never routed as context encoding


def test_mixed_sampling_rows_keep_their_own_parameters(nxd: EngineCore, expected: list[list[int]]) -> None:
    # Greedy rows next to random rows: each row's [top_k, top_p, temperature] must be its own.
    params = [greedy(24) if i % 2 == 0 else SamplingParams(temperature=1.5, top_k=40, top_p=0.9, max_tokens=24,
                                                          ignore_eos=True) for i in range(len(PROMPTS))]
    out = tokens(run(nxd, PROMPTS, params))
    assert [out[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert all(len(out[i]) == 24 for i in (1, 3, 5))
    assert any(out[i] != expected[i] for i in (1, 3, 5))


def test_top_k_above_global_topk_and_disabled_top_k_are_served(nxd: EngineCore) -> None:
    out = run(nxd, PROMPTS[:2], [SamplingParams(top_k=10_000, max_tokens=5), SamplingParams(top_k=-1, max_tokens=5)])
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)
    assert nxd.backend.capabilities.global_top_k == 256


def test_stops_match_torch(nxd: EngineCore, reference: EngineCore, expected: list[list[int]]) -> None:
    text = reference.tokenizer.decode(expected[0])
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3])
    params = [greedy(24, stop_token_ids=[expected[3][5]]), greedy(24, stop=[stop])]
    prompts = [PROMPTS[3], PROMPTS[0]]
    for got, want in zip(run(nxd, prompts, params), run(reference, prompts, params), strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason == "stop"


def test_abort_frees_the_slot_and_the_next_request_is_unaffected(nxd: EngineCore,
                                                                 expected: list[list[int]]) -> None:
    params = greedy(50)
    params.output_kind = OutputKind.DELTA
    victim = admit(nxd, PROMPTS[5], params)
    nxd.add_request(victim)
    for _ in range(4):
        nxd.step()
    outs = nxd.abort([victim.request_id])
    assert outs and outs[0].outputs[0].finish_reason == "abort"
    assert nxd.scheduler.num_free_slots == nxd.num_slots
    # The freed line still holds the aborted request's KV: a new request there must not see it.
    assert tokens(run(nxd, [PROMPTS[0]], greedy(24))) == [expected[0]]


def test_length_limits_are_enforced_at_admission(nxd: EngineCore) -> None:
    with pytest.raises(RequestTooLongError):
        admit(nxd, [5] * MAX_MODEL_LEN, greedy(1))
    with pytest.raises(RequestTooLongError, match="maximum context length"):
        admit(nxd, [5] * 200, greedy(57))
    out = run(nxd, [[7] * (MAX_MODEL_LEN - 1)], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_custom_buckets_below_the_lengths_bound_admission(model: str) -> None:
    """--override-neuron-config buckets that stop below max_context_length / max_length: a request never
    reaches NxD's "exceeds largest bucket" ValueError; the largest buckets are the limits."""
    core = make_core(model, enable_chunked_prefill=False,
                     override_neuron_config={"context_encoding_buckets": [64, 128], "token_generation_buckets": [160]})
    assert core.capabilities.max_prompt_len == 128 and core.max_model_len == 160
    with pytest.raises(RequestTooLongError):
        admit(core, [5] * 129, greedy(1))
    out = run(core, [list(range(1000, 1100))], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and 100 + len(out.outputs[0].token_ids) == 160


def test_runs_to_exactly_max_model_len(nxd: EngineCore, reference: EngineCore) -> None:
    prompt = list(range(1000, 1200))
    out = run(nxd, [prompt], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    ref = run(reference, [prompt], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == MAX_MODEL_LEN
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_on_device_sampling_rejects_what_it_cannot_do(nxd: EngineCore) -> None:
    cases = {
        "logprobs": SamplingParams(logprobs=2),
        "min_p": SamplingParams(min_p=0.1),
        "presence_penalty": SamplingParams(presence_penalty=0.5),
        "repetition_penalty": SamplingParams(repetition_penalty=1.2),
        "logit_bias": SamplingParams(logit_bias={5: 3.0}),
        "min_tokens": SamplingParams(min_tokens=3, max_tokens=8),
        "seed": SamplingParams(seed=7, temperature=0.8),
    }
    for name, params in cases.items():
        with pytest.raises(InvalidRequestError, match="output_logits") as info:
            admit(nxd, [5, 6], params)
        assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        admit(nxd, [5, 6], SamplingParams(prompt_logprobs=1))
    admit(nxd, [5, 6], SamplingParams(seed=7, temperature=0.0))  # a seed on a greedy request is harmless


@pytest.mark.parametrize(
    "override",
    [{"on_device_sampling_config": None}, {"output_logits": True}],
    ids=["cpu-sampling", "device-plus-logits"],
)
def test_cpu_sampling_serves_logprobs_penalties_and_seeds(
    model: str, reference: EngineCore, override: dict[str, object], expected: list[list[int]]
) -> None:
    core = make_core(model, enable_chunked_prefill=False, override_neuron_config=override)
    assert tokens(run(core, PROMPTS[:3], greedy(24))) == expected[:3]
    special = [
        greedy(8, logprobs=3),
        greedy(8, repetition_penalty=1.3, presence_penalty=0.5),
        greedy(8, logit_bias={expected[2][0]: -100.0}),
    ]
    got, want = run(core, PROMPTS[:3], special), run(reference, PROMPTS[:3], special)
    assert tokens(got) == tokens(want)
    for entry, ref in zip(got[0].outputs[0].logprobs or [], want[0].outputs[0].logprobs or [], strict=True):
        assert list(entry) == list(ref)
        assert all(abs(entry[t].logprob - ref[t].logprob) < 1e-4 for t in entry)

    def seeded() -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)

    alone = tokens(run(core, [PROMPTS[0]], seeded()))[0]
    crowd = tokens(run(core, [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                       [SamplingParams(temperature=1.0, max_tokens=12), seeded(), greedy(6)]))
    assert crowd[1] == alone


def test_compiles_once_per_configuration(model: str, nxd_emulator: Path) -> None:
    from neuronx_distributed_inference.models import application_base

    make_core(model, max_num_seqs=2)
    compiled = len(application_base.COMPILE_LOG)
    core = make_core(model, max_num_seqs=2)
    assert len(application_base.COMPILE_LOG) == compiled  # loaded, not compiled again
    assert not core.backend.loaded.compiled_now  # type: ignore[attr-defined]
    make_core(model, max_num_seqs=2, override_neuron_config={"on_device_sampling_config": {"global_topk": 64}})
    assert len(application_base.COMPILE_LOG) == compiled + 1
    assert len([p for p in nxd_emulator.iterdir() if not p.name.startswith(".")]) >= 2


@pytest.mark.slow
def test_default_model_greedy_matches_torch() -> None:
    from tests.helpers.engine import PROMPTS as TEXTS

    nxd_core = make_core(None, max_num_seqs=8)
    torch_core = make_core(None, "torch", max_num_seqs=8)
    prompts = [list(nxd_core.tokenizer.encode(t)) for t in TEXTS]
    assert tokens(run(nxd_core, prompts, greedy(16))) == tokens(run(torch_core, prompts, greedy(16)))


@pytest.mark.parametrize("family", ["qwen3", "mistral-window", "qwen2"])
def test_other_families_match_torch(family: str) -> None:
    path = str(tiny_model_path(family))
    prompts = PROMPTS[:4]
    want = tokens(run(make_core(path, "torch", enable_chunked_prefill=False), prompts, greedy(12)))
    assert tokens(run(make_core(path), prompts, greedy(12))) == want


def test_neuron_compiled_artifacts_names_one_folder(model: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from neuronx_distributed_inference.models import application_base

    folder = tmp_path / "compiled"
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(folder))
    first = make_core(model, max_num_seqs=2)
    assert first.backend.loaded.compiled_now and (folder / "model.pt").is_file()  # type: ignore[attr-defined]
    compiled = len(application_base.COMPILE_LOG)
    with caplog.at_level(logging.WARNING, logger="nxdserve"):
        second = make_core(model, max_num_seqs=2, override_neuron_config={"output_logits": True})
    assert len(application_base.COMPILE_LOG) == compiled and "is ignored" in caplog.text
    assert second.backend.settings.sampling_mode == "device"  # type: ignore[attr-defined]  # the folder's config
    assert tokens(run(second, [PROMPTS[0]], greedy(8))) == tokens(run(first, [PROMPTS[0]], greedy(8)))
    # A flag the compiled model was built without is named (its setting runs), and adapters without a compiled
    # lora_config are refused at start rather than failing every request
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nxdserve"):
        make_core(model, max_num_seqs=2, kv_cache_dtype="fp8")
    assert "kv_cache_quant True -> False" in caplog.text
    from nxdserve.lora.request import LoRARequest
    from tests.helpers.lora import make_peft_adapter

    adapter = make_peft_adapter(Path(model), tmp_path / "adapter", seed=5)
    with pytest.raises(ConfigError, match="compiled without LoRA"):
        make_core(model, max_num_seqs=2, enable_lora=True, max_loras=1,
                  lora_modules=[LoRARequest("a", 1, str(adapter))])
