"""Defaults that depend on where the engine runs: the chunked-mode step budget and its whole-prompt overflow."""

from __future__ import annotations

import pytest

from nxdserve.config import DEFAULT_CHUNKED_BATCHED_TOKENS, DEFAULT_CPU_CHUNKED_BATCHED_TOKENS, EngineConfig
from nxdserve.engine import backends
from nxdserve.engine.loader import default_chunked_budget, default_cpu_overflow_fraction


def test_cpu_torch_backend_gets_the_small_chunked_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "nxd_status", lambda: (False, "not here"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    config = EngineConfig(max_num_seqs=8)
    config.resolve(2048, chunked_token_budget=default_chunked_budget(config))
    assert config.max_num_batched_tokens == DEFAULT_CPU_CHUNKED_BATCHED_TOKENS < DEFAULT_CHUNKED_BATCHED_TOKENS


def test_budget_stays_large_on_gpu_and_neuron(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "nxd_status", lambda: (False, "not here"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert default_chunked_budget(EngineConfig()) == DEFAULT_CHUNKED_BATCHED_TOKENS
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert default_chunked_budget(EngineConfig(device="cuda")) == DEFAULT_CHUNKED_BATCHED_TOKENS
    assert default_chunked_budget(EngineConfig(backend="nxd")) == DEFAULT_CHUNKED_BATCHED_TOKENS
    monkeypatch.setattr(backends, "nxd_status", lambda: (True, "a Neuron device"))
    assert default_chunked_budget(EngineConfig()) == DEFAULT_CHUNKED_BATCHED_TOKENS


def test_chunked_budget_never_below_max_num_seqs_and_explicit_value_wins() -> None:
    config = EngineConfig(max_num_seqs=200).resolve(2048, chunked_token_budget=DEFAULT_CPU_CHUNKED_BATCHED_TOKENS)
    assert config.max_num_batched_tokens == 200  # every running request can decode in one step
    config = EngineConfig(max_num_batched_tokens=300).resolve(2048, chunked_token_budget=96)
    assert config.max_num_batched_tokens == 300
    config = EngineConfig(enable_chunked_prefill=False).resolve(2048, chunked_token_budget=96)
    assert config.max_num_batched_tokens == 2048  # prefill-first: a whole prompt fits one step


def test_whole_prompt_overflow_is_a_whole_budget_where_gemms_run_on_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    from nxdserve.engine.models import gemm

    monkeypatch.setattr(backends, "nxd_status", lambda: (False, "not here"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cpu = DEFAULT_CPU_CHUNKED_BATCHED_TOKENS
    for amx, expected in ((True, cpu), (False, cpu // 2)):
        monkeypatch.setattr(gemm, "uses_amx", lambda amx=amx: amx)
        config = EngineConfig()
        config.resolve(2048, chunked_token_budget=cpu, cpu_overflow_fraction=default_cpu_overflow_fraction(config))
        assert config.whole_prompt_overflow == expected
    # fp32 GEMMs do not run on the tiles; an explicit budget stays a hard cap either way.
    monkeypatch.setattr(gemm, "uses_amx", lambda: True)
    assert default_cpu_overflow_fraction(EngineConfig(dtype="float32")) == 0.5
    assert default_cpu_overflow_fraction(EngineConfig(backend="nxd")) == 0.5  # not the CPU budget: never asked
    config = EngineConfig(max_num_batched_tokens=cpu)
    config.resolve(2048, chunked_token_budget=cpu, cpu_overflow_fraction=default_cpu_overflow_fraction(config))
    assert config.whole_prompt_overflow == 0
