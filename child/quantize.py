"""One decoder layer's tensors in, compressed-tensors out: the child's quantization arithmetic.

This module owns the recipe that makes a layer quantized in isolation bit-identical to llm-compressor's
whole-model `oneshot` + `save_pretrained(save_compressed=True)` for data-free schemes, and the
`quantization_config` block that oneshot writes into config.json.

    config.json ─▶ meta skeleton (built once) ─┐
    {name: tensor} of layer i ──────────────────┴▶ deepcopy(meta layer i), load (assign=True)
        ─▶ rooted at its full path ("model.layers.i") so targets/ignore see checkpoint names
        ─▶ apply_quantization_config ─▶ weight observers ─▶ fuse (NVFP4: q/k/v, gate/up share a
           global scale) ─▶ observe + update_qparams ─▶ freeze ─▶ compress_module
        ─▶ {name: CPU tensor}: the source with each quantized module's entries replaced

All arithmetic and formats come from compressed-tensors / llm-compressor calls (the same ones oneshot
makes, in the same order); nothing here computes a scale by hand. MoE experts are linearized on the
meta skeleton the way oneshot's fallback does (llm-compressor's LinearExperts2D), so a Qwen3-MoE
layer's per-expert checkpoint tensors load straight into per-expert Linears.

It must never import `supervisor` (the two meet only on the wire), never read or write files except
the config it is given and `write_config`'s destination, never change torch's thread count, and keep
no reference to a layer after returning its tensors (per-layer leaks are what this project exists
to avoid).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable

import compressed_tensors
import torch
from compressed_tensors import ModelCompressor
from compressed_tensors.base import (
    COMPRESSION_VERSION_NAME,
    QUANTIZATION_METHOD,
    QUANTIZATION_METHOD_NAME,
    SPARSITY_CONFIG_NAME,
    TRANSFORM_CONFIG_NAME,
)
from compressed_tensors.compressors import compress_module
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
from compressed_tensors.quantization.utils import is_module_quantized
from compressed_tensors.utils import match_named_modules
from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
from llmcompressor.modeling.moe.linearize import get_non_linearized_moes
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.quantization.calibration import (
    apply_calibration_status,
    freeze_module_quantization,
    initialize_observer,
    observe,
    update_qparams,
)
from llmcompressor.modifiers.quantization.group_size_validation import validate_group_size_divisibility
from llmcompressor.observers import fuse_weight_observers
from llmcompressor.utils.dev import skip_weights_initialize
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from child import quant_error
from shared.job import DEFAULT_IGNORE as _JOB_DEFAULT_IGNORE

__all__ = [
    "DEFAULT_IGNORE",
    "LayerQuantizer",
    "quantization_config_dict",
    "write_config",
]

# The default ignore list (lm_head, MoE routers, shared-expert gates) is part of the job schema: one copy, there.
DEFAULT_IGNORE: list[str] = list(_JOB_DEFAULT_IGNORE)


class LayerQuantizer:
    """Quantizes one decoder layer (or the non-layer modules) at a time, exactly as `oneshot` would."""

    def __init__(self, config_dir: str, scheme: str, ignore: list[str], device: str = "cpu"):
        self.scheme = scheme
        self.ignore = list(ignore)
        self.device = torch.device(device)
        self._modifier = _modifier(scheme, self.ignore)
        self._targets = self._modifier.resolved_targets
        self._qcfg = self._modifier.resolved_config
        self.config = _load_config(config_dir)
        self._skeleton = _meta_skeleton(self.config)
        prefix, layers = _find_layers(self._skeleton, self.config)
        self.layer_prefix: str = prefix
        self.num_layers: int = len(layers)
        self._layers = layers
        # targeted Linears outside the decoder layers (lm_head when it is not ignored)
        self._non_layer_targets = _non_layer_targets(self._skeleton, self.layer_prefix, self._targets, self.ignore)

    def quantize_layer(self, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return layer `index`'s tensors (full checkpoint names) as oneshot's compressed save writes them."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} does not exist: the model has {self.num_layers} layers")
        path = f"{self.layer_prefix}{index}"
        return self._quantize_subtree(path, self._layers[index], tensors)

    def quantize_non_layer(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the non-layer tensors (embeddings, final norm, lm_head) as oneshot's compressed save writes them."""
        out = dict(tensors)
        for name, tied_to in self._non_layer_targets.items():
            own = {k: v for k, v in tensors.items() if k.startswith(name + ".")}
            if not own and tied_to in tensors:
                # tied embeddings: oneshot unties the head and quantizes a copy of the embedding table,
                # keeping the table itself dense (write_config sets tie_word_embeddings to false to match)
                own = {f"{name}.weight": tensors[tied_to]}
            if not own:
                continue
            for k in own:
                out.pop(k, None)
            out.update(self._quantize_subtree(name, self._skeleton.get_submodule(name), own))
        return out

    def serialize(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return tensors, {"format": "pt"}  # what transformers' save_pretrained writes into every shard

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        return write_config(source_config_json, dest_dir, self.scheme, self.ignore)

    def _quantize_subtree(
        self, path: str, meta_module: nn.Module, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        prefix = path + "."
        foreign = [k for k in tensors if not k.startswith(prefix)]
        if foreign:
            raise ValueError(f"tensors outside {path}: {foreign[:5]}")
        module = _materialise(meta_module, {k[len(prefix):]: v for k, v in tensors.items()}, self.device, path)
        root = _rooted(path, module)
        with torch.no_grad():
            quantized = _quantize_modules(root, self._qcfg, self._targets, self.ignore)
            quant_error.measure(quantized, tensors)
            out = dict(tensors)
            for name, m in quantized:
                for k in [k for k in out if k.startswith(name + ".")]:
                    del out[k]
                for k, v in m.state_dict(prefix=name + ".").items():
                    out[k] = v.to("cpu").contiguous()
        return {k: v.contiguous() for k, v in out.items()}


def quantization_config_dict(scheme: str, ignore: list[str], config: str) -> dict:
    """The `quantization_config` block oneshot writes for `scheme`/`ignore` on the model that `config` describes.

    `config` is the source config.json or its folder. The model's structure is needed because oneshot's block
    lists the unquantized Linear-like modules by name (e.g. every MoE router) rather than the ignore patterns.
    """
    qcfg, _ = _compressed_qconfig(scheme, ignore, _load_config(config))
    # the same keys, in the same order, as ModelCompressor.update_config writes
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **qcfg.model_dump(exclude=["quant_method"]),
    }


def write_config(source_config_json: str, dest_dir: str, scheme: str, ignore: list[str]) -> str:
    """Write dest_dir/config.json: the source config plus the quantization_config block, as oneshot's save does."""
    with open(source_config_json) as f:
        source = json.load(f)
    qcfg, unties = _compressed_qconfig(scheme, ignore, _load_config(source_config_json))
    if unties:
        # oneshot unties a targeted tied head, and resave_config copies that into the original config
        text = source.get("text_config", source)
        text["tie_word_embeddings"] = False
    path = os.path.join(dest_dir, "config.json")
    # oneshot re-saves the *original* config.json (resave_config) and then lets update_config add the block
    with open(path, "w") as f:
        json.dump(source, f, indent=2, sort_keys=True)
    ModelCompressor(quantization_config=qcfg).update_config(dest_dir)
    return path


# ---------------------------------------------------------------------------------------------- helpers


def _modifier(scheme: str, ignore: list[str]) -> QuantizationModifier:
    # the same object oneshot builds, so observers, groups and defaults match field for field
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    if modifier.requires_calibration_data:
        raise ValueError(
            f"scheme {scheme} needs calibration data (static activation scales); the layer quantizer "
            "handles data-free schemes only, e.g. FP8_DYNAMIC, W4A16, NVFP4A16"
        )
    return modifier


def _load_config(config: str) -> PretrainedConfig:
    folder = os.path.dirname(config) if os.path.isfile(config) else config
    if os.path.isfile(config) and os.path.basename(config) != "config.json":
        raise ValueError(f"expected a config.json or its folder, got {config}")
    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def _meta_skeleton(config: PretrainedConfig) -> nn.Module:
    """The whole model on the meta device (no memory), MoE experts linearized as oneshot does."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    _linearize_meta_experts(model)
    return model


def _linearize_meta_experts(model: nn.Module) -> None:
    # llmcompressor's linearize_moe cannot run on meta (its offload copy rejects meta tensors), so build the
    # same LinearExperts2D directly on meta; weights come later from the checkpoint's per-expert tensors.
    for name, experts in get_non_linearized_moes(model):
        cls = LinearExperts2D.get_linear_experts_cls(type(experts))
        with torch.device("meta"), skip_weights_initialize():
            linear = cls(getattr(experts, "config", model.config))
        model.set_submodule(name, linear)


def _find_layers(model: nn.Module, config: PretrainedConfig) -> tuple[str, nn.ModuleList]:
    n = config.get_text_config().num_hidden_layers
    found = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and name
    ]
    found.sort(key=lambda nm: not nm[0].endswith("layers"))
    if not found:
        raise NotImplementedError(
            f"cannot find the decoder layers of {type(model).__name__}: no ModuleList of {n} layers"
        )
    name, layers = found[0]
    return name + ".", layers


def _materialise(
    meta_module: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device, path: str
) -> nn.Module:
    """A fresh real copy of meta_module holding `tensors` (keyed relative to it) on `device`."""
    module = copy.deepcopy(meta_module)
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        moe = " (MoE checkpoints whose expert tensors are not named like the linearized experts are not supported)"
        hint = moe if any(".experts." in k for k in missing + unexpected) else ""
        error = NotImplementedError if hint else ValueError
        raise error(f"{path}: tensors do not match the model's layout{hint}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    # assign=True keeps the checkpoint's dtypes and puts the loaded tensors in place of the meta ones, so the
    # layer is never allocated twice (to_empty first would hold an empty copy beside the loaded one)
    module.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True, assign=True)
    for sub in module.modules():  # non-persistent buffers are not in a checkpoint; quantization never reads them
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_meta:
                sub._buffers[name] = torch.empty_like(buf, device=device)
    return module


def _rooted(path: str, module: nn.Module) -> nn.Module:
    """Wrap module in empty parents so its named_modules() are full checkpoint paths ("model.layers.3.mlp")."""
    *parents, leaf = path.split(".")
    root = node = nn.Module()
    for part in parents:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(leaf, module)
    return root


def _quantize_modules(
    root: nn.Module, qcfg: QuantizationConfig, targets: Iterable[str], ignore: list[str]
) -> list[tuple[str, nn.Module]]:
    """Run QuantizationModifier's data-free lifecycle on root; returns the (name, module)s now compressed."""
    apply_quantization_config(root, qcfg, show_progress=False)
    validate_group_size_divisibility(root, set(targets), ignore)  # the error oneshot raises, with layer names
    modules = [(n, m) for n, m in match_named_modules(root, targets, ignore) if is_module_quantized(m)]
    only = [m for _, m in modules]
    for m in only:
        initialize_observer(m, base_name="weight")
        apply_calibration_status(m)
    fuse_weight_observers(root)
    observe(only, base_name="weight")
    update_qparams(only, base_name="weight")
    for m in only:
        freeze_module_quantization(m)
    for m in only:
        compress_module(m)
    return modules


def _non_layer_targets(
    model: nn.Module, layer_prefix: str, targets: Iterable[str], ignore: list[str]
) -> dict[str, str | None]:
    """{name: checkpoint key of the embedding table its weight is tied to, or None} for targeted non-layer modules."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_name = next((n for n, m in model.named_modules() if m is embeddings), None)
    out = {}
    for name, module in match_named_modules(model, targets, ignore):
        if name.startswith(layer_prefix):
            continue
        tied = embeddings is not None and getattr(module, "weight", None) is embeddings.weight
        out[name] = f"{embedding_name}.weight" if tied else None
    return out


def _compressed_qconfig(scheme: str, ignore: list[str], config: PretrainedConfig) -> tuple[QuantizationConfig, bool]:
    """The config oneshot's save derives from the quantized model, built on the meta skeleton instead.

    Also says whether oneshot would untie the embeddings (a tied lm_head that the scheme targets).
    """
    modifier = _modifier(scheme, ignore)
    model = _meta_skeleton(config)
    prefix, _ = _find_layers(model, config)
    unties = any(_non_layer_targets(model, prefix, modifier.resolved_targets, modifier.ignore).values())
    apply_quantization_config(model, modifier.resolved_config, show_progress=False)
    qcfg = ModelCompressor.from_pretrained_model(model).quantization_config
    qcfg.quantization_status = QuantizationStatus.COMPRESSED  # what compress_model sets before update_config
    return qcfg, unties


