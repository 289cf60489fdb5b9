"""Fixtures that put the NxD emulator in place of ``neuronx_distributed_inference``.

``nxd_emulator`` (autouse, per module) puts ``tests/nxd/emulator`` first on ``sys.path`` so the
backend's real ``import neuronx_distributed_inference...`` statements load the emulator, points the
artifact cache at a temporary folder, and undoes both afterwards (modules included), so tests
elsewhere never see a fake NxD.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

EMULATOR_ROOT = Path(__file__).parent / "emulator"
PACKAGE = "neuronx_distributed_inference"


def _purge() -> None:
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module", autouse=True)
def nxd_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    artifacts = tmp_path_factory.mktemp("neuron-artifacts")
    mp = pytest.MonkeyPatch()
    mp.setenv("NXDSERVE_NEURON_ARTIFACTS", str(artifacts))
    mp.delenv("NEURON_COMPILED_ARTIFACTS", raising=False)
    _purge()
    sys.path.insert(0, str(EMULATOR_ROOT))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster than two fighting over shared cores
    try:
        yield artifacts
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(EMULATOR_ROOT))
        _purge()
        mp.undo()


@pytest.fixture
def neuron_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make one Neuron device "visible" to backend selection (the only thing patched: a device list)."""
    import nxdserve.engine.backends as backends

    monkeypatch.setattr(backends, "neuron_devices", lambda: ["/dev/neuron0"])
