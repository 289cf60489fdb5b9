"""Peak resident memory of loading a model into the torch backend, per weight format: the dense model in fp32,
bf16 weights (the default on a CPU without native bf16), and the online ``--quantization`` methods.

A random checkpoint of a given shape is written in bf16 (as HF checkpoints ship; the default model's tokenizer),
then each format is loaded in a process of its own (``TorchBackend``: load, quantize, warm-up; 1 slot of 256
positions, so the KV cache is small) and the process's peak resident memory (VmHWM) and resident memory after
the load (VmRSS) are read, less the process's resident memory before the load (Python, torch). Prints a table
and writes JSON; the same script runs on an older checkout for a before/after.

    PYTHONPATH=$PWD python benchmarks/load_memory.py [--shape llama3-8b-layer] [--formats ...] [--json f]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.random_checkpoint import Shape, process_status, reset_peak, write_checkpoint

SHAPES: dict[str, Shape] = {  # name -> (hidden, intermediate, heads, kv heads, layers)
    "wide": (2048, 8192, 16, 4, 2),
    "llama3-8b-layer": (4096, 14336, 32, 8, 1),
    "deep": (2048, 8192, 16, 4, 8),
}
FORMATS = ("float32", "bf16-weights", "int8", "fp8", "int4")


def _measure(path: str, fmt: str) -> dict[str, float]:
    import torch  # noqa: F401  (its own resident memory counts before the load)

    from nxdserve.config import EngineConfig
    from nxdserve.cpu_options import CpuOptions
    from nxdserve.engine.backends.torch_backend import TorchBackend

    before = process_status("VmRSS")
    reset_peak()
    dtype = "auto" if fmt == "bf16-weights" else "float32"
    config = EngineConfig(
        model=path, backend="torch", dtype=dtype, max_model_len=256, max_num_seqs=1, seed=0,
        quantization=None if fmt in ("float32", "bf16-weights") else fmt, cpu=CpuOptions(isa="avx2"),
    ).resolve(model_max_positions=1024)  # fmt: skip
    start = time.perf_counter()
    backend = TorchBackend(Path(path), config)
    seconds = time.perf_counter() - start
    served = config.quantization or ("bf16 weights" if fmt == "bf16-weights" else "dense")
    assert backend.model is not None
    return {
        "peak_mb": (process_status("VmHWM") - before) / 2**20,
        "after_mb": (process_status("VmRSS") - before) / 2**20,
        "load_s": seconds,
        "served": served,  # type: ignore[dict-item]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b-layer", choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(*args.child)))
        return
    rows = []
    print(f"shape {args.shape} {SHAPES[args.shape]}")
    print(f"{'format':14s} {'peak MB':>9s} {'after MB':>9s} {'load s':>8s}")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_checkpoint(SHAPES[args.shape], Path(tmp) / args.shape, "bfloat16"))
        for fmt in args.formats:
            done = subprocess.run(
                [sys.executable, __file__, "--child", path, fmt], capture_output=True, text=True, check=True
            )
            row = {"format": fmt, **json.loads(done.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(f"{fmt:14s} {row['peak_mb']:9.1f} {row['after_mb']:9.1f} {row['load_s']:8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
