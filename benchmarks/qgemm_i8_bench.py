"""The quantized GEMM with fp32 activations (``qgemm_f32``) against int8 activations (``qgemm_i8_f32``): the C
kernels alone on the default model's shapes (q4 linears, the q8 LM head), 1 and 4 rows, 1 and 2 threads.

The two kernels run interleaved in one process (fp32, i8, fp32, i8, ... per repeat, the best of each kept), so a
shared machine's drift hits both alike; the ratio i8 / fp32 is what to read. Prints a table and writes JSON.

    PYTHONPATH=$PWD python benchmarks/qgemm_i8_bench.py [--rows 1 4] [--threads 1 2] [--repeat 50]
        [--cpu-isa auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from nxdserve.cpu_options import set_openmp_wait_policy

set_openmp_wait_policy()  # the server's OpenMP waits (before torch loads OpenMP)

# isort: split
import torch  # noqa: E402 - after the wait policy

from nxdserve.engine.models import cpu_kernels, cpu_weight_kernels  # noqa: E402 - after the wait policy

# (name, out_features, in_features, format, count in one model pass) for SmolLM2-135M as served from its GGUF.
SHAPES = [("qkv", 960, 576, "q4", 30), ("o", 576, 576, "q4", 30), ("gate_up", 3072, 576, "q4", 30),
          ("down", 576, 1536, "q4", 30), ("head", 49152, 576, "q8", 1)]  # fmt: skip


def weight(n: int, k: int, fmt: str, gen: torch.Generator) -> cpu_weight_kernels.QgemmWeight:
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3
    if fmt == "q4":
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        return cpu_weight_kernels.QgemmWeight(codes, scale, torch.randn(n, k // 32, generator=gen) * 0.01, "q4")
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return cpu_weight_kernels.QgemmWeight(codes, scale, None, "q8")


def interleaved(w: cpu_weight_kernels.QgemmWeight, x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Best ms of the fp32 kernel and of the int8-activation kernel, timed alternately."""
    best = [float("inf"), float("inf")]
    for i in range(repeat + 3):
        for j, int8 in enumerate((False, True)):
            t0 = time.perf_counter()
            w(x, None, int8)
            if i >= 3:  # warm-up
                best[j] = min(best[j], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = cpu_kernels.configure(args.cpu_isa)
    assert cpu_kernels.available(), "no C kernels on this path"
    gen = torch.Generator().manual_seed(0)
    weights = {name: weight(n, k, fmt, gen) for name, n, k, fmt, _ in SHAPES}
    rows_out: list[dict[str, object]] = []
    print(f"path {path}; best ms of {args.repeat}, fp32 activations vs int8 activations, interleaved; "
          "model = 30 layers + head")
    print(f"{'threads':>7} {'rows':>4} " + "".join(f"{s[0]:>22}" for s in SHAPES) + f"{'model':>22}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            cells, model = [], [0.0, 0.0]
            for name, _, k, fmt, count in SHAPES:
                x = torch.randn(rows, k, generator=gen)
                f32, i8 = interleaved(weights[name], x, args.repeat)
                model[0] += f32 * count
                model[1] += i8 * count
                cells.append(f"{f32:6.3f}/{i8:6.3f} {i8 / f32:5.2f}x")
                rows_out.append({"threads": threads, "rows": rows, "shape": name, "format": fmt,
                                 "f32_ms": f32, "i8_ms": i8, "ratio": i8 / f32})
            cells.append(f"{model[0]:6.2f}/{model[1]:6.2f} {model[1] / model[0]:5.2f}x")
            rows_out.append({"threads": threads, "rows": rows, "shape": "model", "f32_ms": model[0],
                             "i8_ms": model[1], "ratio": model[1] / model[0]})
            print(f"{threads:>7} {rows:>4} " + "".join(f"{c:>22}" for c in cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": path, "repeat": args.repeat, "rows": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
