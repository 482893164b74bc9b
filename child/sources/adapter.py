"""LoRA merged per layer in the child: PEFT's own layer does the arithmetic, one targeted Linear at a time.

    inner Source (disk checkpoint | live model's pool) ──read(layer i)──▶ {name: tensor}
    adapter slice of layer i (A, B, r, alpha | scaling) ──┐
                                                          ▼
        peft.tuners.lora.Linear(base=<the layer's Linear weight>) ─▶ .merge() ─▶ merged weight
                                                          ▼
    Merged.read(layer i) ─▶ {name: tensor} with every targeted `<module>.weight` replaced

The bytes must equal `PeftModel.from_pretrained(base, adapter).merge_and_unload()` on CPU. Measured with PEFT
0.21.2: that needs PEFT's dtype rules exactly (adapter weights upcast to fp32 on load, the fp32 delta
`(B @ A) * scaling` added to the bf16 weight and rounded once); so instead of re-deriving them, each merge builds
PEFT's own `lora.Linear` around the base weight, loads the adapter pair into it the way `PeftModel` does
(`cast_adapter_dtype`, then a `load_state_dict` copy) and calls its `merge()`. Scaling comes from PEFT too
(`update_layer`: alpha/r or alpha/sqrt(r) with rsLoRA; `get_pattern_key` for rank_pattern/alpha_pattern).

Owns the merge and reading the adapter folder; what cannot be merged exactly is refused earlier by the
supervisor (supervisor/checks/adapter.py) and again here, with the same rules (shared/lora.py). It never writes, and never holds more than one layer's slice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from child.imports import allow
from shared.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, not_mergeable_key, split_key, unsupported

allow("peft")  # the warm parent marks it absent: no other export imports it (child/imports.py)
_NAME = "default"


@dataclass
class LoraPair:
    """One targeted Linear's adapter: A [r, in], B [out, r], and how PEFT would scale and cast it."""

    a: torch.Tensor
    b: torch.Tensor
    r: int
    lora_alpha: float
    use_rslora: bool = False
    scaling: float | None = None  # a live PEFT layer's own value; None: PEFT computes it from r/alpha/rsLoRA
    autocast: bool = True  # PeftModel.from_pretrained's autocast_adapter_dtype (True: bf16/fp16 -> fp32); a live
    # pair (scaling set) is upcast only when asked (child/sources/live.py)


_configs: dict[bool, object] = {}


def _lora_config(use_rslora: bool):
    from peft import LoraConfig

    if use_rslora not in _configs:
        # init_lora_weights=False: the pair is loaded right after, PEFT's own init would only be overwritten
        _configs[use_rslora] = LoraConfig(r=1, lora_alpha=1, use_rslora=use_rslora, init_lora_weights=False)
    return _configs[use_rslora]


