"""One decoder layer's tensors in, compressed-tensors out: the child's quantization arithmetic.

This module owns the recipe that makes a layer quantized in isolation bit-identical to llm-compressor's
whole-model `oneshot` + `save_pretrained(save_compressed=True)` for data-free schemes, and the
`quantization_config` block that oneshot writes into config.json.

    config.json ─▶ meta skeleton (built once, MoE experts linearized) + the checkpoint name map (child/backends/naming.py)
    {name: tensor} of layer i ─▶ names mapped to the model's ─▶ deepcopy(meta layer i), load (assign=True);
                                  fused experts on disk (GPT-OSS) through the fused module, then linearized
        ─▶ rooted at its full path ("model.layers.i") so targets/ignore see the model's module names
        ─▶ apply_quantization_config ─▶ weight observers ─▶ fuse (NVFP4: q/k/v, gate/up share a
           global scale) ─▶ observe + update_qparams ─▶ freeze ─▶ compress_module
        ─▶ {name: CPU tensor}: every source tensor that feeds no quantized module, unchanged under its own name;
           each quantized module's compressed tensors under the checkpoint's name for it

All arithmetic and formats come from compressed-tensors / llm-compressor calls (the same ones oneshot
makes, in the same order); nothing here computes a scale by hand. MoE experts are linearized on the
meta skeleton the way oneshot's fallback does (llm-compressor's LinearExperts2D); checkpoint tensors reach
them through transformers' own conversion mapping (Mixtral's `w1/w3/w2` included), and the output keeps the
checkpoint's names, which is what transformers' converters expect when they load it (oneshot's do not:
docs/fidelity.md). Meta tensors in give meta tensors out: the output's names, shapes and dtypes without a
weight read (child/preview.py). Targeted Linear subclasses that compressed-tensors would write uncompressed
(Falcon's) are refused up front.

It must never import `supervisor` (the two meet only on the wire), never read or write files except
the config it is given and `write_config`'s destination, never change torch's thread count, and keep
no reference to a layer after returning its tensors (per-layer leaks are what this project exists
to avoid).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable

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
from llmcompressor.modifiers.quantization import QuantizationMixin, QuantizationModifier
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

from child.backends.data_free import DataFree
from child.backends import quant_error
from child.errors import Refused
from child.backends.naming import NameMap, find_decoder_layers
from child.staging import plain_to_host
from shared.job import DEFAULT_IGNORE as _JOB_DEFAULT_IGNORE
from shared.layout import SHARD_METADATA

__all__ = [
    "DEFAULT_IGNORE",
    "LayerQuantizer",
    "quantization_config_dict",
    "warm_up",
    "write_config",
]

# The default ignore list (lm_head, MoE routers, shared-expert gates) is part of the job schema: one copy, there.
DEFAULT_IGNORE: list[str] = list(_JOB_DEFAULT_IGNORE)


class LayerQuantizer(DataFree):
    """Quantizes one decoder layer (or the non-layer modules) at a time, exactly as `oneshot` would."""

    reads_to_device = True  # the read-ahead's page faults and copy overlap the previous layer's work
    previews = True  # meta tensors in, meta tensors out (child/preview.py)
    checks_loading = True

    def __init__(self, config_dir: str, scheme: str, ignore: list[str], device: str = "cpu",
                 modifier: QuantizationMixin | None = None, *, trust_remote_code: bool = False,
                 tensor_names: list[str] | None = None, to_host: Callable[[dict], dict] | None = None):
        """`modifier`: the calibrated recipe's quantization modifier (GPTQModifier's config carries its actorder);
        None builds the data-free QuantizationModifier oneshot would, refusing schemes that need data.
        `tensor_names`: the checkpoint's, for the names config.json's ignore list is written in.
        `to_host`: how the output reaches the host (a worker's pinned buffer: child/staging.py); default `.to("cpu")`."""
        self.scheme = scheme
        self.ignore = list(ignore)
        self.device = torch.device(device)
        self._modifier = modifier if modifier is not None else _modifier(scheme, self.ignore)
        self._targets = self._modifier.resolved_targets
        self._qcfg = self._modifier.resolved_config
        self.trust_remote_code = trust_remote_code
        self._to_host = to_host or plain_to_host
        self.tensor_names = tensor_names  # the checkpoint's tensor names: config.json's ignore list is written in them
        self.config = load_config(config_dir, trust_remote_code)
        self._skeleton, self._names, self._raw_experts = _meta_skeleton(self.config, trust_remote_code)
        prefix, layers = find_decoder_layers(self._skeleton, self.config)
        self.layer_prefix: str = prefix
        self.num_layers: int = len(layers)
        self._layers = layers
        self._probes: dict = {}  # compressed meta twins for previews (see _quantize_modules)
        self._compressed: dict[str, tuple] = {}  # config.json path -> (quantization config, unties), see write_config
        # targeted Linears outside the decoder layers (lm_head when it is not ignored)
        self._non_layer_targets = _non_layer_targets(self._skeleton, self.layer_prefix, self._targets, self.ignore)
        _refuse_uncompressible(self._skeleton, self._qcfg, self._targets, self.ignore)

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
        return tensors, dict(SHARD_METADATA)  # what transformers' save_pretrained writes into every shard

    def describe(self) -> str:
        return f"{type(self._skeleton).__name__} (transformers' model class, experts linearized as oneshot does)"

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        # the block is derived once per worker: the pre-export check and the finalize both write config.json, and
        # deriving it applies the scheme to every module of a meta model (0.75 s for a 6-layer, 64-expert MoE)
        if source_config_json not in self._compressed:
            self._compressed[source_config_json] = _compressed_qconfig(
                self._modifier, load_config(source_config_json, self.trust_remote_code), self.trust_remote_code,
                self.tensor_names)
        return write_config(source_config_json, dest_dir, self.scheme, self.ignore, self._modifier,
                            self.trust_remote_code, self.tensor_names, self._compressed[source_config_json])

    @property
    def non_layer_targets(self) -> list[str]:
        """Targeted modules outside the decoder layers (lm_head unless ignored)."""
        return sorted(self._non_layer_targets)

    def materialise(self, path: str, meta_module: nn.Module, tensors: dict[str, torch.Tensor],
                    device: torch.device) -> tuple[dict, nn.Module, nn.Module]:
        """(checkpoint name -> the model's name, the module at `path` loaded from checkpoint `tensors` on device, that
        module under empty parents named as in the model). Names map from the checkpoint's to the model's (Mixtral's
        block_sparse_moe.experts.N.w1 is mlp.experts.N.gate_proj in transformers' model; GPT-OSS stores its experts
        fused); the calibrated quantizer loads its layers the same way."""
        prefix = path + "."
        mapped = {k: self._names.to_model(k) for k in tensors}
        foreign = [k for k, m in mapped.items() if not m.key.startswith(prefix)]
        if foreign:
            raise ValueError(f"tensors outside {path}: {foreign[:5]}")
        direct = {m.key[len(prefix):]: tensors[k] for k, m in mapped.items() if m.fused is None}
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for k, m in mapped.items():
            if m.fused is not None:
                fused.setdefault(m.fused, {})[m.key[len(m.fused) + 1:]] = tensors[k]
        experts = {p[len(prefix):]: (self._raw_experts[p], params) for p, params in fused.items()}
        module = materialise(meta_module, direct, device, path, experts, self.config)
        return mapped, module, rooted(path, module)

    def _quantize_subtree(
        self, path: str, meta_module: nn.Module, tensors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Quantize the module at `path` from checkpoint tensors; the output keeps the checkpoint's names.

        Meta tensors in, meta tensors out (shapes and dtypes only): what `supervisor plan` and the pre-export loader
        check use to know the output without reading a weight."""
        device = torch.device("meta") if any(t.is_meta for t in tensors.values()) else self.device
        mapped, module, root = self.materialise(path, meta_module, tensors, device)
        with torch.no_grad():
            probes = self._probes if device.type == "meta" else None
            # the error of each module against its source weight, under the checkpoint's module name
            labels = _error_labels(root, mapped) if probes is None and quant_error.enabled else {}
            quantized = _quantize_modules(root, self._qcfg, self._targets, self.ignore, probes, labels, self.device)
            out = _assemble(root, tensors, mapped, {name for name, _ in quantized})
        del module, root, quantized
        if device.type == "meta":
            return out
        return self._to_host(out)


def warm_up() -> None:
    """What every LayerQuantizer does first whatever the checkpoint, done once in the warm parent (child.backends.backend
    preload) so that each forked worker inherits it: llm-compressor's MoE linearizer imports its registered
    classes (GPT-OSS's, transformers' gpt_oss model with it) on its first lookup, and transformers builds its whole
    table of checkpoint conversions (~730 renamings, a regex each) on its first lookup and keeps it for the
    process. 0.04-0.06 s here; a worker's LayerQuantizer took 0.2 s to build before and 0.08-0.1 s after on the
    development VM. Touches no device."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    LinearExperts2D.get_registration(nn.Module)  # the registry's imports; nn.Module itself is not registered
    get_checkpoint_conversion_mapping("")  # builds and keeps the table; no model type is ""


def quantization_config_dict(scheme: str, ignore: list[str], config: str, modifier: QuantizationMixin | None = None,
                             tensor_names: list[str] | None = None, trust_remote_code: bool = False) -> dict:
    """The `quantization_config` block oneshot writes for `scheme`/`ignore` on the model that `config` describes.

    `config` is the source config.json or its folder. The model's structure is needed because oneshot's block
    lists the unquantized Linear-like modules by name (e.g. every MoE router) rather than the ignore patterns;
    `tensor_names` (the checkpoint's) decide which of transformers' renamings those names are written back through.
    """
    qcfg, _ = _compressed_qconfig(modifier if modifier is not None else _modifier(scheme, ignore),
                                  load_config(config, trust_remote_code), trust_remote_code, tensor_names)
    if qcfg is None:
        return {}  # nothing targeted: oneshot writes no block
    # the same keys, in the same order, as ModelCompressor.update_config writes
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **qcfg.model_dump(exclude=["quant_method"]),
    }


def write_config(source_config_json: str, dest_dir: str, scheme: str, ignore: list[str],
                 modifier: QuantizationMixin | None = None, trust_remote_code: bool = False,
                 tensor_names: list[str] | None = None, compressed: tuple | None = None) -> str:
    """Write dest_dir/config.json: the source config plus the quantization_config block, as oneshot's save does.
    `compressed`: the (quantization config, unties) _compressed_qconfig returns for these arguments, if known."""
    with open(source_config_json) as f:
        source = json.load(f)
    qcfg, unties = compressed if compressed is not None else _compressed_qconfig(
        modifier if modifier is not None else _modifier(scheme, ignore),
        load_config(source_config_json, trust_remote_code), trust_remote_code, tensor_names)
    if unties:
        # oneshot unties a targeted tied head, and resave_config copies that into the original config
        text = source.get("text_config", source)
        text["tie_word_embeddings"] = False
    path = os.path.join(dest_dir, "config.json")
    # oneshot re-saves the *original* config.json (resave_config) and then lets update_config add the block
    with open(path, "w") as f:
        json.dump(source, f, indent=2, sort_keys=True)
    if qcfg is not None:
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


def load_config(config: str, trust_remote_code: bool = False) -> PretrainedConfig:
    folder = os.path.dirname(config) if os.path.isfile(config) else config
    if os.path.isfile(config) and os.path.basename(config) != "config.json":
        raise ValueError(f"expected a config.json or its folder, got {config}")
    return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)


