"""A fingerprint of the engine's outputs, to prove a refactor changed nothing (issue 26, item 9).

Runs a fixed prompt set through the default model in fp32 in each scheduling mode, with and without
speculation (n-gram; EAGLE with an untrained "identity" head that drafts the target's last prediction again),
greedy and seeded-random, and prints one SHA-256 per configuration over every request's output token ids.
Run it at two commits and compare the hashes: equal hashes mean byte-identical outputs.

    .venv/bin/python benchmarks/greedy_hash.py [--tokens 48] [--out bench-results/greedy_hash.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.helpers

from nxdserve.sampling_params import SamplingParams
from tests.helpers.eagle import eagle_head
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize

# Draft at every batch size: by default drafting turns on and off from measured step costs, which would make the
# seeded outputs depend on the machine's load (greedy outputs are the same either way).
ALWAYS_DRAFT = {"disable_by_batch_size": 1024}

MODES: dict[str, dict[str, Any]] = {
    "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
    "prefill-first": {"enable_chunked_prefill": False},
    "chunked+prefix-cache": {"enable_chunked_prefill": True, "enable_prefix_caching": True},
}


def fingerprint(config: dict[str, Any], tokens: int) -> dict[str, str]:
    core = make_core(dtype="float32", max_model_len=256, max_num_seqs=8, **config)
    prompts = tokenize(core, PROMPTS)
    hashes = {}
    for name, params in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)),
        ("seeded", SamplingParams(temperature=0.8, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=7)),
    ):
        outputs = run_to_completion(core, prompts, params)
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        hashes[name] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    core.backend.shutdown()
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default="bench-results/greedy_hash.json")
    args = parser.parse_args()
    specs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                  **ALWAYS_DRAFT},
        "eagle": {"method": "eagle", "model": eagle_head(None, "identity"), "num_speculative_tokens": 3,
                  **ALWAYS_DRAFT},
    }
    rows = []
    for mode, mode_config in MODES.items():
        for spec_name, spec in specs.items():
            if spec is not None and "prefix" in mode:
                continue  # prefix caching is off with speculation
            hashes = fingerprint({**mode_config, "speculative_config": spec}, args.tokens)
            rows.append({"mode": mode, "speculation": spec_name, **hashes})
            print(f"{mode:>22} | {spec_name:>6} | greedy {hashes['greedy']} | seeded {hashes['seeded']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
