"""vLLM's sampling extras that used to be ignored: allowed_token_ids, bad_words, truncate_prompt_tokens, and
cumulative outputs by default (the embedded API's ``final.outputs[0].text`` is the whole text)."""

from __future__ import annotations

import itertools

import pytest

from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.engine import run_to_completion, shared_core, tokenize


def test_allowed_token_ids_limit_every_token() -> None:
    core = shared_core()
    allowed = tokenize(core, [" yes no maybe"])[0]
    outs = run_to_completion(core, tokenize(core, ["Is the sky blue?", "Hello"]),
                             [SamplingParams(temperature=t, seed=3, max_tokens=8, allowed_token_ids=allowed)
                              for t in (0.0, 1.0)])
    for out in outs:
        assert out.outputs[0].token_ids and set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated() -> None:
    core = shared_core()
    prompt = tokenize(core, ["The capital of France is"])
    free = run_to_completion(core, prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in free  # the greedy answer the ban must change
    banned = run_to_completion(core, prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                            bad_words=["Paris"]))[0].outputs[0]
    assert "Paris" not in banned.text and banned.token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    core = shared_core()
    prompt = tokenize(core, ["one two three four five six seven eight nine ten"])[0]
    out = run_to_completion(core, [prompt], SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=4))
    assert out[0].prompt_token_ids == prompt[-4:]
    with pytest.raises(InvalidRequestError) as info:
        core.make_request(prompt, SamplingParams(truncate_prompt_tokens=-2))
    assert info.value.param == "truncate_prompt_tokens"


def test_bad_allowed_token_ids_name_the_field() -> None:
    core = shared_core()
    for ids in ([], [10**9]):
        with pytest.raises(InvalidRequestError) as info:
            core.make_request([1, 2], SamplingParams(allowed_token_ids=ids))
        assert info.value.param == "allowed_token_ids"


def test_outputs_are_cumulative_by_default() -> None:
    core = shared_core()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert params.output_kind is OutputKind.CUMULATIVE
    request = core.make_request(tokenize(core, ["Once upon a time"])[0], params)
    core.add_request(request)
    outs = []
    while core.has_unfinished:
        outs += [o for o in core.step() if o.request_id == request.request_id]
    texts = [o.outputs[0].text for o in outs]
    assert len(outs) == 6 and all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert len(outs[-1].outputs[0].token_ids) == 6
