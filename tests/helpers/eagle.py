"""Untrained EAGLE heads for a target, saved to a temporary folder once per (target, kind)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

from nxdserve.engine.speculative.eagle_head import EagleHead, head_config_from_target, save_eagle_head
from nxdserve.model_files import resolve_model


@cache
def eagle_head(target: str | None, kind: str) -> str:
    """EAGLE heads for a target. "identity": fc passes the target feature through and the layer adds
    nothing, so it drafts the target's own last prediction again (accepted when the target repeats);
    "random": random weights and a truncated 2000-token draft vocabulary (almost never accepted).
    Neither is trained; they exercise the proposer's bookkeeping, not its quality."""
    folder = Path(tempfile.mkdtemp(prefix=f"nxdserve-eagle-{kind}-"))
    atexit.register(shutil.rmtree, folder, True)
    target_config = json.loads((resolve_model(target) / "config.json").read_text())
    head = EagleHead(head_config_from_target(target_config), torch.float32, torch.device("cpu"), 512)
    g = torch.Generator().manual_seed(0)
    size = head.spec.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.05 * torch.randn(p.shape, generator=g))
        if kind == "identity":
            head.fc_weight.zero_()
            head.fc_weight[:, size:] = torch.eye(size)
            assert head.fc_bias is not None
            head.fc_bias.zero_()
            head.layer.o_weight.zero_()
            head.layer.down_weight.zero_()
        else:
            head.draft_vocab_ids = torch.randperm(int(target_config["vocab_size"]), generator=g)[:2000]
    save_eagle_head(head, folder)
    return str(folder)
