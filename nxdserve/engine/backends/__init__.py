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
    "On a Trn1/Inf2/Trn2 instance install NxD Inference from AWS's Neuron pip "
    "repository: pip install --extra-index-url https://pip.repos.neuron.amazonaws.com "
    "neuronx-distributed-inference (the packages of that name on PyPI are placeholders). "
    "See docs/neuron.md."
)


def neuron_devices() -> list[str]:
    """Neuron device nodes visible to this process (``/dev/neuron0`` ...). Tests patch this function."""
    return sorted(glob.glob("/dev/neuron*"))


def nxd_import_error() -> str | None:
    """None when ``neuronx_distributed_inference`` imports; else why not (a placeholder wheel from PyPI,
    or a missing torch-neuronx / neuronx-distributed, fails here rather than at model load)."""
    if importlib.util.find_spec("neuronx_distributed_inference") is None:
        return "neuronx_distributed_inference is not installed"
    try:
        importlib.import_module("neuronx_distributed_inference.models.config")
    except Exception as exc:  # any failure means "cannot use it"; the message says which
        return f"neuronx_distributed_inference is installed but does not import ({type(exc).__name__}: {exc})"
    return None


def nxd_status() -> tuple[bool, str]:
    """Whether the nxd backend can run here, and why (for the startup log)."""
    if importlib.util.find_spec("neuronx_distributed_inference") is None:
        return False, "neuronx_distributed_inference is not installed"
    if not neuron_devices():
        return False, "neuronx_distributed_inference is installed but no Neuron device (/dev/neuron*) is visible"
    error = nxd_import_error()
    if error is not None:
        return False, error
    return True, "neuronx_distributed_inference imports and a Neuron device is visible"


def select_backend_name(requested: str) -> str:
    if requested == "torch":
        return "torch"
    if requested == "nxd":
        error = nxd_import_error()
        if error is not None:
            raise ConfigError(f"--backend nxd: {error}. {NXD_INSTALL_HINT}")
        if not neuron_devices():
            logger.warning("--backend nxd: no Neuron device (/dev/neuron*) is visible; loading will likely fail")
        logger.info("backend nxd (requested)")
        return "nxd"
    if requested != "auto":
        raise ConfigError(f"unknown backend {requested!r}; choose auto, torch or nxd")
    ok, why = nxd_status()
    name = "nxd" if ok else "torch"
    logger.info("backend auto -> %s (%s)", name, why)
    return name


def create_backend(config: EngineConfig, model_path: Path) -> Backend:
    name = select_backend_name(config.backend)
    if name == "nxd":
        from nxdserve.engine.backends.nxd import NxdBackend

        return NxdBackend(model_path, config)
    from nxdserve.engine.backends.torch_backend import TorchBackend

    _note_nxd_only_settings(config)
    return TorchBackend(model_path, config)


def _note_nxd_only_settings(config: EngineConfig) -> None:
    """One line for each NxD setting the torch backend cannot honour, so that none looks honoured."""
    if config.tensor_parallel_size > 1:
        logger.info("--tensor-parallel-size %d: the torch backend runs the model whole on one device (its CPU "
                    "threads are set by --num-threads); the degree applies on the nxd backend (NxD's tp_degree)",
                    config.tensor_parallel_size)
    if config.override_neuron_config:
        logger.info("--override-neuron-config %s: no effect on the torch backend (NxD's NeuronConfig only)",
                    sorted(config.override_neuron_config))
