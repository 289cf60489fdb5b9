"""Multi-LoRA on both backends (the nxd one through the NxD emulator): each adapter's fp32 greedy output equals
transformers + peft, and a mixed batch (base rows and rows of several adapters in one forward) gives every
request what it gets alone. What NxD cannot do (adapters beyond its compiled-in set) is a clear error there."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdserve.engine.core import EngineCore
from nxdserve.engine.step import StepPlan, StepResult
from nxdserve.errors import ConfigError
from nxdserve.lora.request import LoRARequest
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.engine import make_core
from tests.helpers.lora import greedy_reference, make_peft_adapter, peft_reference
from tests.helpers.tiny_model import single_torch_thread, tiny_model_path

MAX_TOKENS = 8
PROMPTS = [[1, 450, 7483, 310, 3444, 338], [1, 3014, 263, 2], [1, 22172, 29892, 590, 1024, 338, 100, 200, 300]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model_path("llama")
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": make_peft_adapter(base, root / "all", seed=1),
        "attn-rslora": make_peft_adapter(base, root / "attn", targets=("q_proj", "v_proj"), rank=4, alpha=8,
                                         rslora=True, seed=2),
        "mlp-r16": make_peft_adapter(base, root / "mlp", targets=("gate_proj", "down_proj"), rank=16, alpha=4, seed=3),
    }


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """transformers + peft greedy tokens of every prompt, per adapter (None: the base model)."""
    base = tiny_model_path("llama")
    with single_torch_thread():
        return {name: [greedy_reference(peft_reference(base, path), p, MAX_TOKENS) for p in PROMPTS]
                for name, path in [(None, None), *adapters.items()]}


def _modules(adapters: dict[str, Path]) -> list[LoRARequest]:
    return [LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(adapters.items(), start=1)]


@pytest.fixture(scope="module")
def core(backend: str, adapters: dict[str, Path]) -> EngineCore:
    """One core per backend with every adapter registered (on nxd compiled in: ``--lora-modules``)."""
    with single_torch_thread():
        core = _core(backend=backend, lora_modules=_modules(adapters) if backend == "nxd" else [])
    _register(core, adapters)
    return core


def _core(**overrides: object) -> EngineCore:
    settings = {"model": str(tiny_model_path("llama")), "enable_lora": True, "max_loras": 3, "max_lora_rank": 16,
                "max_num_seqs": 8}
    settings.update(overrides)
    return make_core(**settings)


def _run(core: EngineCore, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    ids = []
    for prompt, name in jobs:
        p = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        request = core.make_request(prompt, p, lora=None if name is None else core.lora.resolve(name))
        core.add_request(request)
        ids.append(request.request_id)
    finals = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i].outputs[0].token_ids for i in ids]


def _register(core: EngineCore, adapters: dict[str, Path]) -> None:
    for i, (name, path) in enumerate(adapters.items(), start=1):
        core.lora.load(LoRARequest(name, i, str(path)))


def test_each_adapter_matches_transformers_peft(
    core: EngineCore, adapters: dict[str, Path], expected: dict[str | None, list[list[int]]]
) -> None:
    with single_torch_thread():
        for name in [None, *adapters]:
            got = _run(core, [(p, name) for p in PROMPTS])
            assert got == expected[name], name
    # The adapters do change the output (non-zero B), so the comparison above is not blind.
    assert len({tuple(v[0]) for v in expected.values()}) == len(expected)


def test_mixed_batch_equals_alone(core: EngineCore, adapters: dict[str, Path]) -> None:
    with single_torch_thread():
        names = [None, *adapters]
        jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(8)]
        alone = [_run(core, [job])[0] for job in jobs]
        assert _run(core, jobs) == alone


def test_mixed_batch_equals_alone_chunked(adapters: dict[str, Path]) -> None:
    """torch only: the nxd backend falls back from chunked prefill (tests/nxd/test_engine_nxd.py)."""
    with single_torch_thread():
        core = _core(enable_chunked_prefill=True, max_num_batched_tokens=16)
        _register(core, adapters)
        names = [None, *adapters]
        jobs = [(PROMPTS[i % len(PROMPTS)], names[i % len(names)]) for i in range(8)]
        alone = [_run(core, [job])[0] for job in jobs]
        assert _run(core, jobs) == alone


def test_more_adapters_than_max_loras_are_deferred(backend: str, adapters: dict[str, Path]) -> None:
    """Three adapters over one buffer slot: the scheduler runs one adapter at a time, outputs unchanged. NxD
    keeps every compiled-in adapter on device, so there the same settings are a ConfigError at start-up."""
    if backend == "nxd":
        with pytest.raises(ConfigError, match=r"--max-loras \(1\) must be at least the number of --lora-modules \(3\)"):
            _core(backend="nxd", max_loras=1, max_cpu_loras=1, lora_modules=_modules(adapters))
        return
    with single_torch_thread():
        core = _core(max_loras=1, max_cpu_loras=1)
        _register(core, adapters)
        jobs = [(PROMPTS[0], name) for name in [*adapters, None]]
        alone = [_run(core, [job])[0] for job in jobs]
        assert _run(core, jobs) == alone
        assert not core.lora.is_loaded("all")  # host LRU of one: evicted, and read again on use
        assert _run(core, [jobs[0]]) == [alone[0]]


def test_fused_cpu_decode_falls_back_when_an_adapter_row_is_in_the_step(
    adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused C decoder (AVX512-BF16 only) has no LoRA: with an adapter token in the step, ``accepts`` says
    no and the forward runs the layers; a base-only step keeps it."""
    import numpy as np
    import torch

    from nxdserve.engine.models import fused_decode
    from nxdserve.engine.models.runner import SlotModelRunner
    from nxdserve.lora.stack import LoraStack

    monkeypatch.setattr(fused_decode, "available", lambda: True)  # as on an AVX512-BF16 machine
    runner = SlotModelRunner.from_pretrained(tiny_model_path("llama"), 2, 64, torch.bfloat16, torch.device("cpu"))
    stack = LoraStack(runner.model.spec, 2, 16, torch.bfloat16, torch.device("cpu"))
    core = _core()
    _register(core, adapters)
    slot = stack.slot_for(core.lora.resolve("all"), set())
    tokens = torch.tensor([5, 6])
    meta = runner.metadata(np.array([0, 1]), np.array([3, 3]), np.array([1, 1]))
    meta.use_kernel = True
    fused = runner.model.fused_decode
    with torch.inference_mode():
        assert fused.accepts(tokens, meta, runner.kv_cache)  # base rows only: the fused path
        meta.lora = stack.step(np.array([-1, slot]))
        assert meta.lora is not None
        assert not fused.accepts(tokens, meta, runner.kv_cache)
    assert stack.step(np.array([-1, -1])) is None  # no adapter token: no LoRA work at all
    assert stack.step(np.array([slot, slot])).one_hot is None  # one adapter for every token: no masking


