"""On-device sampling as NxDI does it: ``[top_k, top_p, temperature]`` rows, validated, then
global top-k -> per-row top-k -> temperature -> top-p -> a multinomial draw from a cumulative sum.

The RNG is torch's global one: like the device sampler, there are no per-request generators.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig

logger = logging.getLogger(__name__)

IGNORED_LOGITS_VALUE = -3000.0


def validate_sampling_params(params: torch.Tensor, on_device_sampling_config: Any) -> None:
    if params.dim() != 2 or params.shape[1] != 3:
        raise ValueError(f"Expected tensor of shape (batch_size, 3), but got {params.shape}")
    params = params.to(torch.float32)
    top_k, top_p, temperature = params[:, 0], params[:, 1], params[:, 2]
    if isinstance(on_device_sampling_config, OnDeviceSamplingConfig):
        global_top_k = on_device_sampling_config.global_topk
    else:
        global_top_k = on_device_sampling_config["global_topk"]
    valid_top_k = (top_k == -1) | ((top_k >= 0) & (top_k <= global_top_k))
    if not torch.all(valid_top_k):
        raise ValueError(
            "Invalid top-k values found. top-k must be -1 or greater than 0 but less than or equal to "
            f"{global_top_k=}. Found {top_k=}."
        )
    if torch.any(top_k == -1) or torch.any(top_k == 0):
        logger.warning(
            "In NxDI, top_k = -1 or top_k = 0 means randomly picking a token from the vocabulary with a "
            "uniform distribution."
        )
    if not torch.equal(top_k, top_k.floor()):
        raise ValueError(
            "Invalid top-k values found. top-k values should be able to be represented as integer values, "
            f"but found decimal parts. Found {top_k=}."
        )
    if not torch.all((top_p > 0.0) & (top_p <= 1.0)):
        raise ValueError(f"Invalid top-p values found. top-p must be in the range (0.0, 1.0]. Found {top_p=}.")
    if not torch.all(temperature >= 0.0):
        raise ValueError(
            "Invalid temperature values found. Temperature must be greater than or equal to 0.0. "
            f"Found {temperature=}."
        )
    if torch.any((temperature == 0.0) & ((top_k == -1) | (top_k == 0))):
        raise ValueError(
            "Invalid sampling parameters found. Temperature = 0 enables greedy sampling. Please set top_k to 1"
        )


def infer_sampling_params(params: torch.Tensor) -> torch.Tensor:
    for i in range(params.shape[0]):
        if params[i, 2] == 0:
            params[i, 0] = 1
            params[i, 1] = 1
    return params


def prepare_tensor(val: Any) -> torch.Tensor:
    if not torch.is_tensor(val):
        val = torch.tensor(val if isinstance(val, list) else [val])
    return val


def prepare_sampling_params(
    batch_size: int,
    top_k: Any = (1,),
    top_p: Any = (1.0,),
    temperature: Any = (1.0,),
) -> torch.Tensor:
    top_k_t = prepare_tensor(list(top_k) if isinstance(top_k, tuple) else top_k)
    top_p_t = prepare_tensor(list(top_p) if isinstance(top_p, tuple) else top_p)
    temp_t = prepare_tensor(list(temperature) if isinstance(temperature, tuple) else temperature)
    assert top_k_t.shape[0] == top_p_t.shape[0] == temp_t.shape[0], "sampling params shapes don't match."
    if top_k_t.shape[0] == 1:
        top_k_t = top_k_t.broadcast_to(batch_size)
        top_p_t = top_p_t.broadcast_to(batch_size)
        temp_t = temp_t.broadcast_to(batch_size)
    return torch.stack([top_k_t, top_p_t, temp_t], dim=1)


class Sampler:
    """``forward(logits (B, V), params (B, 3)) -> tokens (B,)``, the on-CPU variant of NxDI's sampler."""

    def __init__(self, neuron_config: NeuronConfig, do_sample: bool | None = None) -> None:
        odsc = neuron_config.on_device_sampling_config
        assert odsc is not None, "on device configs is not initialized"
        self.do_sample = odsc.do_sample if do_sample is None else do_sample
        self.dynamic = odsc.dynamic
        self.deterministic = odsc.deterministic
        self.global_topk = odsc.global_topk

    def forward(self, token_logits: torch.Tensor, sampling_params: torch.Tensor) -> torch.Tensor:
        if not (self.do_sample or self.dynamic):
            return torch.argmax(token_logits, dim=-1)
        return self._multinomial_sample(token_logits.float(), sampling_params.float())

    __call__ = forward

    def _multinomial_sample(self, logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        dim = logits.dim() - 1
        shape = (logits.shape[0],) + (1,) * dim
        top_k, top_p, temperature = (params[:, i].reshape(shape) for i in range(3))
        if self.global_topk > 0:
            values, indices = torch.topk(logits, k=min(self.global_topk, logits.shape[-1]), dim=dim)
        else:
            values, indices = torch.sort(logits, dim=dim, descending=True)
        rank = torch.arange(values.shape[-1]).broadcast_to(values.shape)
        values = values.masked_fill(rank >= top_k, IGNORED_LOGITS_VALUE)
        if self.dynamic or torch.any(temperature != 1.0):
            values = values / temperature
        if self.dynamic or torch.any(top_p < 1.0):
            cumsum = torch.cumsum(torch.softmax(values, dim=dim), dim=dim)
            top_p = torch.max(torch.min(cumsum), top_p)
            mask = torch.greater(cumsum, top_p)
            mask[..., 0] = False  # keep at least one token
            values = values.masked_fill(mask, IGNORED_LOGITS_VALUE)
        probs = torch.softmax(values, dim=dim)
        cumsum = torch.cumsum(probs, dim=dim)
        cumsum = cumsum / cumsum[..., -1:]
        cumsum[..., -1:] = 1
        draw_shape = (*cumsum.shape[:-1], 1)
        rand = torch.full(draw_shape, 0.5) if self.deterministic else torch.rand(draw_shape)
        counts = torch.sum(torch.greater(rand, cumsum), dim=dim).unsqueeze(dim)
        return torch.gather(indices, dim=dim, index=counts).squeeze(dim)
