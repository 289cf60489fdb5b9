"""Fused speculation and EAGLE on the NxD emulator: 1..k tokens per decode row, same greedy output."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.errors import ConfigError, InvalidRequestError, RequestTooLongError
from nxdserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import build_tiny_model, tiny_model_path
from tests.nxd.engines import MAX_MODEL_LEN, admit, greedy, make_core, run, tokens

PROMPTS = [[5, 6, 7, 8, 9], [100] * 20, [1], list(range(10, 150))]
NUM_DRAFTS = 3  # NxD speculation_length = 4


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def other_draft() -> Iterator[str]:
    """A draft that disagrees with the target often: partial acceptance."""
    with tempfile.TemporaryDirectory() as root:
        yield str(build_tiny_model("llama", Path(root) / "draft", seed=1, with_tokenizer=False))


@pytest.fixture(scope="module")
def expected(model: str) -> list[list[int]]:
    return tokens(run(make_core(model, "torch", enable_chunked_prefill=False), PROMPTS, greedy(24)))


def spec(method: str, draft: str, k: int = NUM_DRAFTS) -> dict[str, object]:
    return {"method": method, "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def fused(model: str, other_draft: str) -> EngineCore:
    return make_core(model, enable_chunked_prefill=False, speculative_config=spec("draft_model", other_draft))


def test_fused_speculation_matches_plain_greedy(model: str, fused: EngineCore, expected: list[list[int]]) -> None:
    assert tokens(run(fused, PROMPTS, greedy(24))) == expected
    self_draft = make_core(model, enable_chunked_prefill=False, speculative_config=spec("draft_model", model))
    assert self_draft.backend.capabilities.fused_spec_methods >= {"draft_model", "eagle"}
    app = self_draft.backend.app  # type: ignore[attr-defined]
    app.calls.clear()
    assert tokens(run(self_draft, [PROMPTS[0]], greedy(24))) == expected[:1]
    # A draft equal to the target is always accepted: 1 token from context encoding, then k per step.
    assert [c["tag"] for c in app.calls].count("fused_speculation_model") == (24 - 1 + 3) // 4
    # Acceptance is reported for metrics: 3 drafts per verification step, all kept.
    request = admit(self_draft, PROMPTS[1], greedy(8))
    self_draft.add_request(request)
    self_draft.step()  # context encoding
    result = self_draft.backend.execute(self_draft.schedule().plan)
    assert result.fused_spec is not None
    assert result.fused_spec.num_drafts == 3 and result.fused_spec.accepted_drafts.tolist() == [3]
    self_draft.abort([request.request_id])


def test_fused_speculation_completes_at_the_admission_bound(fused: EngineCore, model: str) -> None:
    bound = MAX_MODEL_LEN - (NUM_DRAFTS + 1) + 2  # a fused step at position p needs p + k <= max_length
    assert fused.max_model_len == bound
    with pytest.raises(RequestTooLongError):
        admit(fused, [5] * 200, greedy(bound - 200 + 1))
    prompt = list(range(1000, 1200))
    out = run(fused, [prompt], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == bound and out.outputs[0].finish_reason == "length"
    reference = make_core(model, "torch", enable_chunked_prefill=False)
    ref = run(reference, [prompt], greedy(bound - len(prompt)))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_fused_speculation_samples_on_device_only(fused: EngineCore) -> None:
    with pytest.raises(InvalidRequestError, match="fused speculation"):
        admit(fused, [5, 6], SamplingParams(logprobs=1))
    out = run(fused, PROMPTS[:2], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_fused_speculation_without_the_on_device_sampler_is_refused(model: str) -> None:
    with pytest.raises(ConfigError, match="samples on device"):
        make_core(model, enable_chunked_prefill=False, speculative_config=spec("draft_model", model),
                  override_neuron_config={"on_device_sampling_config": None})


def test_eagle_keeps_seq_ids_stable(model: str, other_draft: str, expected: list[list[int]]) -> None:
    core = make_core(model, enable_chunked_prefill=False, speculative_config=spec("eagle", other_draft, 2))
    app = core.backend.app  # type: ignore[attr-defined]
    assert tokens(run(core, PROMPTS, greedy(24))) == expected
    assert tokens(run(core, PROMPTS[2:], greedy(24))) == expected[2:]  # slots reused by new requests
    assert app.eagle_buffer_misses == 0  # every step found its hidden state under its own seq_id
