"""Memory and time of the 4-bit calibration statistics (``gptq.calibration_inputs``) and of the group-128 load
(``awq.quantize_model_awq``: calibration, scale search, codes) on the default model and on random checkpoints
with wider linears (the shapes of larger models, fewer layers).

Each shape runs in a subprocess of its own: the checkpoint loaded in fp32, then the calibration forward with its
statistics; reports the bytes the statistics hold (every tensor of each linear's ``CalibrationInputs``), the
process's peak resident memory over the calibration (VmHWM, reset after the load), and the seconds of
``quantize_model_awq``. Prints a table and writes JSON. Works on trees from before ``CalibrationInputs`` kept X
(it counts whatever tensors the statistics hold), so a base checkout can be measured with the same script.

    PYTHONPATH=$PWD python benchmarks/calibration_memory.py [--shapes default wide llama3-8b-layer] [--json f]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.random_checkpoint import Shape, process_status, reset_peak, write_checkpoint

# name -> (hidden, intermediate, heads, kv heads, layers); None: the default model itself
SHAPES: dict[str, Shape | None] = {
    "default": None,
    "wide": (2048, 8192, 16, 4, 2),
    "llama3-8b-layer": (4096, 14336, 32, 8, 1),  # one decoder layer of Llama 3 8B's shape
}


def _measure(path: str) -> dict[str, float]:
    import torch

    from nxdserve.engine.models import awq, gptq
    from nxdserve.engine.models.llama import LlamaFamilyModel
    from nxdserve.model_files import resolve_model

    checkpoint = resolve_model(None) if path == "default" else Path(path)
    model = LlamaFamilyModel.from_pretrained(checkpoint, torch.float32, torch.device("cpu"), max_len=1024)
    reset_peak()  # the peak from here on
    before = process_status("VmRSS")
    start = time.perf_counter()
    inputs = gptq.calibration_inputs(model, checkpoint)
    calibration_s = time.perf_counter() - start
    peak = process_status("VmHWM") - before
    held = sum(
        t.numel() * t.element_size()
        for c in inputs.values()
        for t in (getattr(c, f.name) for f in dataclasses.fields(c))
        if isinstance(t, torch.Tensor)
    )
    del inputs
    start = time.perf_counter()
    awq.quantize_model_awq(model, 128, checkpoint)
    return {
        "statistics_mb": held / 2**20,
        "calibration_peak_mb": peak / 2**20,
        "calibration_s": calibration_s,
        "awq_g128_s": time.perf_counter() - start,
        "layers": len(model.layers),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child)))
        return
    rows = []
    header = ("layers", "stats MB", "MB/layer", "peak MB", "calib s", "g128 s")
    print(f"{'shape':16s}", *(f"{h:>9s}" for h in header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            path = "default" if shape is None else str(write_checkpoint(shape, Path(tmp) / name))
            done = subprocess.run(
                [sys.executable, __file__, "--child", path], capture_output=True, text=True, check=True
            )
            row = {"shape": name, **json.loads(done.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(
                f"{name:16s} {row['layers']:9d} {row['statistics_mb']:9.1f} {row['statistics_mb'] / row['layers']:9.1f}"
                f" {row['calibration_peak_mb']:9.1f} {row['calibration_s']:9.1f} {row['awq_g128_s']:9.1f}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
