"""Which devices each data-parallel engine gets: its own CPU cores, and on Neuron its own NeuronCores.

Each engine process pins itself to its cores before its engine starts (and sizes torch's intra-op pool to
them) and, on Neuron, sees only its NeuronCores through ``NEURON_RT_VISIBLE_CORES``, which the Neuron runtime
reads when it initialises (at model load), as the runtime documents for several models on one instance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nxdserve.errors import ConfigError

NEURON_CORES_ENV = "NEURON_RT_VISIBLE_CORES"


@dataclass(frozen=True)
class Placement:
    index: int
    cpus: tuple[int, ...]
    env: dict[str, str] = field(default_factory=dict)

    def apply(self) -> None:
        """In the engine process, before torch or the Neuron runtime load."""
        os.environ.update(self.env)
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)


def split_evenly(items: list[int], parts: int) -> list[tuple[int, ...]]:
    """Contiguous groups, the first ones one larger where ``items`` does not divide."""
    size, extra = divmod(len(items), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        groups.append(tuple(items[start:end]))
        start = end
    return groups


def parse_core_list(text: str) -> list[int]:
    """``NEURON_RT_VISIBLE_CORES``'s forms: "0-3", "4", "0,1,2"."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def plan(size: int, tensor_parallel_size: int, backend: str, cpus: list[int] | None = None,
         neuron_cores: list[int] | None = None) -> list[Placement]:
    """One placement per engine: the CPU cores split evenly; for Neuron (backend nxd or auto), each engine gets
    ``tensor_parallel_size`` NeuronCores of the visible ones (all of ``NEURON_RT_VISIBLE_CORES`` if set,
    else 0..size*tp-1)."""
    if size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {size}")
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < size:
        raise ConfigError(f"--data-parallel-size {size} needs at least {size} CPU cores; this process has {len(cpus)}")
    cpu_groups = split_evenly(cpus, size)
    neuron_groups: list[str | None] = [None] * size
    if backend in ("nxd", "auto"):
        if neuron_cores is None:
            visible = os.environ.get(NEURON_CORES_ENV)
            neuron_cores = parse_core_list(visible) if visible else list(range(size * tensor_parallel_size))
        if len(neuron_cores) < size * tensor_parallel_size:
            raise ConfigError(
                f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs "
                f"{size * tensor_parallel_size} NeuronCores; {NEURON_CORES_ENV} names {len(neuron_cores)}"
            )
        tp = tensor_parallel_size
        neuron_groups = [",".join(map(str, neuron_cores[i * tp:(i + 1) * tp])) for i in range(size)]
    placements = []
    for i in range(size):
        env: dict[str, str] = {}
        if neuron_groups[i] is not None:
            env[NEURON_CORES_ENV] = str(neuron_groups[i])
        placements.append(Placement(i, cpu_groups[i], env))
    return placements
