"""Tiny PEFT LoRA adapters of a test checkpoint, saved as PEFT saves them (docs/lora.md's format)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def make_peft_adapter(
    base_folder: Path,
    out_folder: Path,
    *,
    seed: int,
    r: int = 4,
    target_modules: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
    **config: Any,
) -> Path:
    """A LoRA adapter of ``base_folder``'s model with random ``lora_B`` (PEFT starts it at zero, which would
    change nothing), written to ``out_folder``; ``config``: more ``peft.LoraConfig`` options. Returns the folder."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32)
    lora_config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(target_modules), **config)
    adapted = peft.get_peft_model(model, lora_config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    adapted.save_pretrained(out_folder)
    return out_folder
