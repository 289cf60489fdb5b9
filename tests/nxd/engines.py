"""Engine cores on the NxD emulator and on the torch backend, and a driver that steps them."""

from __future__ import annotations

from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.outputs import RequestOutput
from nxdserve.engine.request import Request
from nxdserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion

MAX_MODEL_LEN = 256
NUM_SEQS = 4


def make_core(model: str | None, backend: str = "nxd", **overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": model, "backend": backend, "dtype": "float32",
                                "max_model_len": MAX_MODEL_LEN, "max_num_seqs": NUM_SEQS}
    settings.update(overrides)
    # The loader builds no engine proposer for methods the backend runs fused (NxD speculation on device).
    return build_engine_core(EngineConfig(**settings), with_metrics=False)[0]


def admit(core: EngineCore, prompt: list[int], params: SamplingParams) -> Request:
    """A request through the core's admission checks (including the backend's ``validate_request``)."""
    return core.make_request(prompt, params)


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
        max_steps: int = 5_000) -> list[RequestOutput]:
    """Submit every prompt, step until all finish; final outputs in prompt order."""
    return run_to_completion(core, prompts, params, max_steps)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
