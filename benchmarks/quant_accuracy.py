"""Accuracy of each weight format on the default model: perplexity and greedy agreement against bf16.

For each format in ``perplexity.FORMATS`` (the dense bf16 and fp32 models, and the fp32 model quantized with
each online ``--quantization`` method and with ``gguf``, as served: PyTorch's weight-only kernels get bf16
activations), computes the logits over each shipped sample text (``perplexity.SAMPLES``, one prefill each)
and reports their pooled perplexity, the change against the bf16 model's (the issue's reference) and the fp32
model's, the change per text against bf16 (how noisy one text is), and the teacher-forced greedy (top-1)
agreement with each. Prints a table and writes JSON.

Besides the served formats, ``EXTRA`` builds the 4-bit groups 64 / 128 three other ways for comparison in the
same run: ``-plain``, the calibration-free search (``quant.quantize_int4``), ``-imatrix``, the activation-weighted
search without ``awq.py``'s scales (what ``int4-g128`` served before them; ``int4-g64`` serves it), ``-gptq``
(``gptq.py``: measured worse, not served) and ``int4-g128-untuned`` (``--quantization-tune-epochs 0``: the
calibrated search and scales without ``qtune.py``'s tuning).

    PYTHONPATH=$PWD python benchmarks/quant_accuracy.py [--formats bf16 fp32 int8 ... int4-g64-plain] [--json f]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from nxdserve.engine.models import gptq, imatrix, quant
from nxdserve.engine.models.perplexity import (
    FORMATS,
    SAMPLES,
    _dense_default_model,
    next_token_logits,
    perplexity,
    sample_texts,
    texts_logits,
    top1_agreement,
)
from nxdserve.model_files import resolve_model

EXTRA = (
    "int4-g64-plain", "int4-g128-plain", "int4-g64-imatrix", "int4-g128-imatrix", "int4-g64-gptq", "int4-g128-gptq",
    "int4-g128-untuned",
)  # fmt: skip


def extra_logits(fmt: str, texts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of an ``EXTRA`` format: the fp32 default model's decoder linears quantized that way."""
    group = int(fmt.split("-")[1][1:])
    model = copy.deepcopy(_dense_default_model(torch.float32))
    if fmt.endswith("-untuned"):
        quant.quantize_model(model, f"int4-g{group}", checkpoint=resolve_model(None), tune_epochs=0)
    elif fmt.endswith("-gptq"):
        gptq.quantize_model_gptq(model, group, resolve_model(None))
    elif fmt.endswith("-imatrix"):
        imatrix.quantize_model_imatrix(model, group, resolve_model(None))
    else:
        model.quantize_linears(lambda name, w: None if name == "lm_head" else quant.quantize_int4(w, group))
    return [next_token_logits(model, ids) for ids in texts]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS + EXTRA)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    texts = sample_texts()
    logits: dict[str, list[torch.Tensor]] = {}
    seconds: dict[str, float] = {}
    names = ", ".join(f"{path.name} ({len(ids)})" for path, ids in zip(SAMPLES, texts, strict=True))
    print(f"default model, {sum(map(len, texts))} tokens of benchmarks/data/{{{names}}}")
    header = ("format", "ppl", "vs bf16", "vs fp32", "top1=bf16", "top1=fp32", "build+run s", "per text vs bf16")
    print(f"{header[0]:10s}", *(f"{h:>9s}" for h in header[1:]), flush=True)
    rows = []
    for fmt in dict.fromkeys(["bf16", "fp32", *args.formats]):  # the two references first
        start = time.perf_counter()
        logits[fmt] = extra_logits(fmt, texts) if fmt in EXTRA else texts_logits(fmt, texts)
        seconds[fmt] = time.perf_counter() - start
        if fmt == "bf16":
            continue
        for done in ["bf16", fmt] if fmt == "fp32" else [fmt]:  # bf16's row needs fp32's logits
            rows.append(_row(done, logits, texts, seconds[done]))
            print(_line(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            samples = {f"benchmarks/data/{path.name}": len(ids) for path, ids in zip(SAMPLES, texts, strict=True)}
            json.dump({"tokens": sum(map(len, texts)), "samples": samples, "rows": rows}, f, indent=2)


def _row(
    fmt: str, logits: dict[str, list[torch.Tensor]], texts: list[list[int]], seconds: float
) -> dict[str, float | str | list[float]]:
    ppl, bf16, fp32 = (perplexity(logits[f], texts) for f in (fmt, "bf16", "fp32"))
    per_text = [
        perplexity(mine, ids) / perplexity(ref, ids) - 1
        for mine, ref, ids in zip(logits[fmt], logits["bf16"], texts, strict=True)
    ]
    return {
        "format": fmt,
        "perplexity": ppl,
        "delta_vs_bf16": ppl / bf16 - 1,
        "delta_vs_fp32": ppl / fp32 - 1,
        "top1_agreement_bf16": top1_agreement(logits[fmt], logits["bf16"]),
        "top1_agreement_fp32": top1_agreement(logits[fmt], logits["fp32"]),
        "seconds": seconds,
        "delta_vs_bf16_per_text": per_text,
    }


def _line(row: dict[str, float | str | list[float]]) -> str:
    cells = [f"{row['perplexity']:9.3f}", f"{row['delta_vs_bf16']:+9.2%}", f"{row['delta_vs_fp32']:+9.2%}"]
    cells += [f"{row['top1_agreement_bf16']:9.3f}", f"{row['top1_agreement_fp32']:9.3f}", f"{row['seconds']:9.1f}"]
    per_text = row["delta_vs_bf16_per_text"]
    assert isinstance(per_text, list)
    cells.append(" / ".join(f"{d:+.2%}" for d in per_text))
    return f"{row['format']:10s} " + " ".join(cells)


if __name__ == "__main__":
    main()