def _meta_skeleton(config: PretrainedConfig, trust_remote_code: bool = False) -> tuple[nn.Module, NameMap, dict]:
    """The whole model on the meta device (no memory), MoE experts linearized as oneshot does; the checkpoint name
    map; and {path: the fused experts module as transformers builds it} for each linearized one."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    raw_keys = set(model.state_dict())
    raw_experts = linearize_meta_experts(model)
    names = NameMap.build(model, raw_keys, set(model.state_dict()), list(raw_experts))
    return model, names, raw_experts


def linearize_meta_experts(model: nn.Module) -> dict[str, nn.Module]:
    # llmcompressor's linearize_moe cannot run on meta (its offload copy rejects meta tensors), so build the
    # same LinearExperts2D directly on meta; weights come later from the checkpoint's per-expert tensors, or from
    # fused experts tensors through the original module (see materialise).
    raw = {}
    for name, experts in get_non_linearized_moes(model):
        cls = LinearExperts2D.get_linear_experts_cls(type(experts))
        with torch.device("meta"), skip_weights_initialize():
            linear = cls(getattr(experts, "config", model.config))
        model.set_submodule(name, linear)
        raw[name] = experts
    return raw


def materialise(
    meta_module: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device, path: str,
    fused: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] | None = None, config: PretrainedConfig | None = None,
) -> nn.Module:
    """A fresh real copy of meta_module holding `tensors` (keyed relative to it) on `device`.

    `fused` maps a linearized experts module (path relative to meta_module) to its original fused module (meta) and
    the checkpoint's fused tensors for it (GPT-OSS stores experts as 3D tensors): those are loaded into the fused
    module and copied per expert by llm-compressor's own LinearExperts2D, exactly as oneshot's linearize_moe does."""
    module = copy.deepcopy(meta_module)
    for rel, (raw, params) in (fused or {}).items():
        module.set_submodule(rel, _linearized(raw, params, type(module.get_submodule(rel)), device, path, config))
    owned = tuple(rel + "." for rel in fused or {})
    expected = {k for k in module.state_dict() if not k.startswith(owned)}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        moe = (" (MoE checkpoints whose expert tensors match neither transformers' conversion mapping nor the fused "
               "layout are not supported)")
        hint = moe if any(".experts." in k for k in missing + unexpected) else ""
        error = NotImplementedError if hint else ValueError
        raise error(f"{path}: tensors do not match the model's layout{hint}: missing {missing[:5]}, "
                    f"unexpected {unexpected[:5]}")
    # assign=True keeps the checkpoint's dtypes and puts the loaded tensors in place of the meta ones, so the
    # layer is never allocated twice (to_empty first would hold an empty copy beside the loaded one)
    module.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False, assign=True)
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_meta:
                # not in a checkpoint; data-free quantization never reads them (a calibrated skeleton has them real)
                sub._buffers[name] = torch.empty_like(buf, device=device)
            elif buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)
    return module


def _linearized(raw: nn.Module, params: dict[str, torch.Tensor], cls: type, device: torch.device, path: str,
                config: PretrainedConfig) -> nn.Module:
    """The fused experts module `raw` loaded with `params`, then linearized by LinearExperts2D's own per-expert copy
    (from_experts_module without its offload wrapper: the layer lives on one device here)."""
    experts = copy.deepcopy(raw)
    expected = set(experts.state_dict())
    if expected != set(params):
        raise NotImplementedError(f"{path}: fused experts tensors do not match {type(raw).__name__}: missing "
                                  f"{sorted(expected - set(params))[:5]}, "
                                  f"unexpected {sorted(set(params) - expected)[:5]}")
    experts.load_state_dict({k: v.to(device) for k, v in params.items()}, strict=True, assign=True)
    with torch.device(device), skip_weights_initialize():
        linear = cls(getattr(experts, "config", config))
    with torch.no_grad():
        for index in range(linear.num_experts):
            linear[index].copy_from_experts_module(experts, index)
    return linear


def _error_labels(root: nn.Module, mapped: dict) -> dict[str, str]:
    """{model module name: checkpoint module name} of the modules whose quantization error is measured.

    Each is measured against its own weight just before it is compressed (child/backends/quant_error.py): the checkpoint's
    tensor, already where the layer is (on the GPU for a GPU export), so the measurement reads nothing twice. A
    fused experts module has no per-expert source tensor: its linearized Linears (exact copies of the source's
    slices) are measured under their model names."""
    out = {}
    for key, m in mapped.items():
        if m.fused is None and key.endswith(".weight") and m.key.endswith(".weight"):
            out[m.key[: -len(".weight")]] = key[: -len(".weight")]
    for path in {m.fused for m in mapped.values() if m.fused is not None}:
        for name, sub in root.get_submodule(path).named_modules(prefix=path):
            if isinstance(sub, nn.Linear):
                out[name] = name
    return out


def _assemble(root: nn.Module, tensors: dict[str, torch.Tensor], mapped: dict, quantized: set[str]) -> dict:
    """The output tensors: every checkpoint tensor that feeds no quantized module, unchanged and under its own name;
    each quantized module's compressed state under its checkpoint name (the linearized name for fused experts)."""
    out, emitted = {}, set()
    for key, m in mapped.items():
        if m.fused is not None:
            if not any(q.startswith(m.fused + ".") for q in quantized):
                out[key] = tensors[key]  # nothing in these experts is quantized: keep the fused tensors as they are
            elif m.fused not in emitted:
                # as oneshot writes quantized fused experts: per expert, dense biases included
                emitted.add(m.fused)
                out.update(root.get_submodule(m.fused).state_dict(prefix=m.fused + "."))
            continue
        module = m.key.rsplit(".", 1)[0]
        if module not in quantized:
            out[key] = tensors[key]
        elif module not in emitted:
            emitted.add(module)
            name = key.rsplit(".", 1)[0]  # the checkpoint's name for this module
            out.update(root.get_submodule(module).state_dict(prefix=name + "."))
    return out


