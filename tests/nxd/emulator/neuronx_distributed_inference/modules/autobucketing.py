"""Sequence buckets, as NxDI generates them (prefix caching and batch bucketing are not emulated)."""

from __future__ import annotations

from math import log2
from typing import Any


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    if min_length == max_length:
        return [max_length]
    min_bound = int(log2(min_length))
    max_bound = round(log2(max_length))
    return [2**i for i in range(min_bound, max_bound)] + [max_length]


def generate_buckets_for_cte(config: Any) -> list[int]:
    nc = config.neuron_config
    if not nc.enable_bucketing:
        return generate_buckets(nc.max_context_length, nc.max_context_length)
    if nc.context_encoding_buckets is not None:
        return list(nc.context_encoding_buckets)
    return generate_buckets(128, nc.max_context_length)


def generate_buckets_for_tkg(config: Any) -> list[int]:
    nc = config.neuron_config
    if not nc.enable_bucketing:
        return generate_buckets(nc.max_length, nc.max_length)
    if nc.token_generation_buckets is not None:
        return list(nc.token_generation_buckets)
    return generate_buckets(128, nc.max_length)


generate_buckets_for_fused_spec = generate_buckets_for_tkg
