"""Load-time cost of the online quantizers on the default model: the searched methods against plain rounding.

For each quantizer (``int4`` searched at groups 32/64/128, ``fp8`` searched per 32 columns, and the plain ones:
round-to-nearest 4-bit (``rtn``'s rule at group 32), absmax fp8 per 32 columns, int8), quantizes every decoder
linear of the dense fp32 default model (the LM head stays dense, as ``quantize_model`` does) on each kernel path
(``--paths``: the C search, ``csrc/qsearch.c``, and ``none``: the torch search), the paths interleaved per
repeat so a loaded machine hits both alike. ``CALIBRATED`` times the whole-model quantizers of groups 64 / 128
(``--quantizers int4-g64-imatrix int4-g64-awq ...``: the calibration prefill included; the activation-weighted
search alone and with ``awq.py``'s scales) against the plain search at that group. Prints the median seconds and
the ratio to the plain method of the same format on the same path, and writes JSON.

    PYTHONPATH=$PWD python benchmarks/quant_load_time.py [--repeats 3] [--paths avx2 none] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from nxdserve.cpu_options import CpuOptions
from nxdserve.engine.models import awq, cpu_setup, imatrix, quant
from nxdserve.engine.models.perplexity import _dense_default_model
from nxdserve.model_files import resolve_model

QUANTIZERS: dict[str, tuple[str, Callable[[torch.Tensor], quant.QuantLinear]]] = {
    # name -> (the plain method it is compared with, the quantizer)
    "int4-rtn-g32": ("int4-rtn-g32", lambda w: quant.quantize_int4(w, 32, search=False)),
    "int4-g32": ("int4-rtn-g32", lambda w: quant.quantize_int4(w, 32)),
    "int4-g64": ("int4-rtn-g32", lambda w: quant.quantize_int4(w, 64)),
    "int4-g128": ("int4-rtn-g32", lambda w: quant.quantize_int4(w, 128)),
    "fp8-absmax": ("fp8-absmax", lambda w: quant.quantize_fp8(w, search=False)),
    "fp8": ("fp8-absmax", lambda w: quant.quantize_fp8(w)),
    "int8": ("int8", quant.quantize_int8),
}
# Whole-model quantizers (calibrated at load: the calibration prefill is included), against the plain search.
CALIBRATED: dict[str, tuple[str, Callable[[Any], None]]] = {
    f"int4-g{g}-{how}": (f"int4-g{g}", make)
    for g in quant.CALIBRATED_GROUPS
    for how, make in (
        ("imatrix", lambda model, g=g: imatrix.quantize_model_imatrix(model, g, resolve_model(None))),
        ("awq", lambda model, g=g: awq.quantize_model_awq(model, g, resolve_model(None))),
    )
}


def time_quantizer(name: str) -> float:
    model = copy.deepcopy(_dense_default_model(torch.float32))
    start = time.perf_counter()
    if name in CALIBRATED:
        CALIBRATED[name][1](model)
    else:
        make = QUANTIZERS[name][1]
        model.quantize_linears(lambda layer, weight: None if layer == "lm_head" else make(weight))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="+", default=["avx2", "none"])
    ap.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=[*QUANTIZERS, *CALIBRATED])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    _dense_default_model(torch.float32)  # loaded once, outside the timings
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for path in args.paths:
            cpu_setup.apply(CpuOptions(isa=path))
            for name in args.quantizers:
                seconds.setdefault((path, name), []).append(time_quantizer(name))
    cpu_setup.apply(CpuOptions())
    rows = []
    print(f"default model, decoder linears, median of {args.repeats}, threads {torch.get_num_threads()}")
    print(f"{'path':8s} {'quantizer':14s} {'seconds':>8s} {'vs plain':>9s}")
    for path in args.paths:
        for name in args.quantizers:
            median = statistics.median(seconds[(path, name)])
            plain = (QUANTIZERS | CALIBRATED)[name][0]
            ratio = median / statistics.median(seconds[(path, plain)]) if (path, plain) in seconds else float("nan")
            rows.append({"path": path, "quantizer": name, "seconds": median, "vs_plain": ratio,
                         "all_seconds": seconds[(path, name)]})  # fmt: skip
            print(f"{path:8s} {name:14s} {median:8.2f} {ratio:8.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
