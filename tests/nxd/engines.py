"""Engine cores on the NxD emulator and on the torch backend, and a driver that steps them."""

from __future__ import annotations

from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.backends import create_backend
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core, load_model_files, max_positions
from nxdserve.engine.outputs import RequestOutput
from nxdserve.engine.request import Request
from nxdserve.sampling_params import OutputKind, SamplingParams

MAX_MODEL_LEN = 256
NUM_SEQS = 4


def make_core(model: str | None, backend: str = "nxd", **overrides: Any) -> EngineCore:
    settings: dict[str, Any] = {"model": model, "backend": backend, "dtype": "float32",
                                "max_model_len": MAX_MODEL_LEN, "max_num_seqs": NUM_SEQS}
    settings.update(overrides)
    config = EngineConfig(**settings)
    if not config.speculative_config:
        return build_engine_core(config, with_metrics=False)[0]
    # NxD runs speculation fused on device, so no engine proposer: built by hand until the loader skips
    # proposers for methods in capabilities.fused_spec_methods.
    files = load_model_files(config)
    config.resolve(max_positions(files.hf_config))
    core = EngineCore(config, create_backend(config, files.path), files.tokenizer)
    core.eos_token_ids = core.eos_token_ids | frozenset(files.generation_eos_ids)
    return core


def admit(core: EngineCore, prompt: list[int], params: SamplingParams) -> Request:
    """``make_request`` plus the backend's admission check (the call EngineCore.make_request should make)."""
    validate = getattr(core.backend, "validate_request", None)
    if validate is not None:
        validate(params)
    return core.make_request(prompt, params)


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
        max_steps: int = 5_000) -> list[RequestOutput]:
    """Submit every prompt, step until all finish; final outputs in prompt order."""
    if isinstance(params, SamplingParams):
        params = [SamplingParams(**vars(params)) for _ in prompts]
    ids = []
    for prompt, p in zip(prompts, params, strict=True):
        p.output_kind = OutputKind.FINAL_ONLY
        request = admit(core, prompt, p)
        core.add_request(request)
        ids.append(request.request_id)
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
        if not core.has_unfinished:
            break
    assert not core.has_unfinished, "requests did not finish"
    return [finals[i] for i in ids]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
