"""A live model as the export's source (a job without `[source]`): what the child reads, named as on disk.

    Supervisor(job, model=live, tokenizer=tok)
      prepare:  describe(live)   names as live.save_pretrained() would write them (transformers' own tied-weight
                                 removal and weight-conversion revert), PEFT LoRA pairs, refusals, a structure hash
      start:    offload.release(live, share_host=True) ─▶ every tensor in the PinnedPool (memfds)
                manifest(live, pool) ─▶ Pool(fds, {name: chunk, offset, dtype, shape, stride}, LoRA pairs)
                write_config_dir  ─▶ OUT/.export/source: config.json, generation_config.json, tokenizer files
      resume:   part_digest(...) of each journaled part, compared with the digest the child recorded

A PEFT-wrapped model (one active LoRA adapter, unmerged) is exported as `merge_and_unload()` + `save_pretrained`
would write it: `X.base_layer.weight` is named `X.weight` and its pair (the live tensors and scaling) goes to the
child, which merges it with PEFT's code (child/sources/adapter.py). A PEFT model over a quantized base (QLoRA) is not
exported from here but from its 16-bit checkpoint plus its pairs (supervisor/live/qlora.py, which uses the PEFT helpers
below). Owns naming and describing the live model; it never moves it (supervisor/live/offload.py does) and never copies
a weight.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from shared import tensor_names
from shared.durable import tensor_digest
from shared.lora import FIX_QUANTIZED, unsupported
from shared.messages import NON_LAYER, Pool, PoolLora, PoolTensor
from supervisor.errors import SourceError
from supervisor.checks.source import SourceInfo, find_layers

CONFIG_DIR = "source"  # under OUT/.export: the live model's config, generation config and tokenizer


@dataclass
class Saved:
    """The live model as save_pretrained() would write it: names, and where each tensor lives in the model."""

    inner: nn.Module  # the transformers model (inside a PEFT wrapper, if any)
    paths: dict[str, str]  # checkpoint name -> the tensor's attribute path in `inner`
    loras: dict[str, tuple[str, str, float]] = field(default_factory=dict)  # weight -> (A path, B path, scaling)
    # path -> the host tensor an accelerate hook holds for a CPU-offloaded (meta) parameter; found while the hooks
    # are attached (the release detaches them), and the same object after it (the release swaps its storage)
    offloaded: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """checkpoint name -> the model's own tensor, looked up now (after a release: its view in the pool)."""
        return {name: self.lookup(path) for name, path in self.paths.items()}

    def pair(self, weight: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        a, b, scaling = self.loras[weight]
        return self.lookup(a), self.lookup(b), scaling

    def lookup(self, path: str) -> torch.Tensor:
        if path in self.offloaded:
            return self.offloaded[path]
        module, _, attr = path.rpartition(".")
        return getattr(self.inner.get_submodule(module), attr)


def saved_state(model: nn.Module) -> Saved:
    """Names of `model`'s tensors as its save_pretrained (merged first, for PEFT) would write them, computed with
    transformers' own tied-weight removal and weight-conversion revert. Call it before the release: both look at
    storages, and after a release every tensor is a view of one pool chunk."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    inner, adapter = unwrap_peft(model)
    state = inner.state_dict(keep_vars=True)
    path_of = {id(t): key for key, t in state.items()}
    loras, renames = lora_layers(inner, adapter) if adapter is not None else ({}, {})
    for old, new in renames.items():
        for key in [k for k in state if k.startswith(old)]:
            state[new + key[len(old):]] = state.pop(key)
    for key in [k for k in state if ".lora_" in k]:
        del state[key]  # the adapter's own tensors travel as pairs, not as checkpoint tensors
    for key in getattr(inner, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, inner)
    state = revert_weight_conversion(inner, state)
    paths = {}
    for name, t in state.items():
        if id(t) not in path_of:
            raise SourceError(f"the live model's {name} is computed from its weights when saved (a weight "
                              "conversion): such a model is not exported from memory yet; save it and export the "
                              "checkpoint instead")
        paths[name] = path_of[id(t)]
    lora_paths = {p for a, b, _ in loras.values() for p in (a, b)}
    return Saved(inner, paths, loras, _offloaded(inner, set(paths.values()) | lora_paths))


def _offloaded(inner: nn.Module, paths: set[str]) -> dict[str, torch.Tensor]:
    from supervisor.live.offload import offloaded_value

    out = {}
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        module = inner.get_submodule(module_name)
        if getattr(module, attr).is_meta:
            value = offloaded_value(module, attr)
            if value is not None:
                out[path] = value
    return out


def unwrap_peft(model: nn.Module, quantized: bool = False) -> tuple[nn.Module, str | None]:
    peft_config = getattr(model, "peft_config", None)
    base = getattr(model, "base_model", None)
    if not isinstance(peft_config, dict) or base is None or not hasattr(base, "model"):
        return model, None
    active = list(model.active_adapters)
    if len(active) != 1:
        raise SourceError(f"the live PEFT model has {len(active)} active adapters ({active}); set one with "
                          "set_adapter() before exporting")
    cfg = peft_config[active[0]]
    problem = unsupported({k: getattr(v, "value", v) for k, v in cfg.to_dict().items()},
                          **({"fix": FIX_QUANTIZED} if quantized else {}))
    if problem:
        raise SourceError(problem)
    return base.model, active[0]


def lora_layers(inner: nn.Module, adapter: str, quantized: bool = False) -> tuple[dict, dict[str, str]]:
    """The active adapter's unmerged pairs {"<module>.weight": (A path, B path, scaling)} and the renames of the
    PEFT-wrapped modules. `quantized`: the base is quantized (supervisor/live/qlora.py), so a base Linear may be a
    subclass (bnb Linear4bit/Linear8bitLt) and an adapter merged into it is refused (its exact pair is gone)."""
    loras, renames = {}, {}
    for name, module in inner.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "base_layer")):
            continue
        renames[f"{name}.base_layer."] = f"{name}."
        if adapter not in module.lora_A:
            continue  # not targeted by the active adapter
        base = module.get_base_layer()
        if adapter in getattr(module, "merged_adapters", ()):
            if quantized:
                raise SourceError(f"the live adapter is merged into the quantized weights of {name} "
                                  f"({type(base).__name__}), so its exact LoRA pair is gone; unmerge it "
                                  "(model.unmerge_adapter()) before exporting")
            continue  # already merged into the (16-bit) base weight, which is exported as it is
        odd = [what for what, bad in (("DoRA", module.use_dora.get(adapter)),
                                      ("a LoRA bias", module.lora_bias.get(adapter)),
                                      ("fan_in_fan_out", getattr(module, "fan_in_fan_out", False)),
                                      ("a LoRA variant", adapter in getattr(module, "lora_variant", {})))
               if bad]
        plain = type(getattr(base, "weight", None)) in (torch.Tensor, nn.Parameter)
        if odd or not isinstance(base, nn.Linear) or (type(base) is not nn.Linear and plain and not quantized):
            kind = ", ".join(odd) or type(base).__name__
            fix = FIX_QUANTIZED if quantized else "merge it with merge_and_unload() before exporting"
            raise SourceError(f"the live adapter on {name} ({kind}) cannot be merged exactly per layer; {fix}")
        if not plain and not quantized:
            # a quantized Linear (bnb Linear4bit, ...): merging into it loses the LoRA's precision, quantizes twice
            raise SourceError(f"the live adapter on {name} sits on a quantized {type(base).__name__}: pass "
                              "[source] path = \"<the 16-bit checkpoint the model was loaded from>\" and its LoRA "
                              "pairs are merged over that from memory (not merge_and_unload(): merging into "
                              "quantized weights loses the LoRA's precision)")
        loras[f"{name}.weight"] = (f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight",
                                   float(module.scaling[adapter]))
    return loras, renames


def describe(saved: Saved, config_dir: str) -> tuple[SourceInfo, dict]:
    """The SourceInfo the run plans with, and the structure part of the fingerprint (names, dtypes, shapes,
    config, LoRA pairs); the contents are checked per part with digests instead (hashing a whole model at every
    start would cost a minute on a 70B)."""
    tensors = saved.tensors
    for name, t in tensors.items():
        if t.device.type in ("meta",) or not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, nn.Parameter):
            raise SourceError(f"{name} of the live model is not a plain tensor in memory ({type(t).__name__} on "
                              f"{t.device}); a live model with disk-offloaded or quantized weights cannot be exported")
    config = json.loads(_config_copy(saved).to_json_string())
    names = sorted(tensors)
    prefix, num_layers = find_layers(names, config, "the live model")
    structure = {
        "tensors": [[n, dtype_name(tensors[n]), list(tensors[n].shape)] for n in names],
        "loras": [[w, dtype_name(a), list(a.shape), dtype_name(b), list(b.shape), s]
                  for w, a, b, s in ((w, *saved.pair(w)) for w in sorted(saved.loras))],
        "config": config,
    }
    blob = hashlib.sha256(json.dumps(structure, sort_keys=True).encode()).hexdigest()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    info = SourceInfo(path=config_dir, config=config, files=[], tensor_names=names, layer_prefix=prefix,
                      num_layers=num_layers, nbytes=nbytes, stats=[])
    return info, {"live_model": blob}


def write_config_dir(saved: Saved, tokenizer, dest: str) -> None:
    """config.json and generation_config.json as save_pretrained writes them, and the tokenizer's files."""
    os.makedirs(dest, exist_ok=True)
    _config_copy(saved).save_pretrained(dest)
    inner = saved.inner
    if getattr(inner, "can_generate", lambda: False)() and getattr(inner, "generation_config", None) is not None:
        inner.generation_config.save_pretrained(dest)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)


