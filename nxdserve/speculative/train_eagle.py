"""``nxdserve train-eagle``: distill an EAGLE-1 draft head for a target from its own hidden states.

    nxdserve train-eagle --model M --out DIR [--nxd-layout]
    nxdserve --model M --speculative-config '{"method": "eagle", "model": "DIR", "num_speculative_tokens": 3}'

Steps: (1) the target answers a prompt set (shipped with nxdserve, or ``--prompts FILE``) through the
engine, greedy, in the serving dtype, while a recorder keeps each token's final hidden state;
(2) the most frequent response tokens form a truncated draft vocabulary (optional; it makes each
draft step several times cheaper on CPU); (3) the head (fc + one Llama layer) is trained on the
target's features with chained-draft unrolling (``distill.py``); (4) greedy acceptance is measured
on held-out prompts, and the head is saved.
With ``--nxd-layout`` the folder is what NxD Inference's fused EAGLE expects (the target's
``lm_head.weight`` and ``embed_tokens.weight`` inside, no vocabulary truncation); nxdserve loads both.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxdserve.engine.speculative.eagle import DEFAULT_MIN_DRAFT_CONFIDENCE, DEFAULT_MIN_FIRST_DRAFT_CONFIDENCE
from nxdserve.engine.speculative.eagle_head import (
    EAGLE_CONFIG_KEY,
    EagleHead,
    head_config_from_target,
    load_eagle_head,
    save_eagle_head,
)
from nxdserve.errors import NxdServeError
from nxdserve.speculative.corpus import (
    Generate,
    Sequence,
    engine_generate,
    generate_corpus,
    load_prompts,
    self_written_prompts,
)
from nxdserve.speculative.distill import Batch, acceptance, distill_loss, unrolled_forward
from nxdserve.speculative.hf_corpus import generate_corpus_hf, generate_tokens

logger = logging.getLogger("nxdserve.train_eagle")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nxdserve train-eagle",
        description="Distill an EAGLE-1 draft head for a target model from its own hidden states.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="target model folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--out", required=True, help="output folder for the head")
    p.add_argument("--prompts", default=None, help="JSONL of {\"prompt\": ...} (default: nxdserve's prompt set)")
    p.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="response length cap while generating data")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gen-batch", type=int, default=128, help="concurrent requests while generating data")
    p.add_argument("--dtype", default="auto", help="target dtype while generating (use the serving dtype)")
    p.add_argument("--sampled-copies", type=int, default=1,
                   help="extra sampled answers per prompt on top of the greedy one (more data; the head is data-bound)")
    p.add_argument("--sample-temperature", type=float, default=0.7, help="temperature of the sampled answers")
    p.add_argument("--draft-vocab-size", type=int, default=4096,
                   help="truncated draft vocabulary: this many most frequent ids (0: full vocabulary)")
    p.add_argument("--no-input-norm", action="store_true",
                   help="EAGLE-1's exact layer (no RMSNorm on fc's output); with the norm (default) the head trains "
                   "better, and NxD needs enable_eagle_draft_input_norm=True to run it")
    p.add_argument("--depth", type=int, default=1, help="chained-draft passes unrolled in training beyond the first")
    p.add_argument("--epochs", type=int, default=4,
                   help="passes over the corpus (on the default ~270k-token corpus 4 gave held-out acceptance length "
                   "1.85 against 2 epochs' 1.70, for twice the training time)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay on the head's matrices (not norms or biases)")
    p.add_argument("--cls-weight", type=float, default=1.0,
                   help="weight of the token loss against the feature regression (EAGLE-1 used 0.1)")
    p.add_argument("--prompt-loss", action="store_true", help="also train on prompt positions")
    p.add_argument("--feature-noise", type=float, default=0.05,
                   help="Gaussian noise on input features, relative to their RMS (EAGLE's robustness trick)")
    p.add_argument("--min-draft-confidence", type=float, default=DEFAULT_MIN_DRAFT_CONFIDENCE,
                   help="written into the head: serving proposes draft j >= 2 only while the product of the head's "
                   "top probabilities for drafts 1..j is at least this (0: always k drafts)")
    p.add_argument("--min-first-draft-confidence", type=float, default=DEFAULT_MIN_FIRST_DRAFT_CONFIDENCE,
                   help="written into the head: serving proposes draft 1 only when the head's top probability is at "
                   "least this")
    p.add_argument("--retune", action="store_true",
                   help="no training: keep the head already in --out and rewrite only its draft vocabulary "
                   "(--draft-vocab-size, from the corpus) and confidence bars, then re-measure held-out acceptance")
    p.add_argument("--heldout", type=float, default=0.1, help="fraction of prompts kept for the acceptance check")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="k for the acceptance report")
    p.add_argument("--nxd-layout", action="store_true",
                   help="write NxD Inference's EAGLE draft layout (carries the target's lm_head.weight)")
    p.add_argument("--corpus-cache", default=None,
                   help="reuse the generated corpus from this .pt file if it exists, else save it there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu",
                   help="where to generate and train: cpu (the engine itself generates) or an accelerator such as "
                   "cuda (transformers generates; the same recipe at a larger scale in minutes)")
    p.add_argument("--generator", choices=("auto", "engine", "transformers"), default="auto",
                   help="what generates the data: nxdserve's engine (auto on CPU: features exactly as served) or "
                   "transformers (auto on an accelerator)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="add this many prompts written by the target itself (sampled user turns) to the training "
                   "set: more varied data than the shipped prompt set")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        report = train(args)
    except NxdServeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


def train(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    prompts = load_prompts(args.prompts)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    rng.shuffle(prompts)
    num_heldout = max(1, int(len(prompts) * args.heldout)) if len(prompts) > 1 else 0
    target = _Target.load(args)

    # 1. Self-generated text with the target's features.
    # A greedy answer per prompt (what greedy serving sees), plus sampled ones for more data.
    temperatures = [0.0] + [args.sample_temperature] * max(args.sampled_copies, 0)
    cache = Path(args.corpus_cache) if args.corpus_cache else None
    if cache is not None and cache.is_file():
        corpus = [Sequence(**item) for item in torch.load(cache, weights_only=False)]
    else:
        if args.self_prompts:  # after the held-out split: the target's own prompts are all trained on
            prompts = prompts + self_written_prompts(target.tokenizer, target.generate, args.self_prompts,
                                                     target.eos_ids, args.seed)
        corpus = []
        with tqdm(total=len(prompts) * len(temperatures), desc="generating", unit="answer",
                  disable=args.no_progress) as bar:
            for i, temperature in enumerate(temperatures):
                corpus += target.corpus(prompts, temperature, args.seed + 100_003 * i, bar)
        if cache is not None:
            torch.save([vars(s) for s in corpus], cache)
    corpus.sort(key=lambda s: s.tokens.tolist())  # completion order varies with timing; fix it, then shuffle
    rng.shuffle(corpus)
    # Held out by prompt: the greedy answers to the first prompts; none of their answers are trained on.
    heldout = [s for s in corpus if s.prompt_index < num_heldout and not s.sampled]
    train_set = [s for s in corpus if s.prompt_index >= num_heldout]
    gen_seconds = time.perf_counter() - started
    num_tokens = sum(int(s.tokens.size - s.prompt_len) for s in corpus)
    logger.info("generated %d responses (%d tokens) in %.0f s", len(corpus), num_tokens, gen_seconds)

    # 2. Draft vocabulary.
    device = target.embed_weight.device
    vocab_size = int(target.lm_head_weight.shape[0])
    vocab_ids = draft_vocabulary(train_set, args.draft_vocab_size, vocab_size)
    coverage = vocab_coverage(heldout, vocab_ids)
    embed = target.embed_weight.detach().float()
    lm_full = target.lm_head_weight.detach().float()
    lm_weight = lm_full if vocab_ids is None else lm_full.index_select(0, vocab_ids.to(device))

    # 3. The head: trained here, or (--retune) the one already in --out.
    train_started = time.perf_counter()
    history: list[dict[str, Any]] = []
    if args.retune:
        try:
            head = load_eagle_head(args.out, torch.float32, device, args.max_model_len)
        except NxdServeError as exc:
            raise NxdServeError(f"--retune needs a trained head in --out: {exc}") from exc
        head_config = head.config
        head_config[EAGLE_CONFIG_KEY]["draft_vocab_size"] = None if vocab_ids is None else int(vocab_ids.numel())
    else:
        head_config = head_config_from_target(
            json.loads((target.path / "config.json").read_text()),
            input_norm=not args.no_input_norm,
            draft_vocab_size=None if vocab_ids is None else int(vocab_ids.numel()),
            target_name=_target_name(args.model),
        )
        head = EagleHead(head_config, torch.float32, device, args.max_model_len)
        init_head(head, args.seed)
    head_config[EAGLE_CONFIG_KEY]["min_draft_confidence"] = args.min_draft_confidence
    head_config[EAGLE_CONFIG_KEY]["min_first_draft_confidence"] = args.min_first_draft_confidence
    head.draft_vocab_ids = vocab_ids
    if not args.retune:
        history = fit(head, train_set, embed, lm_weight, args)
    train_seconds = time.perf_counter() - train_started

    # 4. Held-out acceptance, then save.
    k = args.num_speculative_tokens
    result = acceptance(head, heldout, embed, lm_weight, vocab_ids, k) if heldout else {}
    full_vocab = acceptance(head, heldout, embed, lm_full, None, k) if heldout and vocab_ids is not None else None
    out = save_eagle_head(
        head, args.out, nxd_layout=args.nxd_layout,
        embed_weight=target.embed_weight if args.nxd_layout else None,
        lm_head_weight=target.lm_head_weight if args.nxd_layout else None,
    )
    report = {
        "out": str(out),
        "layout": "nxd" if args.nxd_layout else "nxdserve",
        "retuned": bool(args.retune),
        "target": head_config[EAGLE_CONFIG_KEY].get("target"),
        "answers": {"train": len(train_set), "heldout": len(heldout)},
        "response_tokens": num_tokens,
        "draft_vocab_size": None if vocab_ids is None else int(vocab_ids.numel()),
        "heldout_vocab_coverage": coverage,
        "heldout_acceptance_k": k,
        "heldout_acceptance": result,
        "heldout_acceptance_full_vocab": full_vocab,
        "final_train": history[-1] if history else {},
        "seconds": {"generate": round(gen_seconds, 1), "train": round(train_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "usage": "--speculative-config '"
        + json.dumps({"method": "eagle", "model": str(out), "num_speculative_tokens": k})
        + "'",
    }
    # A retune keeps the training report and writes its own beside it.
    name = "retune_report.json" if args.retune else "train_report.json"
    (out / name).write_text(json.dumps(report, indent=2) + "\n")
    return report


@dataclass
class _Target:
    """The target model for data generation: our engine on CPU (its features are exactly what serving
    reads), or transformers on an accelerator (``--device``), where ``generate`` batches far better."""

    path: Path
    tokenizer: Any
    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    eos_ids: frozenset[int]
    generate: Generate
    corpus: Callable[[list[str], float, int, Any], list[Sequence]]  # (prompts, temperature, seed, progress bar)

    @classmethod
    def load(cls, args: argparse.Namespace) -> _Target:
        device = torch.device(args.device)
        generator = args.generator if args.generator != "auto" else "engine" if device.type == "cpu" else "transformers"
        if generator == "engine":
            if device.type != "cpu":
                raise NxdServeError("--generator engine runs on the CPU; use --generator transformers with --device")
            from nxdserve.config import EngineConfig
            from nxdserve.engine.loader import build_engine_core

            config = EngineConfig(model=args.model, backend="torch", dtype=args.dtype,
                                  max_model_len=args.max_model_len, max_num_seqs=args.gen_batch)
            core, files = build_engine_core(config, with_metrics=False)
            model = core.backend.runner.model

            def corpus(prompts: list[str], temperature: float, seed: int, bar: Any) -> list[Sequence]:
                return generate_corpus(core, prompts, args.max_new_tokens, progress=bar, temperature=temperature,
                                       seed=seed)

            return cls(Path(files.path), core.tokenizer, model.embed_weight, model.lm_head_weight,
                       frozenset(core.eos_token_ids), engine_generate(core), corpus)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nxdserve.engine.models import resolve_dtype
        from nxdserve.model_files import resolve_model

        path = resolve_model(args.model, progress=not args.no_progress)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(args.dtype, device))
        # transformers' stub types the wrapped Module.to as taking a model; it takes a device, as torch's does.
        hf = hf.to(device)  # type: ignore[arg-type]
        hf.eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        eos = hf.generation_config.eos_token_id
        eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                          *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
        if not eos_ids:
            raise NxdServeError(f"{path} names no eos token")

        def generate(prompts: list[list[int]], max_new: int, temperature: float, seed: int) -> list[list[int]]:
            return generate_tokens(hf, prompts, max_new, temperature, eos_ids, eos_ids[0], args.gen_batch, seed)

        def corpus_hf(prompts: list[str], temperature: float, seed: int, bar: Any) -> list[Sequence]:
            return generate_corpus_hf(hf, tokenizer, prompts, args.max_new_tokens, args.max_model_len, eos_ids,
                                      args.gen_batch, temperature=temperature, seed=seed, progress=bar)

        return cls(path, tokenizer, hf.get_input_embeddings().weight, hf.get_output_embeddings().weight,
                   frozenset(eos_ids), generate, corpus_hf)


def _target_name(model: str | None) -> str:
    """What the head's config records as its target: the model's name, not the path it was read from."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def draft_vocabulary(seqs: list[Sequence], size: int, vocab_size: int) -> torch.Tensor | None:
    """The ``size`` most frequent ids of the training text (responses count double: that is where
    drafting happens), topped up with the lowest ids (BPE merges roughly in frequency order)."""
    if size <= 0 or size >= vocab_size:
        return None
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(s.tokens.tolist())
        counts.update(s.tokens[s.prompt_len :].tolist())
    ids = [t for t, _ in counts.most_common(size)]
    chosen = set(ids)
    for t in range(vocab_size):
        if len(ids) >= size:
            break
        if t not in chosen:
            ids.append(t)
    return torch.tensor(ids[:size], dtype=torch.long)


