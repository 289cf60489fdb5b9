"""Structured outputs on the nxd backend (emulator): the token mask needs the logits on the host, so on-device
sampling refuses constrained requests naming the setting (``output_logits``), and with NxD's output-logits path (or
CPU sampling) constrained rows are sampled on the host under their mask, exactly as the torch backend does."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.engine.structured import StructuredOutputsParams
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import admit, greedy, make_core, run, tokens

PROMPTS = [[5, 6, 7, 8, 9], [100] * 20, [42, 7] * 10]
REGEX = r"(ab|cd){2,4}!"


def _constrained() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        greedy(12),  # an unconstrained row in the same steps keeps NxD's own token
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["x", "yz"])),
    ]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def reference(model: str) -> Iterator[EngineCore]:
    yield make_core(model, "torch", enable_chunked_prefill=False)


def test_on_device_sampling_names_the_setting(model: str) -> None:
    core = make_core(model)
    for params, field in ((SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])),
                           "structured_outputs"),
                          (SamplingParams(allowed_token_ids=[1, 2]), "allowed_token_ids"),
                          (SamplingParams(bad_words=["a"]), "bad_words")):
        with pytest.raises(InvalidRequestError, match="output_logits") as info:
            admit(core, [5, 6], params)
        assert info.value.param == field


@pytest.mark.parametrize("override", [{"output_logits": True}, {"on_device_sampling_config": None}],
                         ids=["output-logits", "cpu-sampling"])
def test_constrained_rows_match_the_torch_backend(model: str, reference: EngineCore,
                                                  override: dict[str, object]) -> None:
    core = make_core(model, enable_chunked_prefill=False, override_neuron_config=override)
    got = run(core, PROMPTS, _constrained())
    want = run(reference, PROMPTS, _constrained())
    assert tokens(got) == tokens(want)
    assert re.fullmatch(REGEX, got[0].outputs[0].text)
    assert got[2].outputs[0].text in ("x", "yz")