def rooted(path: str, module: nn.Module) -> nn.Module:
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
    root: nn.Module, qcfg: QuantizationConfig, targets: Iterable[str], ignore: list[str], probes: dict | None = None,
    labels: dict[str, str] | None = None, device: torch.device = torch.device("cpu"),
) -> list[tuple[str, nn.Module]]:
    """Run QuantizationModifier's data-free lifecycle on root; returns the (name, module)s now compressed.

    With `probes` (a cache kept across calls), root is on the meta device and only the output's names, shapes and
    dtypes matter: each targeted module is replaced by a compressed meta twin, computed once per (class, parameter
    shapes and dtypes, scheme). Quantizing a whole layer on meta is slow (every op runs through torch's Python
    reference kernels: 12 s for a 256-expert layer, measured) and compressed-tensors' meta path leaves W4A16_ASYM's
    zero point unpacked (int8 [rows, groups] where the real output holds int32 [rows / 8, groups])."""
    apply_quantization_config(root, qcfg, show_progress=False)
    validate_group_size_divisibility(root, set(targets), ignore)  # the error oneshot raises, with layer names
    modules = [(n, m) for n, m in match_named_modules(root, targets, ignore) if is_module_quantized(m)]
    if probes is not None:
        twins = []
        for name, m in modules:
            key = (type(m), repr(m.quantization_scheme),
                   tuple((k, tuple(v.shape), v.dtype) for k, v in m.named_parameters(recurse=False)))
            if key not in probes:
                probes[key] = _probe(m, device)
            root.set_submodule(name, probes[key])  # shared: meta tensors are never written
            twins.append((name, probes[key]))
        return twins
    _compress([m for _, m in modules], root, {m: labels[n] for n, m in modules if n in labels} if labels else None)
    return modules


