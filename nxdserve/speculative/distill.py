"""Training math for the EAGLE-1 head: an unrolled forward that mimics chained drafting, and losses.

Serving runs the head like this for a request with N tokens: a catch-up pass over real pairs
(token t+1, target feature f_t) up to position N-2, then chained steps at positions N-1, N, ...
whose feature is the head's own previous output and which attend to the real positions before
them plus the chained positions so far. Training with teacher forcing only (pass 0) teaches the
first draft well but leaves later drafts to compound their own errors, so the forward here unrolls
``depth`` extra passes with exactly that visibility (the "training-time test" of EAGLE-3, applied
to an EAGLE-1 head):

- pass 0 at position p: input (x_{p+1}, f_p); keys: pass-0 positions <= p (causal);
- pass d at position p: input (x_{p+1}, h^{(d-1)}_{p-1}); keys: pass-0 positions <= p - d and,
  for j = 1..d, the pass-j key at position p - d + j (the chain so far, including itself).

Every pass's output at p is trained to be f_{p+1} (smooth L1) and to give the target's next-token
distribution softmax(W f_{p+1}) through the LM head (cross-entropy, restricted to the draft
vocabulary when one is used), with EAGLE's weights: regression + 0.1 x classification.
Attention here is plain SDPA over (batch, heads, positions); ``tests`` check pass 0 against the
serving path (``EagleHead.forward`` over the slot cache) so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nxdserve.engine.models.rope import apply_rope
from nxdserve.engine.speculative.eagle_head import EagleHead
from nxdserve.speculative.corpus import Sequence

CLS_WEIGHT = 0.1  # EAGLE-1's weight of the token loss against the feature regression


@dataclass
class Batch:
    """Sequences padded to P = max length - 1 pair positions."""

    tokens: torch.Tensor  # (B, P + 1) int64, 0-padded
    features: torch.Tensor  # (B, P, H) float32: f_p, 0-padded
    num_pairs: torch.Tensor  # (B,) int64 positions p with a known f_{p+1}: p <= L - 3
    prompt_len: torch.Tensor  # (B,) int64

    @classmethod
    def build(cls, seqs: list[Sequence], max_len: int | None = None) -> Batch:
        lengths = [min(s.tokens.size, max_len or s.tokens.size) for s in seqs]
        width = max(lengths)
        size = seqs[0].features.shape[-1]
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        features = torch.zeros(len(seqs), width - 1, size)
        for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
            tokens[i, :n] = torch.from_numpy(s.tokens[:n])
            features[i, : n - 1] = s.features[: n - 1]
        return cls(
            tokens=tokens,
            features=features,
            num_pairs=torch.tensor([max(n - 2, 0) for n in lengths]),
            prompt_len=torch.tensor([s.prompt_len for s in seqs]),
        )

    def to(self, device: torch.device) -> Batch:
        if device.type == "cpu":
            return self
        return Batch(self.tokens.to(device), self.features.to(device), self.num_pairs.to(device),
                     self.prompt_len.to(device))


def _pass_mask(num_positions: int, depth: int, device: torch.device) -> torch.Tensor:
    """(P, (depth + 1) * P) bool: which keys pass ``depth``'s queries see (see the module docstring)."""
    p = torch.arange(num_positions, device=device)[:, None]
    key = torch.arange(num_positions, device=device)[None, :]
    blocks = [key <= p - depth]
    for j in range(1, depth + 1):
        blocks.append(key == p - depth + j)
    return torch.cat(blocks, dim=1)


