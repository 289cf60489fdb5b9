"""Records the sizes of the forwards the fused bf16 C forward runs (fused_decode.FusedDecode.run)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nxdserve.engine.models import fused_decode


def record_fused_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (for the test), each fused bf16 forward appends its token count to the returned list."""
    sizes: list[int] = []
    real_run = fused_decode.FusedDecode.run

    def counting_run(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(int(x.shape[0]))
        return real_run(self, x, *args, **kwargs)

    monkeypatch.setattr(fused_decode.FusedDecode, "run", counting_run)
    return sizes
