"""Defaults that depend on where the engine runs: the chunked-mode step budget."""

from __future__ import annotations

import pytest

from nxdserve.config import DEFAULT_CHUNKED_BATCHED_TOKENS, DEFAULT_CPU_CHUNKED_BATCHED_TOKENS, EngineConfig
from nxdserve.engine import backends
from nxdserve.engine.loader import default_chunked_budget, torch_on_cpu
from nxdserve.errors import ConfigError


def test_cpu_torch_backend_gets_the_small_chunked_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "nxd_status", lambda: (False, "not here"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    config = EngineConfig(max_num_seqs=8)
    assert torch_on_cpu(config)
    config.resolve(2048, chunked_token_budget=default_chunked_budget(config), on_cpu=torch_on_cpu(config))
    assert config.max_num_batched_tokens == DEFAULT_CPU_CHUNKED_BATCHED_TOKENS < DEFAULT_CHUNKED_BATCHED_TOKENS
    assert config.whole_prompt_overflow == DEFAULT_CPU_CHUNKED_BATCHED_TOKENS // 2


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


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.2])
def test_gpu_memory_utilization_is_bounded_on_every_device(fraction: float) -> None:
    """vLLM's (0, 1]: refused at start even on a CPU, where it sizes nothing."""
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=fraction).resolve(2048, chunked_token_budget=96, on_cpu=True)
    EngineConfig(gpu_memory_utilization=0.5).resolve(2048, chunked_token_budget=96, on_cpu=True)
