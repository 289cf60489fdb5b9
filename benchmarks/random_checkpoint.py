"""Random Llama checkpoints of a given shape for the memory benchmarks (``calibration_memory.py``,
``load_memory.py``), with the default model's tokenizer, and the process's memory counters they read."""

from __future__ import annotations

import shutil
from pathlib import Path

# (hidden, intermediate, attention heads, kv heads, layers)
Shape = tuple[int, int, int, int, int]


def write_checkpoint(shape: Shape, out: Path, dtype: str = "float32") -> Path:
    """A seeded random ``LlamaForCausalLM`` of ``shape`` (tied 49152-token embedding) saved to ``out`` in
    ``dtype``, with the default model's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nxdserve.model_files import resolve_model

    hidden, intermediate, heads, kv_heads, layers = shape
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_hidden_layers=layers, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    source = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def process_status(key: str) -> int:
    """A byte count from /proc/self/status (``VmRSS``, ``VmHWM``, ...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Restart VmHWM from the current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")
