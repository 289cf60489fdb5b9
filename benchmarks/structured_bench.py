"""Structured outputs, measured: the grammar library (``--part lib``) and the engine's cost (``--part engine``).

``lib``: xgrammar vs llguidance on our vocabularies.

For each library and vocabulary (the default model's 49k tokens; a 152k one, Qwen2.5's size): JSON-schema compile
time (first, and again for the same schema), and the time to fill the next-token bitmask of 32 rows at once (each
row a matcher part-way through a document), per step. No Qwen tokenizer is available offline, so the 152k
vocabulary is the default model's byte-level BPE vocabulary extended with 103k tokens made by joining pairs of its
tokens (built with ``tokenizers``): the same token-string statistics a larger BPE vocabulary has, which is what
mask computation depends on.

``engine``: the default model on the torch backend, batch 32, greedy: every row under a JSON schema against the same
prompts unconstrained, in the same run (alternating rounds), as output tokens per second; the schema's compile time
(first and cached) and the engine's mask time per step (fill + apply happen in the step's worker thread). The
schema asks for a long array, so constrained rows run to max_tokens like the unconstrained ones (same batch size
throughout). Prints tables; writes JSON under bench-results/.

    python benchmarks/structured_bench.py [--part lib|engine|all] [--steps 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nxdserve.model_files import resolve_model

BATCH = 32
QWEN_VOCAB = 152_064

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["city", "population", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"},
                                      "level": {"enum": ["low", "mid", "high"]}},
     "required": ["ok", "score", "level"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["id", "label"]}}}, "required": ["items"]},
]
DOCS = ['{"name": "Ada Lovelace", "age": 36}', '{"city": "Paris", "population": 2100000, "tags": ["a", "b"]}',
        '{"ok": true, "score": 0.5, "level": "mid"}', '{"items": [{"id": 1, "label": "x"}]}']


def default_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(resolve_model(None, progress=False))


def extended_tokenizer(base: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """``base``'s tokenizer with its BPE vocabulary grown to ``size`` by joined token pairs."""
    from tokenizers import Tokenizer

    spec = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    pieces = [t for t in vocab if not t.startswith("<")]
    rng = random.Random(0)
    next_id = max(vocab.values()) + 1 + len(spec.get("added_tokens", []))
    while len(vocab) + len(spec.get("added_tokens", [])) < size:
        token = rng.choice(pieces) + rng.choice(pieces)
        if token not in vocab and len(token) <= 16:
            vocab[token] = next_id
            next_id += 1
    backend = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=base.eos_token)


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_xgrammar(tok: PreTrainedTokenizerFast, steps: int) -> dict[str, float]:
    import xgrammar as xgr

    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    first = [timed(lambda s=s: compiler.compile_json_schema(json.dumps(s)))[1] for s in SCHEMAS]
    cached = [timed(lambda s=s: compiler.compile_json_schema(json.dumps(s)))[1] for s in SCHEMAS]
    grammars = [compiler.compile_json_schema(json.dumps(s)) for s in SCHEMAS]
    matchers = []
    for i in range(BATCH):
        m = xgr.GrammarMatcher(grammars[i % len(grammars)])
        doc_ids = tok.encode(DOCS[i % len(DOCS)], add_special_tokens=False)
        for t in doc_ids[: 1 + i % max(1, len(doc_ids) - 1)]:
            m.accept_token(t)
        matchers.append(m)
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab)
    batch = xgr.BatchGrammarMatcher()
    per_step = []
    for _ in range(steps):
        _, dt = timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask))
        per_step.append(dt)
    serial = [timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])[1]
              for _ in range(steps)]
    return {"compile_first_ms": 1e3 * statistics.mean(first), "compile_cached_ms": 1e3 * statistics.mean(cached),
            "mask_step_ms": 1e3 * statistics.median(per_step), "mask_step_serial_ms": 1e3 * statistics.median(serial)}


def bench_llguidance(tok: PreTrainedTokenizerFast, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    lltok = llguidance.hf.from_tokenizer(tok)
    # llguidance compiles lazily inside the matcher: "compile" is making a matcher from the schema.
    def make(s: dict[str, Any]) -> Any:
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(s)))

    first = [timed(lambda s=s: make(s))[1] for s in SCHEMAS]
    cached = [timed(lambda s=s: make(s))[1] for s in SCHEMAS]
    matchers = []
    for i in range(BATCH):
        m = make(SCHEMAS[i % len(SCHEMAS)])
        doc_ids = tok.encode(DOCS[i % len(DOCS)], add_special_tokens=False)
        for t in doc_ids[: 1 + i % max(1, len(doc_ids) - 1)]:
            m.consume_token(t)
        matchers.append(m)
    bitmask = lgt.allocate_token_bitmask(BATCH, lltok.vocab_size)
    executor = llguidance.LLExecutor(num_threads=2)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    per_step = [timed(lambda: lgt.fill_next_token_bitmask_par(executor, pairs, bitmask))[1] for _ in range(steps)]
    serial = [timed(lambda: [lgt.fill_next_token_bitmask(m, bitmask, i) for i, m in enumerate(matchers)])[1]
              for _ in range(steps)]
    return {"compile_first_ms": 1e3 * statistics.mean(first), "compile_cached_ms": 1e3 * statistics.mean(cached),
            "mask_step_ms": 1e3 * statistics.median(per_step), "mask_step_serial_ms": 1e3 * statistics.median(serial)}


