"""--backend auto|nxd|torch: which backend runs, and why, with and without NxD and a Neuron device."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.backends import nxd_status, select_backend_name
from nxdserve.engine.loader import build_engine_core
from nxdserve.errors import ConfigError
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.conftest import EMULATOR_ROOT, _purge


@pytest.fixture
def without_nxd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(EMULATOR_ROOT)])
    _purge()


@pytest.fixture
def broken_nxd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An installed package that fails on import, like a placeholder wheel or a missing torch-neuronx."""
    package = tmp_path / "neuronx_distributed_inference"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('No module named torch_neuronx')\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p != str(EMULATOR_ROOT)])
    _purge()


def test_torch_is_always_available() -> None:
    assert select_backend_name("torch") == "torch"


def test_auto_needs_a_device(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import nxdserve.engine.backends as backends

    monkeypatch.setattr(backends, "neuron_devices", list)  # no device, even on a Neuron host
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends"):
        assert select_backend_name("auto") == "torch"
    assert "no Neuron device" in caplog.text


def test_auto_picks_nxd_with_nxd_and_a_device(neuron_device: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nxdserve.engine.backends"):
        assert select_backend_name("auto") == "nxd"
    assert "auto -> nxd" in caplog.text and nxd_status()[0]


def test_auto_builds_the_nxd_engine(neuron_device: None) -> None:
    config = EngineConfig(model=str(tiny_model_path("llama")), dtype="float32", max_model_len=128, max_num_seqs=2)
    core, _ = build_engine_core(config, with_metrics=False)
    assert core.backend.name == "nxd"
    assert core.capabilities.decode_all_live_slots and not core.capabilities.mixed_prefill_decode


def test_nxd_without_nxd_fails_at_startup_with_install_instructions(without_nxd: None) -> None:
    assert select_backend_name("auto") == "torch"
    with pytest.raises(ConfigError, match=r"not installed.*pip\.repos\.neuron\.amazonaws\.com"):
        select_backend_name("nxd")


def test_a_broken_install_is_reported(broken_nxd: None, neuron_device: None) -> None:
    ok, why = nxd_status()
    assert not ok and "does not import" in why and "torch_neuronx" in why
    assert select_backend_name("auto") == "torch"
    with pytest.raises(ConfigError, match="does not import"):
        select_backend_name("nxd")


def test_unknown_backend() -> None:
    with pytest.raises(ConfigError, match="unknown backend"):
        select_backend_name("tpu")