def _probe(module: nn.Module, device: torch.device) -> nn.Module:
    """A compressed meta twin of a targeted meta module: the real lifecycle on random weights of its shapes, on the
    export's device (a GPU does an 8B MLP weight's in milliseconds; the host took 0.3 s). Only the twin's names,
    shapes and dtypes are kept, and they do not depend on the values or the device."""
    twin = copy.deepcopy(module).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in twin.parameters(recurse=False):
            if p.dtype in (torch.float32, torch.bfloat16, torch.float16):
                p.uniform_(-1.0, 1.0, generator=gen)  # in place: no float32 temporary of the weight's size
            elif p.is_floating_point():  # e.g. a zero point already in the scheme's float8 type
                p.copy_(torch.empty(p.shape, device=device).uniform_(-1.0, 1.0, generator=gen))
        _compress([twin], None)
    return twin.to("meta")


def _compress(modules: list[nn.Module], root: nn.Module | None, measured: dict[nn.Module, str] | None = None) -> None:
    """QuantizationModifier's data-free lifecycle on `modules`; each module in `measured` has its quantization error
    recorded under its label right after it is compressed, against its weight as it was just before."""
    for m in modules:
        initialize_observer(m, base_name="weight")
        apply_calibration_status(m)
    if root is not None:
        fuse_weight_observers(root)  # NVFP4: q/k/v and gate/up share one global scale (names and shapes unchanged)
    observe(modules, base_name="weight")
    update_qparams(modules, base_name="weight")
    for m in modules:
        freeze_module_quantization(m)
    for m in modules:
        source = m.weight if measured and m in measured else None
        compress_module(m)
        if source is not None:
            quant_error.record(measured[m], m, source)
        del source


