"""A live PEFT model over a quantized base (QLoRA): exported from its 16-bit checkpoint plus its LoRA pairs in memory.

A studio that loads in 4 bits (bitsandbytes nf4) trains a LoRA on that quantized base; the 16-bit base weights are
in no memory, and merging the LoRA into the 4-bit weights (merge_and_unload) would lose its precision and then
quantize twice. So such a model is exported as `PeftModel.from_pretrained(<16-bit base>, <its adapter>)
.merge_and_unload()` would be: the 16-bit checkpoint on disk, with the live model's own LoRA pairs merged over it
per layer (no adapter saved, no merge into 4 bits).

    Supervisor(job, model=qlora)
      prepare:  quantized_base(model)      a PEFT model with a non-plain (tensor subclass) weight in its base
                plan(job, model)           the pairs of the active adapter (names, A/B paths, scaling); the base:
                                           [source] path, else the local folder the model names
                                           (base_model_name_or_path, then config._name_or_path)
                check(lora, source)        the base's config.json is the live model's (quantization, dtype and
                                           name aside) and every pair fits its weight; the fingerprint's part
      start:    share(lora, PinnedPool)    the A/B tensors copied into a small memfd pool ─▶ Hello.pool (LoRA
                                           pairs only); then the 4-bit model is released as for any [source] job
      child:    Merged(Checkpoint(path), pool pairs): PEFT's merge, the pair upcast as from_pretrained does
      resume:   Shared.digest(names)       a part's pairs' bytes ("" for a part without pairs), against the
                                           journal's record: a changed adapter is redone, never mixed in

A job with `[source] adapter` is left alone: the adapter folder it names is what is merged (the live model is only
released), as for any model. Owns the decisions and checks above and the copy of the pairs; the merge is the
child's (child/adapter.py), the release offload.py's.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import msgspec
import torch
from torch import nn

from shared.job import Job, Source
from shared.messages import Pool
from supervisor import live
from supervisor.errors import SourceError
from supervisor.source import SourceInfo

# config.json fields that differ between the 16-bit base and the same model loaded quantized or trained
_CONFIG_IGNORED = {"quantization_config", "dtype", "torch_dtype", "transformers_version", "use_cache", "architectures"}
_PLAIN = (torch.Tensor, nn.Parameter)
_SET_PATH = 'set [source] path = "<the 16-bit checkpoint the live model was loaded from>" in the job'


@dataclass
class LiveLora:
    """The live model's pairs (a live.Saved with no checkpoint tensors) and where its base came from."""

    saved: live.Saved
    quantized: str  # the type of a quantized base weight, for messages (Params4bit, Int8Params, ...)
    found_by: str = ""  # "": [source] path was given; else the attribute that named the discovered folder


def quantized_base(model: nn.Module) -> str | None:
    """The type name of a quantized (tensor subclass) weight in the base of a PEFT-wrapped `model`, or None (not
    PEFT, or a plain base)."""
    peft_config, base = getattr(model, "peft_config", None), getattr(model, "base_model", None)
    if not isinstance(peft_config, dict) or base is None or not hasattr(base, "model"):
        return None
    return quantized(base.model)


def quantized(model: nn.Module) -> str | None:
    """The type name of the first quantized (tensor subclass) parameter or buffer of `model` (LoRA's aside)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if ".lora_" not in name and type(t) not in _PLAIN:
            return type(t).__name__
    return None


def plan(job: Job, model: nn.Module) -> tuple[Job, LiveLora]:
    """The job to run (with [source] path set to the discovered base when it had no [source]) and the live pairs;
    raises SourceError with a one-line message. Reads the model's names only, never its tensors."""
    quantized = quantized_base(model)
    inner, adapter = live.unwrap_peft(model, quantized=True)
    loras, _ = live.lora_layers(inner, adapter, quantized=True)
    lora = LiveLora(live.Saved(inner, {}, loras), quantized)
    if job.source is None:
        path, lora.found_by = _discover(model, inner, adapter, quantized)
        job = msgspec.structs.replace(job, source=Source(path=path))
    return job, lora