def test_lora_requests_info_metric(adapters: dict[str, Path]) -> None:
    """vllm:lora_requests_info names the running adapter and the one deferred by max_loras=1."""
    with single_torch_thread():
        core = _core(max_loras=1)
        _register(core, adapters)
        assert core.metrics is not None
        for name in ("all", "mlp-r16", None):
            p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            core.add_request(core.make_request(PROMPTS[0], p, lora=None if name is None else core.lora.resolve(name)))
        core.step()
        samples = [s for m in core.metrics.registry.collect() if m.name == "vllm:lora_requests_info" for s in m.samples]
        assert len(samples) == 1 and samples[0].value > 1e9  # the current time, as vLLM sets it
        expected = {"max_lora": "1", "running_lora_adapters": "all", "waiting_lora_adapters": "mlp-r16"}
        assert samples[0].labels == expected
        while core.has_unfinished:
            core.step()


def test_prefix_reuse_is_keyed_by_adapter(adapters: dict[str, Path]) -> None:
    """A free slot's KV is reused only by a prompt on the same adapter: KV computed with one adapter would
    give another (or the base model) wrong outputs."""
    prompt = PROMPTS[2]
    with single_torch_thread():
        plain = _core(max_num_seqs=1)
        _register(plain, adapters)
        expected = {name: _run(plain, [(prompt, name)])[0] for name in (None, "all")}
        core = _core(max_num_seqs=1, enable_prefix_caching=True)
        _register(core, adapters)
        assert _run(core, [(prompt, "all")])[0] == expected["all"]
        request = core.make_request(prompt, SamplingParams(max_tokens=1))
        assert core.scheduler._pick_slot(request)[1] == 0  # the slot holds the adapter's KV: not reused
        assert _run(core, [(prompt, None)])[0] == expected[None]
        assert core.scheduler._pick_slot(request)[1] == len(prompt) - 1  # now the base KV: reused
        assert _run(core, [(prompt, None)])[0] == expected[None]
        assert _run(core, [(prompt, "all")])[0] == expected["all"]


def test_speculation_verifies_with_the_adapter(adapters: dict[str, Path]) -> None:
    """Drafts come from the base model (a self-draft of its first layer: proposers run no adapter); the target
    verifies them with each row's adapter applied, so the greedy output is the one without speculation, for
    adapter and base rows in one batch."""
    spec = {"method": "draft_model", "self_draft_layers": 1, "num_speculative_tokens": 3,
            "disable_by_batch_size": 1024}  # always draft
    with single_torch_thread():
        plain = _core()
        _register(plain, adapters)
        jobs = [([1, 5, 6, 7, 5, 6, 7, 5, 6], name) for name in (None, "all", "attn-rslora", "mlp-r16")]
        expected = _run(plain, jobs)
        core = _core(speculative_config=spec)
        _register(core, adapters)
        drafts: list[int] = []
        execute = core.backend.execute

        def counting(plan: StepPlan) -> StepResult:
            drafts.append(int(plan.num_drafts.sum()))
            return execute(plan)

        core.backend.execute = counting  # type: ignore[method-assign]
        assert _run(core, jobs) == expected
        assert sum(drafts) > 0  # drafts were verified, not skipped


def test_bad_lora_settings_are_config_errors(backend: str, adapters: dict[str, Path]) -> None:
    modules = _modules(adapters)[:1] if backend == "nxd" else []
    with pytest.raises(ConfigError, match="max_lora_rank 7"):
        _core(backend=backend, max_lora_rank=7, lora_modules=modules)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        _core(backend=backend, max_loras=2, max_cpu_loras=1, lora_modules=modules)
    if backend == "nxd":  # NxD compiles its adapters in: --enable-lora without them cannot serve any
        with pytest.raises(ConfigError, match="needs its adapters at compile time"):
            _core(backend="nxd")
