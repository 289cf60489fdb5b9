"""Perplexity and top-1 agreement of a model on a text, for comparing weight formats (tests, benchmarks).

``format_logits`` builds the default model in one of the formats ``FORMATS`` names, as the server would serve it
(``--dtype`` for the dense ones; the fp32 model quantized with ``--quantization`` for the others), and returns
its logits over the shipped sample (``SAMPLE``): ``tests/quant/test_accuracy.py`` bounds them and
``benchmarks/quant_accuracy.py`` reports them.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import torch

from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner

# 404 tokens of plain English prose with the default tokenizer; never used to choose or fit any quantizer.
SAMPLE = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "ppl_sample.txt"
DENSE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Dense dtypes, then --quantization methods (served on the fp32 model, this CPU's default dtype).
FORMATS = ("bf16", "fp32", "int8", "fp8", "int4-g32", "int4-g64", "int4-g128", "rtn", "gguf")


@torch.inference_mode()
def next_token_logits(model: LlamaFamilyModel, token_ids: list[int], chunk: int = 0) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position: the whole text as one prefill row, or (``chunk`` > 0) as
    consecutive prefill chunks of that many tokens (calls of that many rows, as small decode batches run)."""
    n = len(token_ids)
    runner = SlotModelRunner(model, num_slots=1, max_len=n)
    parts = []
    for start in range(0, n, chunk or n):
        end = min(n, start + (chunk or n))
        ids = torch.tensor(token_ids[start:end])
        parts.append(runner.logits(runner.run(ids, np.array([0]), np.array([start]), np.array([end - start]))))
    return torch.cat(parts)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given the logits of positions 0..T-2."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, torch.tensor(token_ids[1:])[:, None]).mean()
    return float(torch.exp(nll))


def top1_agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions whose argmax equals the reference's (teacher-forced greedy agreement)."""
    return float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


def sample_token_ids() -> list[int]:
    """The shipped sample, tokenized with the default model's tokenizer."""
    from transformers import AutoTokenizer

    from nxdserve.model_files import resolve_model

    return list(AutoTokenizer.from_pretrained(str(resolve_model(None)))(SAMPLE.read_text())["input_ids"])


@functools.cache
def _dense_default_model(dtype: torch.dtype) -> LlamaFamilyModel:
    from nxdserve.model_files import resolve_model

    return LlamaFamilyModel.from_pretrained(resolve_model(None), dtype, torch.device("cpu"), max_len=512)


def default_model(fmt: str) -> LlamaFamilyModel:
    """The default model in ``fmt`` (a dense dtype, a ``quant.METHODS`` name or gguf): a fresh copy."""
    from nxdserve.engine.models.quant import METHODS, quantize_model
    from nxdserve.model_files import default_gguf_path, resolve_model

    if fmt not in FORMATS and fmt not in METHODS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {FORMATS} or {tuple(METHODS)}")
    model = copy.deepcopy(_dense_default_model(DENSE_FORMATS.get(fmt, torch.float32)))
    if fmt not in DENSE_FORMATS:
        quantize_model(model, fmt, default_gguf_path(), checkpoint=resolve_model(None))  # its tokenizer
    return model


def format_logits(fmt: str, token_ids: list[int]) -> torch.Tensor:
    """The default model's logits over ``token_ids`` in ``fmt``; the model is dropped afterwards."""
    return next_token_logits(default_model(fmt), token_ids)