def merge_pair(weight: torch.Tensor, pair: LoraPair) -> torch.Tensor:
    """`weight` ([out, in]) with `pair` merged, by PEFT's lora.Linear.merge(); `weight` itself is not changed."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import cast_adapter_dtype

    out_f, in_f = weight.shape
    if tuple(pair.a.shape) != (pair.r, in_f) or tuple(pair.b.shape) != (out_f, pair.r):
        raise ValueError(f"LoRA pair A{tuple(pair.a.shape)} B{tuple(pair.b.shape)} does not fit a weight of "
                         f"shape {tuple(weight.shape)} with r={pair.r}")
    with torch.device("meta"):
        base = nn.Linear(in_f, out_f, bias=False)
    # merge() adds in place: work on a private copy (the source may be a read-only mapping of the live model)
    base.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    layer = LoraLinear(base, _NAME, config=_lora_config(pair.use_rslora), r=pair.r, lora_alpha=pair.lora_alpha)
    with torch.no_grad():
        if pair.scaling is None:
            # as PeftModel.from_pretrained: adapter params take the base dtype, are upcast, then the file is copied in
            cast_adapter_dtype(layer, adapter_name=_NAME, autocast_adapter_dtype=pair.autocast)
            layer.load_state_dict({f"lora_A.{_NAME}.weight": pair.a, f"lora_B.{_NAME}.weight": pair.b}, strict=False)
        else:
            # a live PEFT layer: its own tensors (their dtype decides PEFT's arithmetic) and its own scaling;
            # autocast: upcast as from_pretrained would have (a QLoRA model's reference, supervisor/live/qlora.py)
            layer.lora_A[_NAME].weight = nn.Parameter(pair.a, requires_grad=False)
            layer.lora_B[_NAME].weight = nn.Parameter(pair.b, requires_grad=False)
            if pair.autocast:
                cast_adapter_dtype(layer, adapter_name=_NAME, autocast_adapter_dtype=True)
            layer.scaling[_NAME] = pair.scaling
        layer.merge(adapter_names=[_NAME])
    return layer.get_base_layer().weight.data


class AdapterFolder:
    """A PEFT LoRA adapter on disk: its config (PEFT's LoraConfig) and a mmap of its weights, one layer at a time."""

    def __init__(self, folder: str):
        from peft import LoraConfig
        from safetensors import safe_open

        self.folder = folder
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            raw = json.load(f)
        problem = unsupported(raw)
        if problem:
            raise ValueError(problem)
        self.config = LoraConfig.from_pretrained(folder)
        self._file = os.path.join(folder, ADAPTER_WEIGHTS)
        with safe_open(self._file, "pt") as f:
            keys = list(f.keys())
        self.modules: dict[str, tuple[str, str]] = {}  # module path -> (A key, B key)
        for key in keys:
            module, kind = split_key(key)
            if not kind:
                raise ValueError(not_mergeable_key(key))
            a, b = self.modules.get(module, ("", ""))
            self.modules[module] = (key, b) if kind == "lora_A" else (a, key)

    def pairs(self, weight_names: list[str]) -> dict[str, LoraPair]:
        """{"<module>.weight": LoraPair} for the targeted modules among `weight_names`; reads only those."""
        from peft.utils.other import get_pattern_key
        from safetensors import safe_open

        cfg = self.config
        wanted = {name[: -len(".weight")]: name for name in weight_names if name.endswith(".weight")}
        out = {}
        with safe_open(self._file, "pt", device="cpu") as f:
            for module in sorted(set(wanted) & set(self.modules)):
                a_key, b_key = self.modules[module]
                # LoraModel._create_and_replace: patterns match the module's path in the base model
                r = cfg.rank_pattern.get(get_pattern_key(cfg.rank_pattern.keys(), module), cfg.r)
                alpha = cfg.alpha_pattern.get(get_pattern_key(cfg.alpha_pattern.keys(), module), cfg.lora_alpha)
                out[wanted[module]] = LoraPair(f.get_tensor(a_key), f.get_tensor(b_key), r=r, lora_alpha=alpha,
                                               use_rslora=cfg.use_rslora)
        return out


class Merged:
    """A Source whose targeted Linear weights come out with their LoRA pair merged (see the module docstring)."""

    def __init__(self, inner, pairs_for, digest=None):
        self.inner, self._pairs_for = inner, pairs_for  # pairs_for(weight_names) -> {weight name: LoraPair}
        self._digest = digest  # digest(names): of pairs that can change under the same fingerprint (live ones)

    def layer_names(self, prefix: str, index: int) -> list[str]:
        return self.inner.layer_names(prefix, index)

    def non_layer_names(self, prefix: str, num_layers: int | None = None) -> list[str]:
        return self.inner.non_layer_names(prefix, num_layers)

    def meta(self, names: list[str]) -> dict:
        return self.inner.meta(names)  # a merged weight keeps its dtype and shape

    def read(self, names: list[str]) -> dict:
        tensors = self.inner.read(names)
        for name, pair in self._pairs_for(names).items():
            tensors[name] = merge_pair(tensors[name], pair)
        return tensors

    def nbytes(self, tensors: dict) -> int:
        return self.inner.nbytes(tensors)

    def all_names(self) -> list[str]:
        return self.inner.all_names()

    def digest(self, names: list[str]) -> str:
        return self._digest(names) if self._digest is not None else self.inner.digest(names)

    def trim(self) -> None:
        self.inner.trim()
