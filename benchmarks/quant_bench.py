"""Weight formats on this CPU: one GEMM per layer shape of the default model, at 1 and 32 rows.

For each of the default model's linear shapes (SmolLM2-135M: qkv, o, gate_up, down, and the LM head) and
each weight format nxdserve can serve (``engine/models/quant.py``), times ``quant.QuantLinear`` at 1 row
(decode of one sequence: bound by the bytes of the weight) up to 32 rows (a batched step: bound by FLOPs),
and sums a whole model pass (30 layers + head). Prints a table and writes JSON; the figures decide
``CpuOptions.quant_dense_rows`` (the rows where a dense copy beats our kernel) and the default dtype (see
perf_notes.md). Each weight is timed alone, so a small one sits in the cache: the model column is a lower bound.

    PYTHONPATH=$PWD python benchmarks/quant_bench.py [--rows 1 2 4 8 16 32] [--repeat 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nxdserve.engine.models import cpu_kernels, quant

# (name, out_features, in_features, count in one model pass) for SmolLM2-135M.
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]  # fmt: skip
# "/bf16": bf16 activations (PyTorch's weight-only kernels are vectorised for bf16, not fp32, on AVX2).
# "torch-*": PyTorch's weight-only ops (the C kernels off: what --cpu-isa none runs); "q4" / "q8" / "fp8": our
# qgemm kernel on the codes (csrc/qgemm.c, fp32 activations; q8 = int8 with a scale per 32, GGUF Q8_0's layout).
FORMATS = ["fp32", "bf16", "torch-int8/bf16", "torch-int4-g32/bf16", "torch-int4-g64/bf16", "q4", "q8", "fp8"]


def make(fmt: str, weight: torch.Tensor) -> tuple[quant.QuantLinear | torch.Tensor, torch.dtype]:
    if fmt.endswith("/bf16"):
        return make(fmt.removesuffix("/bf16"), weight)[0], torch.bfloat16
    if fmt == "fp32":
        return weight, torch.float32
    if fmt == "bf16":
        return weight.bfloat16(), torch.bfloat16
    method = fmt.removeprefix("torch-")
    if fmt == "q4":
        method = "int4-g32"
    elif fmt == "q8":  # int8 codes with a scale per 32 columns (the q8_0 kind)
        w = quant.quantize_int8(weight)
        n, k = weight.shape
        return quant.QuantLinear(
            "q8_0", n, k, w.data, w.scales[:, None].expand(n, k // 32).contiguous(), 32, k
        ), torch.float32
    return quant.quantize(weight, method), torch.float32


def time_one(fmt: str, w: quant.QuantLinear | torch.Tensor, x: torch.Tensor, repeat: int) -> float:
    # torch-*: the C kernels off, so QuantLinear runs PyTorch's ops; ours: the kernel at every row count.
    cpu_kernels.configure("none" if fmt.startswith("torch-") else "auto")
    quant.dense_rows = 0
    run = (lambda: w(x)) if isinstance(w, quant.QuantLinear) else (lambda: torch.nn.functional.linear(x, w))
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    cpu_kernels.configure("auto")
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for name, n, k, _ in SHAPES:
            weight = torch.randn(n, k) * 0.05
            for fmt in args.formats:
                w, act = make(fmt, weight)
                for rows in args.rows:
                    x = torch.randn(rows, k).to(act)
                    ms = time_one(fmt, w, x, args.repeat)
                    results.setdefault(fmt, {}).setdefault(str(rows), {})[name] = ms
                del w
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")
    for rows in args.rows:
        print(f"\n{rows} row(s): ms per GEMM (min of {args.repeat}); model = 30 layers + head")
        print(f"{'format':<20}" + "".join(f"{s[0]:>10}" for s in SHAPES) + f"{'model':>10}{'vs fp32':>9}")
        base = None
        for fmt in args.formats:
            per = results[fmt][str(rows)]
            model = sum(per[s[0]] * s[3] for s in SHAPES)
            per["model"] = model
            base = model if fmt == "fp32" else base
            ratio = f"{model / base:8.2f}x" if base else ""
            print(f"{fmt:<20}" + "".join(f"{per[s[0]]:10.3f}" for s in SHAPES) + f"{model:10.2f}{ratio:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"capability": torch.backends.cpu.get_cpu_capability(), "ms": results}, f, indent=2)


if __name__ == "__main__":
    main()
