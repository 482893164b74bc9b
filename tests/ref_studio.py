"""References for the studio path: LoRA adapters made with PEFT, PEFT's own merge-then-save, saved live models.

Like tests/models.py, this never imports `supervisor` or `child`: a reference comes from PEFT and transformers
alone (`PeftModel.from_pretrained(...).merge_and_unload()` + `save_pretrained`), so a bug in our per-layer merge
or pool reader cannot hide on both sides of a comparison. The exporter then runs on that plain checkpoint.
"""
from __future__ import annotations

import json
import os

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def lora_model(model, *, seed: int = 1, targets=ALL_LINEAR, **config):
    """`model` wrapped by PEFT with a fresh LoRA adapter whose B is random and non-zero (PEFT starts it at zero,
    which would make every merge a no-op)."""
    from peft import LoraConfig, get_peft_model

    config = {"r": 8, "lora_alpha": 16, **config}
    peft_model = get_peft_model(model, LoraConfig(target_modules=list(targets), **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft_model


def make_adapter(base_dir: str, out_dir: str, **config) -> str:
    """Save a random LoRA adapter for the checkpoint in base_dir (see lora_model for the options)."""
    lora_model(load(base_dir), **config).save_pretrained(out_dir)
    return out_dir


def merged_checkpoint(base_dir: str, adapter_dir: str, out_dir: str) -> str:
    """PEFT's merge on CPU, saved: `PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained`."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(load(base_dir), adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    return out_dir


def edit_adapter(adapter_dir: str, out_dir: str, *, config: dict | None = None, extra_tensors: dict | None = None,
                 drop: str | None = None) -> str:
    """A copy of an adapter with config keys changed, tensors added, or tensors whose name contains `drop` removed."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    if drop:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    tensors.update(extra_tensors or {})
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir
