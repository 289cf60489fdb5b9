"""--quantization on the nxd backend: not mapped onto NxD's keys yet (issue 29 item 4), so a clear error that
points at NxD's own keys, raised before anything compiles."""

from __future__ import annotations

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd.backend import NxdBackend
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path


def test_quantization_on_the_nxd_backend_is_a_clear_config_error() -> None:
    config = EngineConfig(backend="nxd", quantization="int8", max_model_len=64, max_num_seqs=2)
    with pytest.raises(ConfigError, match=r"--quantization int8: the nxd backend does not map it yet.*quantized"):
        NxdBackend(tiny_model_path("llama"), config)
