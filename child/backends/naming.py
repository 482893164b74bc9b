"""Checkpoint tensor names ↔ the names of the model the layer quantizer builds (experts linearized).

    checkpoint key ──transformers' renamings──▶ model key          "block_sparse_moe.gate.weight" → "mlp.gate.weight"
                   ──its expert converters───▶ linearized expert   "block_sparse_moe.experts.3.w1.weight"
                                                                    → "mlp.experts.3.gate_proj.weight"
                   ──fused on disk───────────▶ raw experts param   "mlp.experts.gate_up_proj" (GPT-OSS): loaded
                                                                    into the fused module, then linearized

transformers loads a checkpoint through a per-architecture conversion mapping (`conversion_mapping.py`): renamings,
and converters that stack per-expert 2D tensors into one fused 3D parameter (`MergeModulelist`, then `Concatenate`
for gate+up). llm-compressor quantizes MoE experts as per-expert Linears (`LinearExperts2D`: `experts.N.gate_proj`,
`up_proj`, `down_proj`). This module reads that same mapping to send each checkpoint tensor to its linearized
module, so a layer loads without ever building the fused tensor, and the output is written back under the
checkpoint's own names (what transformers' converters expect on load).

Owns the mapping only: it never loads a tensor and never quantizes.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from torch import nn

__all__ = ["NameMap", "Mapped"]

# converter target leaf -> the linearized projection each of its sources becomes, in source order
_EXPERT_TARGETS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "up_proj": ("up_proj",)}
_EXPERT_OPS = {"MergeModulelist", "Concatenate"}


@dataclass(frozen=True)
class Mapped:
    key: str  # the model's name for the tensor (linearized experts)
    fused: str | None = None  # set when the tensor is a fused experts parameter: that experts module's path


@dataclass
class NameMap:
    """Maps checkpoint keys to the linearized model's keys; built once per model from transformers' own mapping."""

    transforms: list = field(default_factory=list)  # transformers' WeightRenaming / WeightConverter, in its order
    renamings: list = field(default_factory=list)
    converters: list = field(default_factory=list)
    base_model_prefix: str = ""
    raw_keys: dict = field(default_factory=dict)  # state_dict keys of the model as transformers builds it (a dict:
    # transformers' rename_source_key looks keys up with .get)
    linear_keys: frozenset = frozenset()  # state_dict keys after linearization
    linearized: tuple = ()  # paths of the experts modules that were linearized

    @classmethod
    def build(cls, model: nn.Module, raw_keys: set[str], linear_keys: set[str], linearized: list[str]) -> "NameMap":
        """model: the (meta) PreTrainedModel; raw_keys / linear_keys: its state_dict keys before / after the experts
        at `linearized` were linearized."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        return cls(
            transforms=transforms,
            renamings=[t for t in transforms if isinstance(t, WeightRenaming)],
            converters=[t for t in transforms if isinstance(t, WeightConverter)],
            base_model_prefix=getattr(model, "base_model_prefix", "") or "",
            raw_keys=dict.fromkeys(raw_keys, True),
            linear_keys=frozenset(linear_keys),
            linearized=tuple(linearized),
        )

    def used(self, keys) -> list:
        """The transforms transformers records as used (`model._weight_conversions`) when it loads a checkpoint
        holding `keys`; compressed-tensors reverses them to write config.json's ignore list in checkpoint names."""
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = copy.deepcopy(self.transforms)  # fresh `was_used` flags
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        for key in keys:
            rename_source_key(key, renamings, converters, self.base_model_prefix, self.raw_keys)
        return [t for t in transforms if t.was_used()]

    def to_model(self, key: str) -> Mapped:
        """The model-side name of checkpoint tensor `key` (unchanged when nothing maps it)."""
        from transformers.core_model_loading import rename_source_key

        renamed, _ = rename_source_key(key, self.renamings, [], self.base_model_prefix, self.raw_keys)
        if renamed in self.linear_keys:
            return Mapped(renamed)
        for conv in self.converters:
            expert = _expert_key(conv, renamed)
            if expert is not None and expert in self.linear_keys:
                return Mapped(expert)
        if renamed in self.raw_keys:
            owner = next((p for p in self.linearized if renamed.startswith(p + ".")), None)
            if owner is not None:
                return Mapped(renamed, fused=owner)
        if key in self.linear_keys:
            return Mapped(key)
        return Mapped(renamed)


def _expert_key(conv, key: str) -> str | None:
    """The linearized expert key a MergeModulelist converter would stack `key` into, or None if it does not match."""
    if {type(op).__name__ for op in conv.operations} - _EXPERT_OPS:
        return None  # a converter that transposes, chunks or dequantizes: not a plain per-expert stack
    targets = conv._original_target_patterns
    if len(targets) != 1:
        return None
    leaf = targets[0].rstrip("$").rsplit(".", 1)[-1]
    projections = _EXPERT_TARGETS.get(leaf)
    if projections is None:
        return None
    for j, pattern in enumerate(conv._original_source_patterns):
        if "*" not in pattern or j >= len(projections):
            continue
        head, tail = pattern.split("*", 1)  # ".experts.", ".w1.weight"
        m = re.search(re.escape(head) + r"(\d+)" + re.escape(tail) + "$", key)
        if m is None:
            continue
        experts = key[: m.start()] + head.rstrip(".")  # "model.layers.0.mlp" + ".experts"
        param = tail.rsplit(".", 1)[-1]
        return f"{experts}.{m.group(1)}.{projections[j]}.{param}"
    return None


def find_decoder_layers(model: nn.Module, config) -> tuple[str, nn.ModuleList]:
    """(prefix "model.layers.", the ModuleList) of the decoder layers of `model` (a meta skeleton): the ModuleList
    as long as config's num_hidden_layers, one named "...layers" first. Shared by the backends (here because
    child/backends/quantize.py pulls in llm-compressor, which a torchao worker does not import)."""
    n = config.get_text_config().num_hidden_layers
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and name]
    found.sort(key=lambda nm: not nm[0].endswith("layers"))
    if not found:
        raise NotImplementedError(f"cannot find the decoder layers of {type(model).__name__}: no ModuleList of {n} "
                                  "layers")
    name, layers = found[0]
    return name + ".", layers


class LayerStub(nn.Module):
    """Stands in for decoder layer `index` in the model's own forward, so that the forward runs without the layers'
    weights: it hands (index, hidden_states, args, kwargs) to `call`, whose return value it returns (or which raises
    to end the forward there). Attributes the model's forward reads off a layer (attention_type...) come from the
    real (meta) layer, which is not a submodule (its parameters are not the trunk's)."""

    def __init__(self, layer: nn.Module, index: int, call):
        super().__init__()
        self.__dict__["_layer"] = layer
        self.__dict__["_call"] = call
        self.index = index

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)

    def forward(self, hidden_states, *args, **kwargs):
        return self.__dict__["_call"](self.index, hidden_states, args, kwargs)
