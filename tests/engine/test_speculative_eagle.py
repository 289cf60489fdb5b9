"""The EAGLE head: serving path (slot cache, chained drafting) == training math, and the checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from nxdserve.engine.models import fused_decode
from nxdserve.engine.models.attention import AttentionMetadata
from nxdserve.engine.speculative.eagle_head import EagleHead, head_config_from_target, load_eagle_head, save_eagle_head
from nxdserve.speculative.corpus import Sequence
from nxdserve.speculative.distill import Batch, acceptance, distill_loss, unrolled_forward

VOCAB, HIDDEN, MAX_LEN = 97, 64, 64
TARGET_CONFIG = {
    "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": MAX_LEN, "vocab_size": VOCAB,
    "hidden_act": "silu", "model_type": "llama", "num_hidden_layers": 7,
}


def make_head(seed: int = 0, input_norm: bool = False) -> EagleHead:
    head = EagleHead(head_config_from_target(TARGET_CONFIG, input_norm=input_norm), torch.float32,
                     torch.device("cpu"), MAX_LEN)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return head


def run_slots(head: EagleHead, cache, tokens, feats, slots, starts, lens):  # type: ignore[no-untyped-def]
    meta = AttentionMetadata.build(np.asarray(slots), np.asarray(starts), np.asarray(lens),
                                   num_query_groups=head.num_query_groups, windows=head.windows, max_len=MAX_LEN,
                                   device=torch.device("cpu"))
    with torch.inference_mode():
        return head(tokens, feats, meta, cache)


@pytest.mark.parametrize("input_norm", [False, True])
def test_first_pass_matches_the_slot_cache_path(input_norm: bool) -> None:
    head = make_head(input_norm=input_norm)
    g = torch.Generator().manual_seed(1)
    embeds, feats = torch.randn(2, 20, HIDDEN, generator=g), torch.randn(2, 20, HIDDEN, generator=g)
    with torch.no_grad():
        expected = unrolled_forward(head, embeds, feats, depth=0)[0]
    cache = head.new_kv_cache(4, MAX_LEN)
    # Two rows in other slots, the second split into a chunk and single-token steps, as serving would.
    got0 = run_slots(head, cache, embeds[0], feats[0], [1], [0], [20])
    got1a = run_slots(head, cache, embeds[1, :13], feats[1, :13], [3], [0], [13])
    got1b = [run_slots(head, cache, embeds[1, p : p + 1], feats[1, p : p + 1], [3], [p], [1]) for p in range(13, 20)]
    torch.testing.assert_close(got0, expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([got1a, *got1b]), expected[1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not fused_decode.available(), reason="no AVX512-BF16 C kernels on this machine")
@pytest.mark.parametrize("input_norm", [False, True])
def test_bf16_head_runs_fused_as_close_to_fp32_as_its_layer_path(
    input_norm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bf16 on CPU the head's layer runs through the fused C forward (no final norm; no input norm
    unless the head has one): a chunk, then single-token steps, as close to fp32 as the layer path."""
    reference = make_head(seed=4, input_norm=input_norm)
    g = torch.Generator().manual_seed(2)
    embeds, feats = torch.randn(16, HIDDEN, generator=g), torch.randn(16, HIDDEN, generator=g)

    def serve(head: EagleHead) -> torch.Tensor:
        cache = head.new_kv_cache(3, MAX_LEN)
        e, f = embeds.to(head.dtype), feats.to(head.dtype)
        outs = [run_slots(head, cache, e[:10], f[:10], [2], [0], [10])]
        outs += [run_slots(head, cache, e[p : p + 1], f[p : p + 1], [2], [p], [1]) for p in range(10, 16)]
        return torch.cat(outs).float()

    bf16 = EagleHead(reference.config, torch.bfloat16, torch.device("cpu"), MAX_LEN)
    bf16.load_checkpoint_tensors(reference.named_checkpoint_tensors())
    fused_calls = []
    run = bf16.fused.run
    monkeypatch.setattr(bf16.fused, "run", lambda *a: fused_calls.append(1) or run(*a))
    expected = serve(reference)
    fused = serve(bf16)
    assert len(fused_calls) == 7
    monkeypatch.setattr(fused_decode, "enabled", False)
    layer = serve(bf16)
    assert len(fused_calls) == 7
    scale = expected.abs().max().item()
    fused_err, layer_err = (fused - expected).abs().max().item(), (layer - expected).abs().max().item()
    assert fused_err <= 2 * layer_err + 0.02 * scale, (fused_err, layer_err, scale)


def test_chained_drafting_is_what_the_unrolled_passes_train() -> None:
    """Serving: catch up over real pairs to position s, then chain (token, own output) at s+1, s+2...;
    pass d of the training forward at position s + d must produce the same outputs."""
    head = make_head(seed=3)
    g = torch.Generator().manual_seed(4)
    length, depth = 24, 3
    embeds, feats = torch.randn(1, length, HIDDEN, generator=g), torch.randn(1, length, HIDDEN, generator=g)
    with torch.no_grad():
        passes = unrolled_forward(head, embeds, feats, depth=depth)
    for s in (depth, 9, length - depth - 1):
        cache = head.new_kv_cache(2, MAX_LEN)
        out = run_slots(head, cache, embeds[0, : s + 1], feats[0, : s + 1], [1], [0], [s + 1])
        h = out[-1:]
        torch.testing.assert_close(h[0], passes[0][0, s], rtol=1e-4, atol=1e-4)
        for d in range(1, depth + 1):
            h = run_slots(head, cache, embeds[0, s + d : s + d + 1], h, [1], [s + d], [1])
            torch.testing.assert_close(h[0], passes[d][0, s + d], rtol=1e-4, atol=1e-4)


def test_distill_loss_trains_all_passes() -> None:
    head = make_head()
    g = torch.Generator().manual_seed(5)
    seqs = [Sequence(np.arange(n) % VOCAB, torch.randn(n - 1, HIDDEN, generator=g), 3) for n in (12, 20)]
    batch = Batch.build(seqs)
    lm = torch.randn(VOCAB, HIDDEN, generator=g)
    embeds = F.embedding(batch.tokens[:, 1:], torch.randn(VOCAB, HIDDEN, generator=g))
    for p in head.parameters():
        p.requires_grad_(True)
    loss, logs = distill_loss(unrolled_forward(head, embeds, batch.features, depth=2), batch, lm, chunk=7)
    loss.backward()
    assert torch.isfinite(loss) and set(logs) == {"acc0", "acc1", "acc2"}
    assert head.fc_weight.grad is not None and head.fc_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("nxd", [False, True])
def test_checkpoint_round_trip_and_layouts(tmp_path: Path, nxd: bool) -> None:
    head = make_head(seed=7)
    head.draft_vocab_ids = torch.tensor([5, 3, 9, 1])
    g = torch.Generator().manual_seed(8)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    out = save_eagle_head(head, tmp_path / "head", nxd_layout=nxd, embed_weight=embed, lm_head_weight=embed)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    layer = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {"layers.0.post_attention_layernorm.weight"}
    base = {"fc.weight", "fc.bias"} | layer
    if nxd:  # NxD's fused EAGLE draft: carries the target's head and embedding, no input norm, no final norm
        assert names == base | {"lm_head.weight", "embed_tokens.weight"}
    else:
        assert names == base | {"draft_vocab_ids"}
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    assert config["fc_bias"] is True and config["rope_theta"] == 10000.0
    loaded = load_eagle_head(out, torch.float32, torch.device("cpu"), MAX_LEN)
    for (name, a), (_, b) in zip(head.named_parameters(), loaded.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    if nxd:
        assert loaded.draft_vocab_ids is None
    else:
        assert loaded.draft_vocab_ids is not None and loaded.draft_vocab_ids.tolist() == [5, 3, 9, 1]


def test_acceptance_runs_in_the_heads_dtype_on_bf16_features() -> None:
    """The corpus keeps the target's bf16 states as bf16, and a bf16 head (what serving runs) must be
    measurable directly; a head that predicts the next token exactly is accepted at every position."""
    g = torch.Generator().manual_seed(9)
    feats = torch.randn(15, HIDDEN, generator=g).to(torch.bfloat16)
    seq = Sequence(np.arange(16) % VOCAB, feats, 3)
    batch = Batch.build([seq])
    assert batch.features.dtype == torch.float32
    assert torch.equal(batch.features[0], feats.float())  # bf16 -> float32 is exact
    head = make_head(seed=2).to(torch.bfloat16)
    head.dtype = torch.bfloat16
    lm = torch.randn(VOCAB, HIDDEN, generator=g)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    result = acceptance(head, [seq], embed.to(torch.bfloat16), lm.to(torch.bfloat16), None, 2)
    assert result["rounds"] == 16 - 2 - 1 - 2  # starts at the first response round, leaves room for k + 1 tokens
    assert len(result["per_position"]) == 2  # type: ignore[arg-type]
    # An "oracle" draft vocabulary: whatever the head argmaxes maps to the true next token when the
    # vocabulary is a single id and the text repeats that id.
    const = Sequence(np.full(16, 5), feats, 3)
    exact = acceptance(head, [const], embed.to(torch.bfloat16), lm[:1].to(torch.bfloat16), torch.tensor([5]), 2)
    assert exact["per_position"] == [1.0, 1.0] and exact["mean_acceptance_length"] == 3.0
