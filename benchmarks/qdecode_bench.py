"""The fused quantized forward (``csrc/qdecode.c``) against the layer-by-layer path, model forward only: the default
model served from its Q4_1 blocks, T decode rows in T slots at position ``--context``, the two paths interleaved
(A, B, A, B, ...) in one process so the machine's drift hits both. Prints median ms per forward and the ratio, and
writes JSON.

    PYTHONPATH=$PWD python benchmarks/qdecode_bench.py [--rows 1 4 16] [--repeat 40] [--context 64] [--cpu-isa auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nxdserve.cpu_options import CpuOptions, set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
import numpy as np  # noqa: E402 - after the wait policy
import torch  # noqa: E402 - after the wait policy

from nxdserve.engine.models import cpu_setup, fused_qdecode, quant  # noqa: E402 - after the wait policy
from nxdserve.engine.models.attention import AttentionMetadata  # noqa: E402 - after the wait policy
from nxdserve.engine.models.llama import LlamaFamilyModel  # noqa: E402 - after the wait policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--context", type=int, default=64, help="each row's position (its slot's cached tokens)")
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from nxdserve.model_files import default_gguf_path, resolve_model

    path = cpu_setup.apply(CpuOptions(isa=args.cpu_isa))
    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = args.context + 8
    model = LlamaFamilyModel.from_pretrained(resolve_model(None), torch.float32, torch.device("cpu"), max_len)
    quant.quantize_model(model, "gguf", default_gguf_path())
    s = model.spec
    results = []
    for rows in args.rows:
        cache = model.new_kv_cache(rows, max_len)
        cache.data.normal_()
        meta = AttentionMetadata.build(
            np.arange(rows), np.full(rows, args.context), np.ones(rows, dtype=np.int64),
            num_query_groups=s.num_heads // s.num_kv_heads, windows=model.windows, max_len=max_len,
            device=torch.device("cpu"), dtype=torch.float32,
        )  # fmt: skip
        tokens = torch.randint(0, model.vocab_size, (rows,))
        times: dict[bool, list[float]] = {True: [], False: []}
        with torch.inference_mode():
            for i in range(2 * args.repeat + 4):
                fused = i % 2 == 0
                fused_qdecode.enabled = fused
                assert model.fused_quant_decode.accepts(tokens, meta, cache) == fused
                t0 = time.perf_counter()
                model(tokens, meta, cache)
                if i >= 4:  # warm-up
                    times[fused].append(time.perf_counter() - t0)
        fused_qdecode.enabled = True
        on, off = (1e3 * statistics.median(times[k]) for k in (True, False))
        results.append({"rows": rows, "fused_ms": on, "layered_ms": off, "ratio": on / off})
        print(f"{path}, {torch.get_num_threads()} threads, rows {rows:>2}: fused {on:7.2f} ms  layer by layer "
              f"{off:7.2f} ms  fused/layered {on / off:5.2f}x  (median of {args.repeat}, interleaved)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
