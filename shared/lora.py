"""What a PEFT LoRA adapter looks like on disk, and which adapters can be merged exactly: shared by both sides.

The supervisor refuses an adapter before anything is written (supervisor/checks/adapter.py) and the child refuses it
again before merging (child/sources/adapter.py); both use these rules, so the two never disagree. Owns names and rules
only: no torch, no peft, never opens a file.
"""
from __future__ import annotations

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PEFT prepends to every key of a saved adapter

# adapter_config.json keys whose non-default value means a merge that is not plain `W + scaling * (B @ A)`.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on parameters)",
    "trainable_token_indices": "trainable_token_indices",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow (arrow_config)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "mica": "MiCA (mica)",
}
_FIX = ("merge it with PEFT (merge_and_unload), save the model and export that checkpoint instead")
# the same for a live adapter on a quantized base (QLoRA): merge_and_unload() there would merge into the quantized
# weights (the LoRA's precision lost, then quantized twice); the merge belongs in the 16-bit base
FIX_QUANTIZED = ("save the adapter, merge it into the 16-bit base with PEFT (PeftModel.from_pretrained(base, "
                 "adapter).merge_and_unload()), save that and export it")


def unsupported(config: dict, fix: str = _FIX) -> str | None:
    """Why an adapter with this config (adapter_config.json, or a live LoraConfig's fields) cannot be merged
    exactly per layer, or None; `fix`: the advice that ends the message."""
    if config.get("peft_type", "LORA") not in ("LORA", None):
        return f"the adapter is {config.get('peft_type')}, not LoRA: only LoRA adapters are merged per layer"
    found = [label for key, label in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        found.append(f"trained biases (bias = {config['bias']!r})")
    if found:
        return f"the adapter uses {', '.join(found)}, which cannot be merged exactly per layer; {fix}"
    return None


def split_key(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' -> ('model.layers.0.mlp.up_proj', 'lora_A');
    the kind is '' for anything that is not a LoRA A/B weight."""
    name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    parts = name.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"):
        return ".".join(parts[:-2]), parts[-2]
    return name, ""


def not_mergeable_key(key: str) -> str:
    return (f"adapter tensor {key!r} is not a LoRA A/B weight of a Linear (embedding LoRA, DoRA magnitudes, "
            f"biases and trained modules cannot be merged exactly per layer); {_FIX}")
