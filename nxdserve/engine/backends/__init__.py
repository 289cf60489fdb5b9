"""Backend selection: ``nxd`` where NxD Inference and a Neuron device exist, else ``torch``."""

from __future__ import annotations

import glob
import importlib.util
import logging
from pathlib import Path

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.base import Backend
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

NXD_INSTALL_HINT = (
    "NxD Inference is not installed. On a Trn1/Inf2/Trn2 instance install it from AWS's Neuron pip "
    "repository: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "neuronx-distributed-inference (the packages of that name on PyPI are placeholders). "
    "See docs/neuron.md."
)


def nxd_status() -> tuple[bool, str]:
    """Whether the nxd backend can run here, and why (for the startup log)."""
    if importlib.util.find_spec("neuronx_distributed_inference") is None:
        return False, "neuronx_distributed_inference is not installed"
    if not glob.glob("/dev/neuron*"):
        return False, "neuronx_distributed_inference is installed but no Neuron device (/dev/neuron*) is visible"
    return True, "neuronx_distributed_inference imports and a Neuron device is visible"


def select_backend_name(requested: str) -> str:
    if requested == "torch":
        return "torch"
    ok, why = nxd_status()
    if requested == "nxd":
        if importlib.util.find_spec("neuronx_distributed_inference") is None:
            raise ConfigError(f"--backend nxd: {NXD_INSTALL_HINT}")
        return "nxd"
    if requested != "auto":
        raise ConfigError(f"unknown backend {requested!r}; choose auto, torch or nxd")
    name = "nxd" if ok else "torch"
    logger.info("backend auto -> %s (%s)", name, why)
    return name


def create_backend(config: EngineConfig, model_path: Path) -> Backend:
    name = select_backend_name(config.backend)
    if name == "nxd":
        from nxdserve.engine.backends.nxd import NxdBackend

        return NxdBackend(model_path, config)
    from nxdserve.engine.backends.torch_backend import TorchBackend

    return TorchBackend(model_path, config)
