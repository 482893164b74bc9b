"""The torchao Backend: one part's nn.Linear weights quantized with `torchao.quantization.quantize_`, shards in
torchao's safetensors layout, and the `quantization_config` transformers' `TorchAoConfig` writes.

    config.json ─▶ meta skeleton (built once) ─▶ every nn.Linear: its full name, shape, bias; ignored or not
    {name: tensor} of part i ─▶ for each quantized Linear whose weight is in the part:
                                    nn.Linear holding that weight ─▶ quantize_(linear, config) ─▶ its weight
                                everything else passes through unchanged
        ─▶ serialize: flatten_tensor_state_dict ─▶ {name: plain tensor}
                      metadata: EVERY tensor's entry of the checkpoint (predicted at start-up, below; this part's
                      own entries must equal torchao's for its tensors) + "tensor_names": the GLOBAL list
                      + "format": "pt"

Why per Linear: transformers' torchao path quantizes exactly the nn.Linear weights not in
`modules_to_not_convert`, each by its own `quantize_(module, config)` call as it loads (TorchAoQuantize); no
scheme here shares anything across modules. The same call on the same tensor gives the same bits, so a part
quantized here equals the whole-model `from_pretrained(src, quantization_config=TorchAoConfig(cfg))` output.

Why the global list: transformers merges every shard's metadata with dict.update and unflattens each tensor
with the merged "tensor_names"; a shard carrying only its own names would leave the others unloaded (measured,
DESIGN.md). The list is the checkpoint's tensor names (quantization keeps each logical name).

Why every entry in every shard: vLLM (0.32, `safetensors_weights_iterator`) unflattens file by file with that
file's own metadata, and torchao's `unflatten_tensor_state_dict` reads the entry of every name in "tensor_names"
(another shard's tensors wait, as leftovers, for their data). transformers' own save_pretrained writes the same
whole-model metadata into every shard. A shard is written before later layers exist, so the entries are
predicted at start-up: an entry (`_type`, `_data`: block_size, the weight's dtype, the activation kwargs...,
`_tensor_data_names`) depends only on the config, the weight's shape and dtype, never on its values, so
`quantize_` on a meta-device Linear of that shape and dtype gives it (measured equal for every CPU scheme; where
torchao refuses meta, a zero weight on the job's device). `serialize` checks each part's own entries against the
prediction and refuses a shard where they differ, so a wrong prediction can never be written.

The ignore list: ours has llm-compressor's semantics (a module name, a class name, or "re:" + a regex matched
from the start of the name); transformers and vLLM match `modules_to_not_convert` differently (see
`modules_to_not_convert` below). So config.json lists the ignored Linear modules by full name, as oneshot's
compressed-tensors config does, and the child quantizes exactly the modules that list leaves to transformers.

MoE: transformers 5.17 stores experts fused (3D parameters, not nn.Linear) and its torchao path leaves them
dense; vLLM's torchao loader refuses an MoE without a per-module config. A layer whose checkpoint tensors the
model holds under other names (fused experts) is refused, naming the module.

It must never import `supervisor`, never read files except the config it is given, never write except
`write_config`'s destination, and keep no reference to a part's tensors after returning them.
"""
from __future__ import annotations

import json
import os
import re

import torch
from torch import nn
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import quantize_
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, TorchAoConfig
from transformers.quantizers.quantizers_utils import should_convert_module

from child.backends.data_free import DataFree
from child.backends.naming import find_decoder_layers
from shared import torchao_schemes