LONG_SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}


def bench_engine(rounds: int, max_tokens: int, batch: int) -> dict[str, Any]:
    from nxdserve.config import EngineConfig
    from nxdserve.engine.loader import build_engine_core
    from nxdserve.engine.structured import StructuredOutputsParams
    from nxdserve.sampling_params import OutputKind, SamplingParams

    core, _ = build_engine_core(EngineConfig(model=None, backend="torch", max_num_seqs=batch, max_model_len=512))
    texts = [f"List {i + 3} records of people as JSON." for i in range(batch)]
    prompts = [list(core.tokenizer.encode(t)) for t in texts]
    spec = StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True)
    compiler = core.structured.compiler
    _ = compiler.lltokenizer  # built once per engine (~2 s for 49k tokens), not per schema
    _, first = timed(lambda: compiler.compile(spec))
    _, cached = timed(lambda: compiler.compile(spec))

    def run(constrained: bool) -> tuple[int, float]:
        for prompt in prompts:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                                    output_kind=OutputKind.FINAL_ONLY,
                                    structured_outputs=spec if constrained else None)
            core.add_request(core.make_request(prompt, params))
        t0 = time.perf_counter()
        generated = core.generation_tokens_total
        while core.has_unfinished:
            core.step()
        return core.generation_tokens_total - generated, time.perf_counter() - t0

    run(True), run(False)  # warm-up
    results: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    mask_s, mask_steps = core.structured.mask_seconds, core.structured.mask_steps
    for _ in range(rounds):
        for kind in ("unconstrained", "constrained"):
            tokens, seconds = run(kind == "constrained")
            results[kind].append(tokens / seconds)
    mask_ms = 1e3 * (core.structured.mask_seconds - mask_s) / max(1, core.structured.mask_steps - mask_steps)
    free, bound = statistics.mean(results["unconstrained"]), statistics.mean(results["constrained"])
    return {"batch": batch, "max_tokens": max_tokens, "dtype": str(core.backend.dtype),  # type: ignore[attr-defined]
            "unconstrained_tok_s": free, "constrained_tok_s": bound, "ratio": bound / free,
            "rounds": results, "compile_first_ms": 1e3 * first, "compile_cached_ms": 1e3 * cached,
            "mask_fill_ms_per_step": mask_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["lib", "engine", "all"], default="all")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--out", default="bench-results/structured.json")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    if args.part in ("engine", "all"):
        engine = bench_engine(args.rounds, args.max_tokens, args.batch)
        report["engine"] = engine
        print(f"engine, batch {engine['batch']}, {engine['max_tokens']} tokens, {engine['dtype']}: unconstrained "
              f"{engine['unconstrained_tok_s']:.1f} tok/s, every row under a JSON schema "
              f"{engine['constrained_tok_s']:.1f} tok/s: {engine['ratio']:.3f}x; schema compile "
              f"{engine['compile_first_ms']:.2f} ms first, {engine['compile_cached_ms']:.3f} ms cached; mask fill "
              f"{engine['mask_fill_ms_per_step']:.3f} ms per step")
    if args.part in ("lib", "all"):
        report["libraries"] = bench_libraries(args.steps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def bench_libraries(steps: int) -> dict[str, Any]:
    torch.set_num_threads(2)
    base = default_tokenizer()
    vocabularies = {f"{len(base) // 1000}k (default model)": base,
                    f"{QWEN_VOCAB // 1000}k (synthetic, Qwen2.5 size)": extended_tokenizer(base, QWEN_VOCAB)}
    rows = []
    for vocab_name, tok in vocabularies.items():
        for lib, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            rows.append({"vocab": vocab_name, "vocab_size": len(tok), "library": lib, **fn(tok, steps)})
    header = (f"{'vocab':<34}{'library':<12}{'compile 1st ms':>15}{'cached ms':>11}{'mask/step ms (b32)':>20}"
              f"{'serial':>9}")
    print(header)
    for r in rows:
        print(f"{r['vocab']:<34}{r['library']:<12}{r['compile_first_ms']:>15.2f}{r['compile_cached_ms']:>11.3f}"
              f"{r['mask_step_ms']:>20.3f}{r['mask_step_serial_ms']:>9.3f}")
    return {"batch": BATCH, "rows": rows}


if __name__ == "__main__":
    main()