def _config_copy(saved: Saved):
    # save_pretrained sets these two on the live config before writing it; do it on a copy (the model stays as is)
    config = copy.deepcopy(saved.inner.config)
    config.dtype = str(_model_dtype(saved)).split(".")[1]
    config.architectures = [type(saved.inner).__name__]
    return config


def _model_dtype(saved: Saved) -> torch.dtype:
    # transformers' model.dtype: the first floating-point parameter (LoRA parameters are not part of the merged model)
    for name, p in saved.inner.named_parameters():
        if p.is_floating_point() and ".lora_" not in name:
            return p.dtype
    return torch.get_default_dtype()


def manifest(saved: Saved, pool, config_dir: str) -> Pool:
    """Where each tensor lives in the pool (after release(share_host=True)); refuses one that is not there."""
    return pool_message(pool, saved.tensors, {w: saved.pair(w) for w in saved.loras}, config_dir)


def pool_message(pool, tensors: dict[str, torch.Tensor], pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                 config_dir: str) -> Pool:
    """The Pool a child maps: where each of `tensors` and each LoRA pair (weight -> A, B, scaling) lives in `pool`."""
    entries = [pool_entry(name, t, pool) for name, t in sorted(tensors.items())]
    loras = [PoolLora(weight=w, a=pool_entry(a_name, a, pool), b=pool_entry(b_name, b, pool), scaling=s)
             for w, (a, b, s) in sorted(pairs.items()) for a_name, b_name in [pair_names(w)]]
    shared = pool.shared()
    return Pool(fds=[fd for fd, _ in shared], sizes=[n for _, n in shared], tensors=entries, loras=loras,
                config_dir=config_dir)


