"""The grouped LoRA step against each token's own adapter applied module by module: trimmed to the active
adapters' largest rank and skipping the linears none of them targets, it adds exactly ``B (A x)`` per token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nxdserve.engine.models.spec import ModelSpec
from nxdserve.lora.adapter import TARGETS, LoraAdapter, target_shapes
from nxdserve.lora.stack import LINEARS, PER_ADAPTER_MIN_TOKENS, LoraStack
from nxdserve.model_files import load_hf_config
from tests.helpers.tiny_model import tiny_model_path


def _adapter(spec: ModelSpec, int_id: int, rank: int, modules: tuple[str, ...], layers: range) -> LoraAdapter:
    shapes, g = target_shapes(spec), torch.Generator().manual_seed(int_id)
    weights = {(layer, m): (torch.randn(rank, shapes[m][0], generator=g), torch.randn(shapes[m][1], rank, generator=g))
               for layer in layers for m in modules}
    return LoraAdapter(f"a{int_id}", int_id, "/none", rank, 1.0, frozenset(modules), weights)


def _reference(spec: ModelSpec, adapter: LoraAdapter | None, layer: int, linear: str, x: torch.Tensor) -> torch.Tensor:
    """The delta one token gets on ``linear``: each PEFT module's B (A x), placed at its slice."""
    pieces = [m for m, (lin, _) in TARGETS.items() if lin == linear]
    out = []
    for module in pieces:
        fan_out = target_shapes(spec)[module][1]
        pair = None if adapter is None else adapter.weights.get((layer, module))
        out.append(torch.zeros(fan_out, dtype=torch.float64) if pair is None else
                   pair[1].double() @ (pair[0].double() @ x.double()))
    return torch.cat(out)


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.from_hf_config(load_hf_config(tiny_model_path("llama")))


@pytest.mark.parametrize("num_tokens", [5, PER_ADAPTER_MIN_TOKENS + 3])  # the grouped path, the per-adapter one
def test_trimmed_and_skipped_step_adds_each_tokens_adapter(spec: ModelSpec, num_tokens: int) -> None:
    attn = _adapter(spec, 1, 4, ("q_proj", "v_proj"), range(spec.num_layers))
    mlp_first_layer = _adapter(spec, 2, 8, ("gate_proj", "down_proj"), range(1))
    stack = LoraStack(spec, 3, 16, torch.float32, torch.device("cpu"))
    stack.use_kernel = False  # the torch GEMM paths; tests/lora/test_lora_kernel.py covers the fused kernel
    slots = {a.int_id: stack.slot_for(a, set()) for a in (attn, mlp_first_layer)}
    by_slot = {slots[1]: attn, slots[2]: mlp_first_layer, -1: None}
    token_slots = np.array([[slots[1], -1, slots[2], slots[1], slots[2]][i % 5] for i in range(num_tokens)])
    step = stack.step(token_slots)
    assert step is not None and step.num_adapters == 2
    assert (step.rows is not None) == (num_tokens >= PER_ADAPTER_MIN_TOKENS)
    for layer in range(spec.num_layers):
        targeted = {"qkv", "gate_up", "down"} if layer == 0 else {"qkv"}
        assert set(step.weights[layer]) == targeted  # "o" is targeted by neither: no GEMMs for it
        a, b, _ = step.weights[layer]["qkv"]
        assert a.shape[1] == b.shape[0] == 2 * 3 * 8  # K adapters x 3 packed modules x the largest rank, not 16
        for linear in LINEARS:
            fan_in, fan_out, _ = stack.layout[linear]
            x = torch.randn(len(token_slots), fan_in)
            base = torch.randn(len(token_slots), fan_out)
            got = step.add(base.clone(), layer, linear, x) - base
            head = step.add(base[:3].clone(), layer, linear, x[:3]) - base[:3]  # a leading part of the tokens
            torch.testing.assert_close(head, got[:3], rtol=1e-4, atol=1e-4)
            for t, slot in enumerate(token_slots):
                expected = _reference(spec, by_slot[int(slot)], layer, linear, x[t])
                torch.testing.assert_close(got[t].double(), expected, rtol=1e-4, atol=1e-4)
    one = stack.step(np.array([slots[1], slots[1]]))
    assert one is not None and one.one_hot is None and one.weights[0]["qkv"][0].shape[1] == 3 * 4
