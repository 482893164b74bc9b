"""The whole-model torchao reference that torchao exports are compared against, and how to compare them.

The reference is transformers' own path, in one process, with no code of ours: `from_pretrained(src,
quantization_config=TorchAoConfig(config, modules_to_not_convert=...))` quantizes every nn.Linear as it loads,
then `save_pretrained(safe_serialization=True)` flattens the torchao tensors into safetensors. The torchao
config object is written out by the caller (not built from a job), so a bug in our TOML spelling cannot hide on
both sides. Never imports `supervisor` or `child`.
"""
from __future__ import annotations

import json
import os

import torch


def torchao_reference(model_dir: str, config, out_dir: str, *, modules_to_not_convert: list[str],
                      device: str = "cpu") -> str:
    """Quantize model_dir on load with `config` (a torchao AOBaseConfig) and save it to out_dir."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    qc = TorchAoConfig(config, modules_to_not_convert=list(modules_to_not_convert))
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=qc, device_map=device)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def quantization_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["quantization_config"]


def merged_metadata(folder: str) -> dict[str, str]:
    """Every shard's safetensors metadata merged as transformers merges it (dict.update, file order)."""
    import glob

    from safetensors import safe_open

    merged: dict[str, str] = {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(fn, "pt") as f:
            merged.update(f.metadata() or {})
    return merged


def shard_metadata(folder: str) -> dict[str, dict[str, str]]:
    """{shard file name: its safetensors metadata}, each shard on its own (as vLLM reads them)."""
    import glob

    from safetensors import safe_open

    out = {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(fn, "pt") as f:
            out[os.path.basename(fn)] = dict(f.metadata() or {})
    return out


def load_and_run(folder: str, ids: torch.Tensor, device: str = "cpu"):
    """(state_dict of the loaded model, its logits for ids, the loading info): loaded as a user would."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, device_map=device, output_loading_info=True)
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float().cpu()
    return model.state_dict(), logits, info


def assert_same_state(a: dict, b: dict) -> None:
    """Same names, same tensor types (torchao subclasses included) and the same bits in every component."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:8]
    for name in a:
        ta, tb = a[name], b[name]
        assert type(ta) is type(tb), f"{name}: {type(ta).__name__} vs {type(tb).__name__}"
        parts = getattr(ta, "tensor_data_names", None)
        if parts:
            parts = list(parts) + list(getattr(ta, "optional_tensor_data_names", []))
            for p in parts:
                assert (getattr(ta, p) is None) == (getattr(tb, p) is None), f"{name}.{p}: present in one only"
            pairs = [(getattr(ta, p), getattr(tb, p)) for p in parts if getattr(ta, p) is not None]
        else:
            pairs = [(ta, tb)]
        for x, y in pairs:
            assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            x, y = x.detach().cpu(), y.detach().cpu()
            if x.element_size() == 1 and x.is_floating_point():
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            assert torch.equal(x, y), f"{name}: values differ"
