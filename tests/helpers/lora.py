"""PEFT LoRA adapters made in the test (no download): seeded random A and B (B non-zero, so outputs change),
saved in PEFT's own format by ``peft`` itself."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base_path: Path,
    out_dir: Path,
    *,
    targets: tuple[str, ...] = ALL_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    rslora: bool = False,
    seed: int = 0,
    scale: float = 0.1,
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def peft_reference(base_path: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers (+ peft) on the same weights, fp32 eager attention: the reference outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def greedy_reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
