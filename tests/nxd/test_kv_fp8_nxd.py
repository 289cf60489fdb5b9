"""--kv-cache-dtype on the nxd backend: mapped onto NxD's own ``kv_cache_quant`` / ``kv_quant_config`` keys, the
emulator's KV cache stored in fp8 the way NxD's KVCacheManager stores it (a direct cast), greedy outputs equal to
the torch backend's fp8 cache; what NxD cannot do (--calculate-kv-scales) is a ConfigError before compiling."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd.backend import NxdBackend
from nxdserve.engine.backends.nxd.neuron_config import default_neuron_config
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.engines import greedy, make_core, run, tokens

PROMPTS = [[5, 6, 7, 8, 9], [100] * 20, list(range(10, 150)), [42, 7] * 30]


@pytest.fixture(autouse=True)
def _restore_env() -> Iterator[None]:
    names = ("XLA_HANDLE_SPECIAL_SCALAR", "UNSAFE_FP8FNCAST")  # the backend sets them as NxD's demo does
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize(("name", "dtype"), [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                             ("fp8_e5m2", torch.float8_e5m2)])
def test_kv_cache_dtype_maps_onto_nxd_keys(name: str, dtype: torch.dtype) -> None:
    config = EngineConfig(kv_cache_dtype=name, max_model_len=64).resolve(512)
    kwargs = default_neuron_config(config)
    assert kwargs["kv_cache_quant"] is True
    assert kwargs["kv_quant_config"] == {"quant_dtype": dtype, "direct_cast": True}
    plain = default_neuron_config(EngineConfig(max_model_len=64).resolve(512))
    assert "kv_cache_quant" not in plain and "kv_quant_config" not in plain


def test_calculate_kv_scales_is_refused_before_compiling() -> None:
    config = EngineConfig(backend="nxd", kv_cache_dtype="fp8", calculate_kv_scales=True, max_model_len=64,
                          max_num_seqs=2)
    with pytest.raises(ConfigError, match="--calculate-kv-scales: NxD Inference has no calibration pass"):
        NxdBackend(tiny_model_path("llama"), config)


def test_fp8_kv_on_the_emulator_matches_the_torch_backend() -> None:
    model = str(tiny_model_path("llama"))
    nxd = make_core(model, kv_cache_dtype="fp8", enable_chunked_prefill=False)
    app = nxd.backend.app  # type: ignore[attr-defined]
    assert app.neuron_config.kv_cache_quant and app.neuron_config.kv_quant_config.quant_dtype == torch.float8_e4m3fn
    assert app.target.kv_cache.data.dtype == torch.float8_e4m3fn
    torch_fp8 = make_core(model, "torch", kv_cache_dtype="fp8", enable_chunked_prefill=False)
    expected = tokens(run(torch_fp8, PROMPTS, greedy(16)))
    assert tokens(run(nxd, PROMPTS, greedy(16))) == expected
    assert os.environ.get("UNSAFE_FP8FNCAST") == "1"
