"""``backend``: the engine-level LoRA tests run on the torch backend and on the nxd backend through the NxD
emulator (tests/nxd/emulator). Module-scoped, so pytest runs a module's torch tests, then puts the emulator in
place once for its nxd tests and takes it away after them."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from tests.nxd.conftest import EMULATOR_ROOT, _purge

BACKENDS = ("torch", "nxd")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "torch":
        yield "torch"
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("NXDSERVE_NEURON_ARTIFACTS", str(tmp_path_factory.mktemp("neuron-artifacts")))
    mp.delenv("NEURON_COMPILED_ARTIFACTS", raising=False)
    _purge()
    sys.path.insert(0, str(EMULATOR_ROOT))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield "nxd"
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(EMULATOR_ROOT))
        _purge()
        mp.undo()
