"""Perplexity and top-1 agreement of a model on a text, for comparing weight formats (tests, benchmarks).

``texts_logits`` builds the default model in one of the formats ``FORMATS`` names, as the server would serve it
(``--dtype`` for the dense ones; the fp32 model quantized with ``--quantization`` for the others), and returns
its logits over each shipped sample text (``SAMPLES``): ``tests/quant/test_accuracy.py`` bounds their pooled
perplexity and ``benchmarks/quant_accuracy.py`` reports it. One text of ~400 tokens was too noisy for a 1% bound:
on it the int8 format measured +0.76% over bf16 on an AVX2 machine and +1.03% on an AVX512-BF16 one (whose bf16
model rounds activations to bf16), while two more texts gave -0.24% and +0.21% there (docs/quantization.md).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import cast

import numpy as np
import torch

from nxdserve.engine.models.llama import LlamaFamilyModel
from nxdserve.engine.models.runner import SlotModelRunner

# Plain English prose, 404 / 440 / 430 tokens with the default tokenizer, each a few short passages (a story,
# science, instructions, computing); never used to choose or fit any quantizer. Each text is one prefill.
_DATA = Path(__file__).resolve().parents[3] / "benchmarks" / "data"
SAMPLES = (_DATA / "ppl_sample.txt", _DATA / "ppl_sample_2.txt", _DATA / "ppl_sample_3.txt")
SAMPLE = SAMPLES[0]
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


def perplexity(logits: torch.Tensor | list[torch.Tensor], token_ids: list[int] | list[list[int]]) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given the logits of positions 0..T-2: of one text, or
    pooled over several (a list of each, every token weighing the same)."""
    logits_list = logits if isinstance(logits, list) else [logits]
    texts = cast(list[list[int]], token_ids) if isinstance(logits, list) else [cast(list[int], token_ids)]
    if len(logits_list) != len(texts):
        raise ValueError(f"{len(logits_list)} logits for {len(texts)} texts")
    nll = []
    for one, ids in zip(logits_list, texts, strict=True):
        logp = torch.log_softmax(one[:-1].float(), dim=-1)
        nll.append(-logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1))
    return float(torch.exp(torch.cat(nll).mean()))


def top1_agreement(logits: torch.Tensor | list[torch.Tensor], reference: torch.Tensor | list[torch.Tensor]) -> float:
    """Share of positions whose argmax equals the reference's (teacher-forced greedy agreement), pooled over
    the texts where both are lists."""
    got = torch.cat(logits) if isinstance(logits, list) else logits
    ref = torch.cat(reference) if isinstance(reference, list) else reference
    return float((got.argmax(-1) == ref.argmax(-1)).float().mean())


def sample_texts(paths: tuple[Path, ...] = SAMPLES) -> list[list[int]]:
    """Each shipped sample text (``SAMPLES``), tokenized with the default model's tokenizer."""
    from transformers import AutoTokenizer

    from nxdserve.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    return [list(tokenizer(path.read_text())["input_ids"]) for path in paths]


def sample_token_ids() -> list[int]:
    """The first shipped sample text alone (``SAMPLE``), tokenized with the default model's tokenizer."""
    return sample_texts((SAMPLE,))[0]


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


def texts_logits(fmt: str, texts: list[list[int]]) -> list[torch.Tensor]:
    """The default model's logits over each of ``texts`` in ``fmt`` (each text its own prefill); the model is
    dropped afterwards."""
    model = default_model(fmt)
    return [next_token_logits(model, ids) for ids in texts]


def format_logits(fmt: str, token_ids: list[int]) -> torch.Tensor:
    """The default model's logits over ``token_ids`` in ``fmt``; the model is dropped afterwards."""
    return texts_logits(fmt, [token_ids])[0]
