"""Data parallel on one machine: ``--data-parallel-size N`` engine processes behind one API server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nxdserve.config import EngineConfig

if TYPE_CHECKING:
    from nxdserve.api.engine_protocol import EngineClient


def create_engine(config: EngineConfig) -> EngineClient:
    """An AsyncEngine, or a DataParallelEngine over ``config.data_parallel_size`` engine processes."""
    if config.data_parallel_size > 1:
        from nxdserve.engine.dp.client import DataParallelEngine

        return DataParallelEngine(config)
    from nxdserve.engine.async_engine import AsyncEngine

    return AsyncEngine(config)