def vocab_coverage(seqs: list[Sequence], vocab_ids: torch.Tensor | None) -> float:
    """Fraction of response tokens the draft vocabulary can propose at all."""
    if vocab_ids is None or not seqs:
        return 1.0
    allowed = set(vocab_ids.tolist())
    tokens = [t for s in seqs for t in s.tokens[s.prompt_len :].tolist()]
    return round(sum(t in allowed for t in tokens) / max(len(tokens), 1), 4)


@torch.no_grad()
def init_head(head: EagleHead, seed: int) -> None:
    """Small random weights, unit norms, and an fc that starts by passing the target feature through.
    (Starting from the target's last layer was tried: that layer expects the residual stream, not
    final-norm features, and trained to a worse head on the same data.)"""
    g = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.copy_(0.02 * torch.randn(param.shape, generator=g))
    size = head.spec.hidden_size
    head.fc_weight[:, size:] += torch.eye(size, device=head.fc_weight.device)


def fit(head: EagleHead, seqs: list[Sequence], embed: torch.Tensor, lm_weight: torch.Tensor,
        args: argparse.Namespace) -> list[dict[str, float]]:
    from tqdm.auto import tqdm

    params = [p for p in head.parameters() if p.dtype.is_floating_point]
    for p in params:
        p.requires_grad_(True)
    # Decay only the matrices: shrinking RMSNorm gains or fc's bias would just rescale activations.
    named = [(n, p) for n, p in head.named_parameters() if p.dtype.is_floating_point]
    decayed = [p for n, p in named if p.ndim >= 2]
    kept = [p for n, p in named if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": args.weight_decay},
                                   {"params": kept, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    # Batches of similar lengths (less padding), reshuffled every epoch.
    by_len = sorted(seqs, key=lambda s: s.tokens.size)
    batches = [by_len[i : i + args.batch_size] for i in range(0, len(by_len), args.batch_size)]
    total_steps = max(1, args.epochs * len(batches))
    warmup = max(1, total_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    rng = random.Random(args.seed + 1)
    weights = [1.0] + [0.8**d for d in range(1, args.depth + 1)]
    history: list[dict[str, float]] = []
    step = 0
    with tqdm(total=total_steps, desc="training", unit="batch", disable=args.no_progress) as bar:
        for epoch in range(args.epochs):
            rng.shuffle(batches)
            for group in batches:
                batch = Batch.build(group, args.max_model_len).to(embed.device)
                embeds = F.embedding(batch.tokens[:, 1:], embed)
                feats = batch.features
                if args.feature_noise > 0:
                    rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
                    feats = feats + args.feature_noise * rms * torch.randn_like(feats)
                outputs = unrolled_forward(head, embeds, feats, args.depth)
                loss, logs = distill_loss(outputs, batch, lm_weight, weights, cls_weight=args.cls_weight,
                                          responses_only=not args.prompt_loss)
                for group_ in optimizer.param_groups:
                    group_["lr"] = lr_at(step)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                step += 1
                logs = {"epoch": epoch, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in logs.items()}}
                history.append(logs)
                bar.set_postfix({k: v for k, v in logs.items() if k != "epoch"})
                bar.update(1)
    for p in params:
        p.requires_grad_(False)
    return history


if __name__ == "__main__":
    sys.exit(main())
