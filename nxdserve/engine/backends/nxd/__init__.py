"""The NxD Inference backend (AWS Trainium / Inferentia). See docs/neuron.md."""

from nxdserve.engine.backends.nxd.backend import NxdBackend

__all__ = ["NxdBackend"]
