"""Data parallel on one machine: ``--data-parallel-size N`` engine processes behind one API server."""

from __future__ import annotations

from typing import Any

from nxdserve.config import EngineConfig


def create_engine(config: EngineConfig) -> Any:
    """An AsyncEngine, or a DataParallelEngine over ``config.data_parallel_size`` engine processes."""
    if config.data_parallel_size > 1:
        from nxdserve.engine.dp.client import DataParallelEngine

        return DataParallelEngine(config)
    from nxdserve.engine.async_engine import AsyncEngine

    return AsyncEngine(config)
