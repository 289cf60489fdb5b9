"""``nxdserve``'s serve flags: every ``vllm serve`` flag of vLLM 0.11+, each implemented, accepted with no
effect (one info line), refused with what to do instead, or "not yet" (another issue's feature).

``python -m nxdserve.cli_args`` prints docs/flags.md.
"""

from __future__ import annotations

from nxdserve.cli_args.engine_flags import (
    add_cache_flags,
    add_load_flags,
    add_model_flags,
    add_multimodal_and_lora_flags,
    add_nxdserve_flags,
    add_observability_and_misc_flags,
    add_parallel_flags,
    add_scheduler_flags,
)
from nxdserve.cli_args.frontend_flags import API_KEY_ENVS, add_frontend_flags
from nxdserve.cli_args.registry import Flag, ServeParser, check_flags, flags_markdown, log_infos
from nxdserve.cli_args.types import json_object, size

__all__ = [
    "API_KEY_ENVS",
    "Flag",
    "ServeParser",
    "add_serve_flags",
    "check_flags",
    "flags_markdown",
    "json_object",
    "log_infos",
    "size",
]


def add_serve_flags(parser: ServeParser) -> None:
    """Every serve flag, in vLLM's help order, then nxdserve's own."""
    add_frontend_flags(parser)
    add_model_flags(parser)
    add_load_flags(parser)
    add_parallel_flags(parser)
    add_cache_flags(parser)
    add_multimodal_and_lora_flags(parser)
    add_observability_and_misc_flags(parser)
    add_scheduler_flags(parser)
    add_nxdserve_flags(parser)
