"""vLLM's data-parallel flags for ``nxdserve``: what one machine supports, and a clear error for the rest."""

from __future__ import annotations

import argparse
import dataclasses

from nxdserve.config import EngineConfig
from nxdserve.errors import ConfigError

_MULTI_NODE = ("data_parallel_address", "data_parallel_rpc_port", "data_parallel_start_rank", "data_parallel_rank")


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel (one machine; across machines: docs/scale-out.md)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine processes behind this API server, each on its own cores / NeuronCores")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="engines on this machine; must equal --data-parallel-size (one machine only)")
    g.add_argument("--data-parallel-backend", "-dpb", default="mp", choices=["mp", "ray"],
                   help="mp: local processes; ray: not here, use nxdserve.deploy.ray_serve")
    g.add_argument("--data-parallel-address", "-dpa", default=None, help="multi-node: not supported (an error)")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                   help="multi-node: not supported (an error)")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                   help="multi-node: not supported (an error)")
    g.add_argument("--data-parallel-rank", type=int, default=None,
                   help="external load balancing: not supported (an error); run one server per replica instead")


def apply_data_parallel_args(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """``config`` with ``data_parallel_size`` set, or a ConfigError naming the flag this server cannot honour."""
    size = args.data_parallel_size
    if size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {size}")
    if args.data_parallel_size_local is not None and args.data_parallel_size_local != size:
        raise ConfigError("--data-parallel-size-local must equal --data-parallel-size: nxdserve's data parallel "
                          "runs on one machine; across machines run one server per machine (docs/scale-out.md)")
    if args.data_parallel_backend == "ray":
        raise ConfigError("--data-parallel-backend ray is not supported: deploy replicas with Ray Serve "
                          "(nxdserve.deploy.ray_serve, docs/scale-out.md)")
    for name in _MULTI_NODE:
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is not supported: nxdserve's data parallel runs on one machine; across "
                              "machines use Kubernetes or Ray Serve replicas (docs/scale-out.md)")
    if size > 1 and config.enable_lora:
        raise ConfigError("--enable-lora with --data-parallel-size > 1 is not supported yet: each engine process "
                          "would keep its own adapters; run one server per replica instead (docs/scale-out.md)")
    return dataclasses.replace(config, data_parallel_size=size)