class TorchaoBackend(DataFree):
    """Quantizes one decoder layer (or the non-layer tensors) at a time, as transformers' torchao path would."""

    reads_to_device = True  # the read-ahead's page faults and copy overlap the previous layer's work
    previews = False  # torchao's tensor subclasses are not predicted on meta: `supervisor plan` lists no parts
    checks_loading = False  # the meta loader check (child/loadcheck.py) covers compressed-tensors outputs only

    def __init__(self, config_dir: str, scheme: str, keywords: dict, ignore: list[str], *, device: str = "cpu",
                 source_meta: dict[str, torch.Tensor]):
        """`source_meta`: every tensor of the checkpoint on the meta device (Source.meta of all its names): the
        global name list and the shapes and dtypes every shard's metadata entries are predicted from."""
        self.scheme = scheme
        self.ignore = list(ignore)
        self.config = torchao_schemes.build(scheme, keywords)
        self.device = torch.device(device)
        _check_device(scheme, self.device)
        model_config = _load_config(config_dir)
        self._skeleton = _meta_skeleton(model_config)
        prefix, layers = find_decoder_layers(self._skeleton, model_config)
        self.layer_prefix: str = prefix
        self.num_layers: int = len(layers)
        linears = {n: m for n, m in self._skeleton.named_modules() if isinstance(m, nn.Linear)}
        ignored = [n for n, m in linears.items() if _ignored(n, m, ignore)]
        # transformers adds the model class's _keep_in_fp32_modules to the modules it does not convert (whatever
        # config.json says), so a loader of this checkpoint expects them dense too
        keep = sorted(getattr(self._skeleton, "_keep_in_fp32_modules", None) or [])
        self._quantized = {n: m for n, m in linears.items()
                           if n not in set(ignored) and (not keep or should_convert_module(f"{n}.weight", keep))}
        self.modules_to_not_convert = modules_to_not_convert(ignored, list(self._quantized))
        self._held = set(self._skeleton.state_dict())
        self._metadata = self._predict_metadata(source_meta)

    def describe(self) -> str:
        return f"{type(self._skeleton).__name__} (transformers' model class), torchao quantize_ per Linear"

    def quantize_layer(self, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors with each quantized Linear's weight replaced by its torchao tensor."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} does not exist: the model has {self.num_layers} layers")
        self._refuse_converted(tensors)
        return self._quantize(tensors)

    def quantize_non_layer(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Embeddings and norms pass through; a Linear outside the layers (lm_head) is quantized unless ignored.
        A tied lm_head has no tensor of its own, so it stays the (dense) embedding, as in transformers."""
        return self._quantize(tensors)

    def serialize(self, tensors: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        flat, own = flatten_tensor_state_dict(tensors)
        for name in sorted(own.keys() - {"tensor_names"}):
            predicted = self._metadata.get(name)
            if predicted is None:
                raise RuntimeError(f"{name} is not a tensor of the source checkpoint, so no shard's metadata lists it")
            if own[name] != predicted:
                raise RuntimeError(f"{name}: torchao's metadata entry {own[name]} differs from {predicted}, the one "
                                   "predicted at start-up for every shard; the shard is not written (a bug of ours)")
        return {k: v.to("cpu").contiguous() for k, v in flat.items()}, dict(self._metadata)

    def _predict_metadata(self, source_meta: dict[str, torch.Tensor]) -> dict[str, str]:
        """Every shard's metadata: torchao's entry of each tensor of the checkpoint, as flatten_tensor_state_dict
        writes it, from a quantize_ of a weight of the same shape and dtype (one per kind), and plain tensors as
        they are; "tensor_names" the sorted global list, "format": "pt" as transformers writes."""
        kinds: dict[tuple, torch.Tensor] = {}
        predicted = {}
        for name in sorted(source_meta):
            t = source_meta[name]
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in self._quantized:
                key = (tuple(t.shape), t.dtype)
                if key not in kinds:
                    kinds[key] = self._predict_weight(module, t)
                t = kinds[key]
            predicted[name] = t
        _, metadata = flatten_tensor_state_dict(predicted)
        metadata["tensor_names"] = json.dumps(sorted(source_meta))
        metadata["format"] = "pt"  # what transformers' save_pretrained writes into every shard
        return metadata

    def _predict_weight(self, module: str, weight: torch.Tensor) -> torch.Tensor:
        """The torchao tensor quantize_ makes of a weight like `weight` (shape, dtype): on the meta device, or,
        where torchao refuses meta (CUDA-only paths may), of zeros on the job's device."""
        try:
            return self._quantize_weight(module, torch.empty_like(weight, device="meta"), device=torch.device("meta"))
        except Exception:  # noqa: BLE001 - any refusal on meta: quantize real zeros instead, as the layers will be
            zeros = torch.zeros(weight.shape, dtype=weight.dtype, device=self.device)
            return self._quantize_weight(module, zeros)

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        with open(source_config_json) as f:
            config = json.load(f)
        config["quantization_config"] = self.quantization_config()
        path = os.path.join(dest_dir, "config.json")
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        return path

    def quantization_config(self) -> dict:
        """config.json's quantization_config: what TorchAoConfig(...).to_dict() writes."""
        return TorchAoConfig(self.config, modules_to_not_convert=self.modules_to_not_convert).to_dict()

    def _quantize(self, tensors: dict[str, torch.Tensor]) -> dict:
        out = dict(tensors)
        for name, value in tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in self._quantized:
                out[name] = self._quantize_weight(module, value)
        return out

    def _quantize_weight(self, name: str, weight: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        # w: [out, in]. The same module type and call transformers' TorchAoQuantize makes (quantize_ on the
        # nn.Linear itself, default filter); the bias is not touched by any scheme, so it is not needed here.
        meta = self._quantized[name]
        if tuple(weight.shape) != (meta.out_features, meta.in_features):
            raise ValueError(f"{name}.weight has shape {tuple(weight.shape)}, the model expects "
                             f"{(meta.out_features, meta.in_features)}")
        with torch.device("meta"):
            linear = nn.Linear(meta.in_features, meta.out_features, bias=False)
        linear.weight = nn.Parameter(weight.to(device or self.device), requires_grad=False)
        with torch.no_grad():
            quantize_(linear, self.config)
        return linear.weight.detach()

    def _refuse_converted(self, tensors: dict) -> None:
        """Refuse checkpoint tensors the model holds under other names (fused MoE experts): transformers converts
        them on load, and its torchao path would leave them dense."""
        for name in sorted(tensors):
            if name in self._held:
                continue
            owner = _owner(self._skeleton, name)
            if owner is not None and any(True for _ in owner[1].parameters(recurse=False)):
                raise NotImplementedError(
                    f"{owner[0]} ({type(owner[1]).__name__}) stores its weights fused, while the checkpoint has "
                    f"{name}; transformers' torchao path leaves such MoE experts unquantized and vLLM's torchao "
                    "loader refuses them: export this model with format = \"compressed-tensors\"")


def modules_to_not_convert(ignored: list[str], quantized: list[str]) -> list[str]:
    """transformers' `modules_to_not_convert` for the Linear modules `ignored` (full names), given the Linear
    modules that must stay `quantized`.

    transformers (should_convert_module) skips a parameter when a key regex-matches the start of its name, with
    or without a following ".", or is a suffix of it; vLLM (should_skip) when a key equals the module name or
    is one of its dotted segments. A full module name works in both, except where it is a prefix of a quantized
    module's name ("mlp.gate" of "mlp.gate_proj"): transformers would skip that one too, so such a name is
    written as an exact regex instead (transformers then matches exactly; vLLM does not read regexes)."""
    out = []
    for name in sorted(ignored):
        if all(should_convert_module(f"{q}.weight", [name]) for q in quantized):
            out.append(name)
        else:
            out.append(re.escape(name) + r"(?=\.|$)")
    return out


def _check_device(scheme: str, device: torch.device) -> None:
    """Refuse at start-up what torchao would refuse at every layer (the supervisor checks the CPU case before
    anything is written; the GPU's compute capability is only known here, where CUDA is initialised)."""
    needs = torchao_schemes.SCHEMES[scheme].gpu_only
    if needs and device.type == "cpu":
        raise ValueError(f"scheme {scheme} {needs}")
    if scheme == "Float8DynamicActivationFloat8Weight" and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"scheme {scheme} {needs}; {device} has compute capability {major}.{minor}")


def _ignored(name: str, module: nn.Module, ignore: list[str]) -> bool:
    # llm-compressor's ignore semantics (compressed_tensors.utils.match: match_name, _match_class), written out
    # because importing compressed-tensors costs ~5 s in a worker that does not otherwise need it (measured).
    for target in ignore:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif target == name or any(target == cls.__name__ for cls in type(module).__mro__
                                   if issubclass(cls, nn.Module)):
            return True
    return False


def _owner(model: nn.Module, tensor_name: str) -> tuple[str, nn.Module] | None:
    """The deepest module of `model` whose name prefixes `tensor_name`."""
    parts = tensor_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:cut])
        try:
            return path, model.get_submodule(path)
        except AttributeError:
            continue
    return None


def _load_config(config_dir: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(config_dir, trust_remote_code=False)


def _meta_skeleton(config: PretrainedConfig) -> nn.Module:
    """The whole model on the meta device: module names, Linear shapes, and the names it holds."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
