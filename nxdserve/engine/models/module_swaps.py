"""A process-wide count of attribute assignments on the decoder's modules.

Per-step caches keyed on which weight objects a model holds (the fused quantized forward's table of pointers:
``fused_qdecode.py``) would otherwise have to look at every layer's attributes each step to notice a swap, such as
``quantize_linears`` putting a ``QuantLinear`` where a dense weight was, or a norm's weight replaced. That scan cost
~0.14 ms of a ~10 ms single-stream CPU step on SmolLM2's 30 layers. With this, they compare one integer and scan
only after an assignment.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class SwapCounted(nn.Module):
    """An ``nn.Module`` whose attribute assignments and deletions bump ``generation()``. Tensors changed in place
    keep their objects and do not count, as they did not for the caches' own keys."""

    _generation = 0

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        SwapCounted._generation += 1

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        SwapCounted._generation += 1


def generation() -> int:
    """Bumped by every attribute assignment on any ``SwapCounted`` module since the process started."""
    return SwapCounted._generation