def unrolled_forward(
    head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """embeds (B, P, H) of tokens x_{p+1}, features (B, P, H) f_p -> [h^(0), ..., h^(depth)], each (B, P, H)."""
    s, layer = head.spec, head.layer
    if s.qk_norm or layer.qkv_bias is not None:
        raise NotImplementedError("EAGLE heads are plain Llama layers")
    b, p, _ = embeds.shape
    cos = head.rope.cos[:p, None, :].to(embeds.dtype)
    sin = head.rope.sin[:p, None, :].to(embeds.dtype)
    groups = s.num_heads // s.num_kv_heads
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    feats = features
    for d in range(depth + 1):
        if d:  # the previous pass's output at p - 1 is this pass's feature at p
            feats = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))
        x = F.linear(torch.cat((embeds, feats), dim=-1), head.fc_weight, head.fc_bias)
        qkv = F.linear(layer.input_norm(x), layer.qkv_weight)
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], dim=-1)
        q = apply_rope(q.view(b, p, s.num_heads, s.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(b, p, s.num_kv_heads, s.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, p, s.num_kv_heads, s.head_dim).transpose(1, 2)
        keys.append(k.repeat_interleave(groups, dim=1))
        values.append(v.repeat_interleave(groups, dim=1))
        mask = _pass_mask(p, d, x.device)
        attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(b, p, s.q_size)
        x = x + F.linear(attn, layer.o_weight, layer.o_bias)
        gate, up = F.linear(layer.post_norm(x), layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
        outputs.append(x + F.linear(layer.act(gate) * up, layer.down_weight, layer.down_bias))
    return outputs


def distill_loss(
    outputs: list[torch.Tensor],
    batch: Batch,
    lm_weight: torch.Tensor,
    pass_weights: list[float] | None = None,
    chunk: int = 1024,
    cls_weight: float = CLS_WEIGHT,
    responses_only: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Regression + ``cls_weight`` x cross-entropy against the target, averaged over valid positions of
    each pass. ``responses_only`` scores only positions that predict response tokens (the prompt
    stays as attention context): chat templates make prompts mostly fixed boilerplate, which is easy
    to predict and would otherwise dominate the loss while drafting never happens there. Logits are
    formed for scored positions only, ``chunk`` rows at a time (a full 49k vocabulary over a whole
    batch would not fit comfortably in memory)."""
    target = batch.features[:, 1:]  # f_{p+1} for p = 0..P-2
    positions = torch.arange(target.shape[1], device=target.device)[None, :]
    total = outputs[0].new_zeros(())
    logs: dict[str, float] = {}
    weights = pass_weights or [1.0] * len(outputs)
    for d, h in enumerate(outputs):
        valid = (positions < batch.num_pairs[:, None]) & (positions >= d)
        if responses_only:  # position p predicts token p + 2
            valid &= positions + 2 >= batch.prompt_len[:, None]
        count = int(valid.sum())
        if count == 0:
            continue
        pred, goal = h[:, :-1][valid], target[valid]
        reg = F.smooth_l1_loss(pred, goal)
        cls = pred.new_zeros(())
        hits = 0
        for lo in range(0, count, chunk):
            with torch.no_grad():
                p_target = F.softmax(F.linear(goal[lo : lo + chunk], lm_weight), dim=-1)
            log_q = F.log_softmax(F.linear(pred[lo : lo + chunk], lm_weight), dim=-1)
            cls = cls - (p_target * log_q).sum()
            hits += int((log_q.detach().argmax(-1) == p_target.argmax(-1)).sum())
        total = total + weights[d] * (reg + cls_weight * cls / count)
        logs[f"acc{d}"] = hits / count
    return total / sum(weights), logs


@torch.no_grad()
def acceptance(
    head: EagleHead,
    seqs: list[Sequence],
    embed_weight: torch.Tensor,
    lm_weight: torch.Tensor,
    vocab_ids: torch.Tensor | None,
    k: int,
    batch_size: int = 16,
) -> dict[str, object]:
    """Greedy chained-draft acceptance on held-out self-generated text, as serving would see it.

    A drafting round that starts after token N-1 proposes tokens N..N+k-1 from passes 0..k-1 at
    positions N-2..N+k-3; it accepts the prefix that equals the target's own (greedy) continuation.
    Rounds start at every response position. Returns the mean acceptance length (1 + accepted per
    round, vLLM's definition) and the per-position acceptance rates."""
    accepted_per_pos = np.zeros(k, dtype=np.int64)
    rounds = 0
    device = embed_weight.device
    for i in range(0, len(seqs), batch_size):
        batch = Batch.build(seqs[i : i + batch_size])
        on_device = batch.to(device)
        # In the head's own dtype: a bf16 head is what serving runs, and its rounding moves near-ties.
        embeds = F.embedding(on_device.tokens[:, 1:], embed_weight).to(head.dtype)
        outputs = unrolled_forward(head, embeds, on_device.features.to(head.dtype), depth=k - 1)
        preds = []
        for h in outputs:
            best = F.linear(h, lm_weight.to(h.dtype)).argmax(-1)
            best = best if vocab_ids is None else vocab_ids.to(device)[best]
            preds.append(best.cpu())
        tokens = batch.tokens
        num_positions = tokens.shape[1] - 1
        for b in range(tokens.shape[0]):
            length = int(batch.num_pairs[b]) + 2
            first = max(int(batch.prompt_len[b]) - 1, 0)  # the round that drafts the first response token
            starts = np.arange(first, length - k - 1)  # s = N - 2; needs tokens up to s + k + 1
            if starts.size == 0:
                continue
            ok = np.ones(starts.size, dtype=bool)
            for d in range(k):
                pos = starts + d
                hit = preds[d][b, np.minimum(pos, num_positions - 1)].numpy() == tokens[b, pos + 2].numpy()
                ok &= hit
                accepted_per_pos[d] += int(ok.sum())
            rounds += starts.size
    rates = accepted_per_pos / max(rounds, 1)
    return {
        "rounds": rounds,
        "mean_acceptance_length": float(1.0 + rates.sum()),
        "per_position": [round(float(r), 4) for r in rates],
    }