def _refuse_uncompressible(model: nn.Module, qcfg: QuantizationConfig, targets: Iterable[str], ignore: list[str]):
    """Refuse targeted module classes that compressed-tensors would write uncompressed.

    It picks a compression format by exact module type (`type in COMPRESSIBLE_MODULE_TYPES`), so a subclass of
    nn.Linear (Falcon's FalconLinear) is written "dense": fake-quantized full-size weights with zero points and a
    config whose ignore list misses lm_head. oneshot writes the same; transformers then loads lm_head with a missing
    scale and drops the zero points (measured, docs/fidelity.md)."""
    from compressed_tensors.compressors.format import infer_module_format

    scheme = next(iter(qcfg.config_groups.values()))
    wanted = infer_module_format(nn.Linear, scheme)
    odd = sorted({type(m).__name__ for _, m in match_named_modules(model, targets, ignore)
                  if type(m) is not nn.Linear and infer_module_format(type(m), scheme) != wanted})
    if odd:
        raise Refused(f"compressed-tensors {compressed_tensors.__version__} would write {', '.join(odd)} uncompressed "
                      f"('dense' instead of '{wanted.value}': it picks formats by exact class and these subclass "
                      "torch.nn.Linear), and transformers would load the result wrong, as it does oneshot's; "
                      "see docs/fidelity.md")


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


def _compressed_qconfig(modifier: QuantizationMixin, config: PretrainedConfig, trust_remote_code: bool = False,
                        tensor_names: list[str] | None = None) -> tuple[QuantizationConfig, bool]:
    """The config oneshot's save derives from the quantized model, built on the meta skeleton instead.

    Also says whether oneshot would untie the embeddings (a tied lm_head that the scheme targets).
    """
    model, names, _ = _meta_skeleton(config, trust_remote_code)
    if tensor_names is not None:
        # what from_pretrained records on oneshot's model; compressed-tensors writes the ignore list through it
        model._weight_conversions = names.used(tensor_names)
    prefix, _ = find_decoder_layers(model, config)
    unties = any(_non_layer_targets(model, prefix, modifier.resolved_targets, modifier.ignore).values())
    apply_quantization_config(model, modifier.resolved_config, show_progress=False)
    qcfg = ModelCompressor.from_pretrained_model(model).quantization_config
    if qcfg is not None:  # None: nothing in this model is targeted (GPT-2's Conv1D); oneshot then writes no block
        qcfg.quantization_status = QuantizationStatus.COMPRESSED  # what compress_model sets before update_config
    return qcfg, unties


