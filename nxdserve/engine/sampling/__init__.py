"""Vectorised per-row sampling and speculative verification shared by every backend."""

from nxdserve.engine.sampling.logprobs import compute_logprobs
from nxdserve.engine.sampling.sampler import SampleOutput, Sampler, VerifyOutput

__all__ = ["SampleOutput", "Sampler", "VerifyOutput", "compute_logprobs"]
