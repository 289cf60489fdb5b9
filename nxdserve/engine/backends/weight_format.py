"""The torch backend's weight format when ``--quantization`` is not given: a .gguf model from its own blocks.

The default model ships as Q4_1, whose blocks are exactly ``QuantLinear``'s 4-bit group-32 scale-and-offset
format (``gguf_weights.py``), so by default it is served from those bits rather than from a dense expansion
(5 bits a weight instead of fp32's 32, read once per decode step). ``--dtype`` asks for a dense copy, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nxdserve.config import EngineConfig

GGUF = "gguf"
# C kernel paths that run the fused bf16 decoder (fused_decode.py), which reads dense bf16 weights only.
FUSED_BF16_PATHS = ("amx", "avx512bf16")


@dataclass(frozen=True)
class WeightFormat:
    quantization: str | None  # the --quantization value to serve with; None: dense in the model dtype
    reason: str  # why, for the startup log
    by_default: bool  # chosen here (not asked for): a .gguf whose blocks turn out not to be served falls back


def default_weight_format(
    config: EngineConfig,
    gguf_file: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    kernel_path: str,
    multimodal: bool,
) -> WeightFormat:
    """The weight format the torch backend serves, after a checkpoint's own format (compressed-tensors) is
    resolved into ``config.quantization``. In order:

    - ``--quantization X`` given (or detected from the checkpoint): X.
    - ``--dtype float32|bfloat16|float16`` given: a dense copy in that dtype (how to ask for one).
    - not a .gguf model (a HF folder, a hub id), or a multimodal model: dense, unchanged (where ``--dtype auto`` is
      fp32 on the CPU, the torch backend then keeps the dense weights in bf16: ``CpuOptions.bf16_weights``).
    - not on a CPU (CUDA): dense; ``QuantLinear``'s kernels are PyTorch's CPU weight-only ones.
    - a CPU whose default dtype is bf16 with the fused bf16 decoder's kernel path (AVX512-BF16 / AMX): dense
      bf16. The fused C decoder reads dense bf16 weights and is the measured-fast path there (a 2-core Xeon
      with AMX: 4.6x the exact 4-bit blocks' 32 concurrent rows; their single stream is 1.1x its own there, so
      ``--dtype float32`` is the single-stream choice; docs/quantization.md).
    - otherwise (a .gguf on a CPU without native bf16, or with the C kernels forced lower or off): ``gguf``,
      the file's own 4-bit blocks, bit for bit. LoRA adapters run over them (``linear.linear`` takes a
      ``QuantLinear`` base, the adapters' GEMMs are separate), and so does speculative decoding: the
      target is quantized, a draft model or EAGLE head stays dense. If the file's linears are in a type
      not served quantized (e.g. Q8_0, Q6_K, F16), the backend falls back to dense (``by_default``).

    The nxd backend never calls this: NxD reads dense checkpoints, so the default model stays dense there.
    """
    if config.quantization is not None:
        return WeightFormat(config.quantization, f"--quantization {config.quantization}", False)
    if config.dtype != "auto":
        return WeightFormat(None, f"--dtype {config.dtype}: a dense copy", False)
    if gguf_file is None:
        return WeightFormat(None, "not a .gguf model: dense", False)
    if multimodal:
        return WeightFormat(None, "a multimodal model: dense", False)
    if device.type != "cpu":
        return WeightFormat(None, f"on {device.type}: dense (the 4-bit kernels are CPU ones)", False)
    if dtype == torch.bfloat16 and kernel_path in FUSED_BF16_PATHS:
        return WeightFormat(None, f"dense bf16 for the fused {kernel_path} decoder", False)
    return WeightFormat(GGUF, f"{gguf_file.name}'s own 4-bit blocks (--dtype float32 for a dense copy)", True)