def pair_names(weight: str) -> tuple[str, str]:
    """The names a LoRA pair of `weight` travels under (pool entries, digests): <module>.lora_A/B.weight."""
    stem = weight[: -len("weight")]
    return stem + "lora_A.weight", stem + "lora_B.weight"


def pool_entry(name: str, t: torch.Tensor, pool) -> PoolTensor:
    where = pool.locate(t)
    if where is None:
        raise SourceError(f"{name} of the live model is not in the released memory (a weight conversion made a new "
                          "tensor for it); export this model from a checkpoint instead")
    return PoolTensor(name=name, chunk=where[0], offset=where[1], dtype=dtype_name(t), shape=list(t.shape),
                      stride=list(t.stride()))


def part_names(names: list[str], prefix: str, index: int, num_layers: int) -> list[str]:
    """The checkpoint names of part `index` (NON_LAYER: everything outside decoder layers 0..num_layers-1), by the
    rule the child reads them with (shared/tensor_names.py)."""
    if index == NON_LAYER:
        return tensor_names.non_layer_names(names, prefix, num_layers)
    return tensor_names.layer_names(names, prefix, index)


def part_digest(saved: Saved, names: list[str]) -> str:
    """The digest the child computes for these names (child/sources/live.py): same tensors, same bytes."""
    items = [(n, saved.lookup(saved.paths[n])) for n in names]  # this part's tensors only, not the whole map
    items += pair_items(names, {n: saved.pair(n) for n in names if n in saved.loras})
    return digest(items)


def pair_items(names: list[str], pairs: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the LoRA pairs (weight -> (A, B, ...)) of the weights among `names`, as digests list them."""
    return [(pn, t) for n in names if n in pairs for pn, t in zip(pair_names(n), pairs[n][:2])]


def digest(items) -> str:
    """The digest of (name, tensor) items, as the child computes it from the pool (shared.durable.tensor_digest)."""
    return tensor_digest((n, dtype_name(t), list(t.shape), _raw(t)) for n, t in items)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