def _discover(model: nn.Module, inner: nn.Module, adapter: str, quantized: str) -> tuple[str, str]:
    named = [("base_model_name_or_path", getattr(model.peft_config[adapter], "base_model_name_or_path", None)),
             ("config._name_or_path", getattr(inner.config, "_name_or_path", None))]
    named = [(attr, name) for attr, name in named if name]
    for attr, name in named:
        if os.path.isfile(os.path.join(name, "config.json")):
            return os.path.abspath(name), attr
    what = f"names {named[0][1]!r}, which is not a local checkpoint folder" if named else "names no base checkpoint"
    raise SourceError(f"the live model is a PEFT model over a quantized base ({quantized}), whose 16-bit weights "
                      f"are not in memory, and it {what}; {_SET_PATH} (its LoRA pairs are merged over that from "
                      "memory)")


def check(lora: LiveLora, source: SourceInfo) -> dict:
    """The base checkpoint is the live model's (config.json) and each pair fits its weight; returns the fingerprint's
    part for the pairs (names, dtypes, shapes, scaling: their bytes are checked per part, see Shared.digest)."""
    where = (f"[source] path {source.path!r}" if not lora.found_by else
             f"the folder the live model names ({source.path!r}, its {lora.found_by})")
    fix = ("point it at the 16-bit checkpoint the live model was loaded from" if not lora.found_by else _SET_PATH)
    diff = _config_difference(lora.saved.inner.config, source.path)
    if diff:
        raise SourceError(f"{where} is not the live model's base: {diff}; {fix}")
    from supervisor.adapter import base_shapes

    shapes = base_shapes(source.path, source.files)
    rows = []
    for weight in sorted(lora.saved.loras):
        a, b, scaling = lora.saved.pair(weight)
        shape = shapes.get(weight)
        if shape is None:
            raise SourceError(f"{where} has no {weight}, which the live adapter targets; {fix}")
        if len(shape) != 2 or list(a.shape) != [a.shape[0], shape[1]] or list(b.shape) != [shape[0], a.shape[0]]:
            raise SourceError(f"the live adapter's pair on {weight} (A{list(a.shape)} B{list(b.shape)}) does not fit "
                              f"{weight} {shape} of {where}; {fix}")
        rows.append([weight, live.dtype_name(a), list(a.shape), live.dtype_name(b), list(b.shape), scaling])
    return {"live_lora": hashlib.sha256(json.dumps(rows).encode()).hexdigest()}


def _config_difference(config, folder: str) -> str:
    """'' when the checkpoint's config is the live model's config (fields in _CONFIG_IGNORED and private ones
    aside), else the first field that differs."""
    try:
        disk = type(config).from_pretrained(folder).to_dict()
    except Exception as exc:  # transformers' own refusal, whatever it raises
        return f"its config.json cannot be read as a {type(config).__name__} ({str(exc).splitlines()[0]})"
    mine = config.to_dict()
    for key in sorted(set(disk) | set(mine)):
        if key in _CONFIG_IGNORED or key.startswith("_"):
            continue
        if disk.get(key) != mine.get(key):
            return f"its config.json has {key} = {disk.get(key)!r}, the live model {mine.get(key)!r}"
    return ""


class Shared:
    """The live pairs copied into a pool a child maps (share()): the Hello's Pool, and the digest of a part."""

    def __init__(self, spec: Pool, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.spec, self.pairs = spec, pairs

    def touches(self, names: list[str]) -> bool:
        return any(n in self.pairs for n in names)

    def digest(self, names: list[str]) -> str:
        """What the child's PoolSource.pairs_digest computes for these names: their pairs' bytes; "" for none."""
        items = live.pair_items(names, self.pairs)
        return live.digest(items) if items else ""


def share(lora: LiveLora, pool, config_dir: str) -> Shared:
    """Copy the live pairs (wherever they are: GPU or host) into `pool` (a PinnedPool of their own; it stays leased
    until end_lease()); the child maps it. Called before the model's release, so a failed copy changes nothing."""
    pairs = {w: lora.saved.pair(w) for w in sorted(lora.saved.loras)}
    flat = [t for a, b, _ in pairs.values() for t in (a, b)]
    views = pool.lease([t.numel() * t.element_size() for t in flat])
    hosts = []
    with torch.no_grad():
        for view, t in zip(views, flat):
            host = view.view(t.dtype).view(t.shape)
            host.copy_(t.detach())
            hosts.append(host)
    copies = {w: (hosts[2 * i], hosts[2 * i + 1]) for i, w in enumerate(pairs)}
    spec = live.pool_message(pool, {}, {w: (a, b, pairs[w][2]) for w, (a, b) in copies.items()}, config_dir)
    return Shared(spec, copies)
