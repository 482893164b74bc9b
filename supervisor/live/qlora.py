"""A live PEFT model over a quantized base (QLoRA): exported from its 16-bit checkpoint plus its LoRA pairs in memory.

A studio that loads in 4 bits (bitsandbytes nf4) trains a LoRA on that quantized base; the 16-bit base weights are
in no memory, and merging the LoRA into the 4-bit weights (merge_and_unload) would lose its precision and then
quantize twice. So such a model is exported as `PeftModel.from_pretrained(<16-bit base>, <its adapter>)
.merge_and_unload()` would be: the 16-bit checkpoint on disk, with the live model's own LoRA pairs merged over it
per layer (no adapter saved, no merge into 4 bits).

    Supervisor(job, model=qlora)
      prepare:  quantized_base(model)      a PEFT model with a non-plain (tensor subclass) weight in its base
                base_and_pairs(job, model) the pairs of the active adapter (names, A/B paths, scaling); the base:
                                           [source] path, else the local folder the model names (its own
                                           config._name_or_path, then the adapter's base_model_name_or_path;
                                           where both are folders and differ, the one whose weights match)
                check(lora, source)        the base's config.json is the live model's (quantization, dtype and
                                           name aside), its weights are (base_difference: a few of its tensors
                                           quantized as the live model's were, against the live bytes) and
                                           every pair fits its weight; the fingerprint's part
      start:    share(lora, PinnedPool)    the A/B tensors copied into a small memfd pool ─▶ Hello.pool (LoRA
                                           pairs only); then the 4-bit model is released as for any [source] job
      child:    Merged(Checkpoint(path), pool pairs): PEFT's merge, the pair upcast as from_pretrained does
      resume:   Shared.digest(names)       a part's pairs' bytes ("" for a part without pairs), against the
                                           journal's record: a changed adapter is redone, never mixed in

The weight check reads a sample of the folder's tensors (safetensors, one tensor at a time, never the whole
checkpoint): the smallest quantized weight of the first, a middle and the last decoder layer, one the adapter targets
where that layer has one, and one targeted weight if none of those is. Each is quantized on the host with the live
weight's own bitsandbytes settings and compared byte for byte with the live data and quant state (copied to the host,
a few tensors). Where the bytes differ, as they may for a weight quantized on another device (a GPU's reductions and
roundings are its own), the checkpoint must still be what the live bytes encode: every value inside the cell of its
live 4-bit (8-bit) code, within a few float32 roundings of the cell's edge, and each block's scale (absmax, SCB)
exactly the folder's (within one step of the 8-bit code where the scales are themselves quantized, double quant);
see _cell_difference. A weight of another quantizer (a tensor subclass this module does not know) is not checked:
the Started event's source_note says so.

A job with `[source] adapter` is left alone: the adapter folder it names is what is merged (the live model is only
released), as for any model. Owns the decisions and checks above and the copy of the pairs; the merge is the
child's (child/sources/adapter.py), the release offload.py's. It never changes the live model: its weights are read where
they are (a CPU-repacked one as it is), and a few are copied to the host.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import dataclass

import msgspec
import torch
from torch import nn

from shared.job import Job, Source
from shared.messages import Pool
from supervisor.live import model as live
from supervisor.errors import SourceError
from supervisor.checks.source import SourceInfo, inspect

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
    note: str = ""  # for the Started event: which of two named folders was taken, or what could not be checked
    checked: str = ""  # the folder whose weights base_and_pairs() verified already (choosing between two named folders)


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


def base_and_pairs(job: Job, model: nn.Module) -> tuple[Job, LiveLora]:
    """The job to run (with [source] path set to the discovered base when it had no [source]) and the live pairs;
    raises SourceError with a one-line message. Reads the model's names only, unless it names two folders: then a
    few of each one's tensors decide (base_difference)."""
    quantized = quantized_base(model)
    inner, adapter = live.unwrap_peft(model, quantized=True)
    loras, _ = live.lora_layers(inner, adapter, quantized=True)
    lora = LiveLora(live.Saved(inner, {}, loras), quantized)
    if job.source is None:
        path, lora.found_by = _discover(model, inner, adapter, lora)
        job = msgspec.structs.replace(job, source=Source(path=path))
    return job, lora


def _discover(model: nn.Module, inner: nn.Module, adapter: str, lora: LiveLora) -> tuple[str, str]:
    # the model's own name first: the adapter may have been trained on another base and loaded onto this one
    named = [("config._name_or_path", getattr(inner.config, "_name_or_path", None)),
             ("base_model_name_or_path", getattr(model.peft_config[adapter], "base_model_name_or_path", None))]
    named = [(attr, name) for attr, name in named if name]
    folders: dict[str, tuple[str, str]] = {}  # realpath -> (attribute, absolute path): one folder named twice
    for attr, name in named:
        if os.path.isfile(os.path.join(name, "config.json")):
            folders.setdefault(os.path.realpath(name), (attr, os.path.abspath(name)))
    if len(folders) == 2:
        return _choose(lora, list(folders.values()))
    if folders:
        attr, path = next(iter(folders.values()))
        return path, attr
    what = f"names {named[0][1]!r}, which is not a local checkpoint folder" if named else "names no base checkpoint"
    raise SourceError(f"the live model is a PEFT model over a quantized base ({lora.quantized}), whose 16-bit weights "
                      f"are not in memory, and it {what}; {_SET_PATH} (its LoRA pairs are merged over that from "
                      "memory)")


def _choose(lora: LiveLora, folders: list[tuple[str, str]]) -> tuple[str, str]:
    """Of the two folders the live model names (its own name first), the first whose config.json and weights are the
    live model's (base_difference); the note says which was taken and why the other was not."""
    why = []
    for attr, path in folders:
        try:
            source = inspect(path)
        except SourceError as exc:
            why.append(f"is no checkpoint this can export ({exc})")
            continue
        diff = _config_difference(lora.saved.inner.config, path)
        diff = f"is another model: {diff}" if diff else base_difference(lora.saved, source)
        if diff:
            why.append(diff if diff.startswith("is another model") else f"holds another checkpoint: {diff}")
            continue
        (other_attr, other), = [f for f in folders if f[1] != path]
        unchecked = unchecked_reason(lora.saved, source)
        how = (f"the model's own name, checked by its config.json only: {unchecked}" if unchecked else
               "whose config.json and weights are the live model's")
        lora.checked = source.path
        lora.note = (f"the live model names two base folders; taken: {path!r} (its {attr}), {how}; not {other!r} "
                     f"(its {other_attr}), " + (f"which {why[0]}" if why else "the adapter's recorded base"))
        return path, attr
    (a1, p1), (a2, p2) = folders
    raise SourceError(f"neither folder the live model names is its base: {p1!r} (its {a1}) {why[0]}; {p2!r} "
                      f"(its {a2}) {why[1]}; {_SET_PATH}")


def check(lora: LiveLora, source: SourceInfo) -> dict:
    """The base checkpoint is the live model's (config.json, then a few of its tensors against the live quantized
    weights: base_difference) and each pair fits its weight; returns the fingerprint's part for the pairs (names,
    dtypes, shapes, scaling: their bytes are checked per part, see Shared.digest)."""
    where = (f"[source] path {source.path!r}" if not lora.found_by else
             f"the folder the live model names ({source.path!r}, its {lora.found_by})")
    fix = ("point it at the 16-bit checkpoint the live model was loaded from" if not lora.found_by else _SET_PATH)
    diff = _config_difference(lora.saved.inner.config, source.path)
    if diff:
        raise SourceError(f"{where} is not the live model's base: {diff}; {fix}")
    if lora.checked != source.path:
        diff = base_difference(lora.saved, source)
        if diff:
            raise SourceError(f"{where} holds another checkpoint than the live model's base: {diff}; {fix}")
        unchecked = unchecked_reason(lora.saved, source)
        if unchecked:
            lora.note = f"the base {source.path!r} is checked by its config.json only: {unchecked}"
    from supervisor.checks.adapter import base_shapes

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


# ---- the weights: a few of the folder's tensors against the live quantized ones --------------------------------
def base_difference(saved: live.Saved, source: SourceInfo) -> str:
    """'' when each sampled tensor of the folder (sample()) is what the live model holds quantized, else the first
    that is not and how ("its model.layers.0.self_attn.k_proj.weight: ..."). Reads those tensors only."""
    from safetensors import safe_open

    weights = _known(saved, source)
    for name in sample(weights, source, set(saved.loras)):
        diff = ""
        for fn in source.files:
            with safe_open(os.path.join(source.path, fn), "pt", device="cpu") as f:
                if name in f.keys():
                    diff = _weight_difference(weights[name], f.get_tensor(name))
                    break
        if diff:
            return f"its {name} {diff}"
    return ""


def unchecked_reason(saved: live.Saved, source: SourceInfo) -> str:
    """Why base_difference compared nothing ('' when it compared a sample): a quantizer it does not know, or no
    quantized weight of the live model named in the folder."""
    if sample(_known(saved, source), source, set(saved.loras)):
        return ""
    names = set(source.tensor_names)
    kinds = sorted({type(t).__name__ for name, t in _quantized_weights(saved).items() if name in names})
    if not kinds:
        return "none of the live model's quantized weights is named in it"
    return (f"the live model's quantized weights ({', '.join(kinds)}) are of a form whose bytes are not compared with "
            "a checkpoint's (bitsandbytes' quantized Params4bit and Int8Params are); make sure it is the checkpoint "
            "the live model was loaded from")


def sample(weights: dict[str, torch.Tensor], source: SourceInfo, targeted: set[str]) -> list[str]:
    """The names checked, spread over the model and chosen by name and size alone (the same every run): in the first,
    a middle and the last decoder layer the smallest weight (one the adapter targets, where the layer has one), and
    the smallest targeted weight if none of those is targeted."""
    prefix, n = source.layer_prefix, source.num_layers

    def layer(name: str) -> int | None:
        head = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        return int(head) if head.isdigit() else None

    def smallest(names: list[str]) -> str:
        return min(names, key=lambda nm: (_numel(weights[nm]), nm))

    picked = []
    for i in sorted({0, n // 2, n - 1}):
        here = [nm for nm in weights if layer(nm) == i]
        if here:
            picked.append(smallest([nm for nm in here if nm in targeted] or here))
    aimed = [nm for nm in weights if nm in targeted]
    if aimed and not targeted & set(picked):
        picked.append(smallest(aimed))
    return picked


def _quantized_weights(saved: live.Saved) -> dict[str, torch.Tensor]:
    """checkpoint name -> the live quantized weight (a PEFT-wrapped module's base_layer named as on disk)."""
    return {name.replace(".base_layer.", "."): p for name, p in saved.inner.named_parameters()
            if ".lora_" not in name and type(p) not in _PLAIN}


def _known(saved: live.Saved, source: SourceInfo) -> dict[str, torch.Tensor]:
    """The live quantized weights this module can compare, that the folder names (bitsandbytes' own, quantized,
    not on the meta device)."""
    names = set(source.tensor_names)
    return {name: p for name, p in _quantized_weights(saved).items()
            if name in names and type(p).__module__.startswith("bitsandbytes") and p.device.type != "meta"
            and (type(p).__name__ == "Params4bit" and p.bnb_quantized and p.quant_state is not None
                 or type(p).__name__ == "Int8Params" and p.dtype == torch.int8 and p.SCB is not None)}


def _numel(w: torch.Tensor) -> int:
    qs = getattr(w, "quant_state", None)
    return math.prod(qs.shape) if qs is not None else w.numel()


def _weight_difference(w: torch.Tensor, disk: torch.Tensor) -> str:
    """'' when `disk` (the folder's 16-bit tensor) is what the live quantized weight `w` holds, else what differs."""
    if disk.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"is {str(disk.dtype).removeprefix('torch.')}, not a 16-bit weight (a quantized checkpoint?)"
    shape = tuple(w.quant_state.shape) if type(w).__name__ == "Params4bit" else tuple(w.shape)
    if tuple(disk.shape) != shape:
        return f"has shape {list(disk.shape)}, the live weight {list(shape)}"
    if type(w).__name__ == "Params4bit":
        return _params4bit_difference(w, disk)
    return _int8_difference(w, disk)


def _params4bit_difference(w, disk: torch.Tensor) -> str:
    """Byte for byte: bitsandbytes' own quantize_4bit of `disk` with the live settings (and its CPU repacking, where
    the live weight was repacked for CPU inference), against the live data and quant state. Where the bytes differ,
    the live codes and scales must still encode `disk` (_cell_difference)."""
    import bitsandbytes.functional as F

    qs = w.quant_state
    cpu_packed = getattr(qs, "packing_format_for_cpu", False)  # Linear4bit.forward on an AVX512-BF16 CPU did it
    dtype = qs.original_dtype if cpu_packed else qs.dtype  # what the 16-bit weight was cast to when quantized
    data = w.data.detach().cpu()  # one weight's 4-bit bytes on the host
    x = disk.to(dtype)
    ref, ref_qs = F.quantize_4bit(x, blocksize=qs.blocksize, quant_type=qs.quant_type, quant_storage=w.quant_storage,
                                  compress_statistics=qs.original_nested if cpu_packed else qs.nested)
    if cpu_packed:
        ref, ref_qs = F._convert_weight_packed_for_cpu(ref, ref_qs)
    if _same(data, ref) and _same_state(qs.as_dict(), ref_qs.as_dict()):
        return ""
    # not the same bytes: quantized elsewhere (another device's arithmetic), or from other weights
    x = x.reshape(-1).float()  # as both kernels compute: float32
    absmax = _blocks(x, qs.blocksize).abs().amax(dim=1)  # exact on every device: a maximum rounds nothing
    per_value = absmax.repeat_interleave(qs.blocksize)[:len(x)]
    values = qs.code.detach().cpu().float()
    cells = _cell_difference(x / per_value.clamp(min=1e-38), values[_codes_4bit(data, qs, cpu_packed).long()],
                             values, CELL_SLACK, per_value > 0)
    if cells:
        return f"is not what the live 4-bit weight encodes: {cells}"
    scale, tol = _live_absmax_4bit(qs, cpu_packed)
    off = ((scale - absmax.double()).abs() > tol).nonzero()
    if len(off):
        i = int(off[0])
        return (f"has absmax {absmax[i].item():.6g} in block {i}, the live weight {scale[i].item():.6g} "
                f"({len(off)} of {len(absmax)} blocks differ)")
    return ""


def _int8_difference(w, disk: torch.Tensor) -> str:
    """Byte for byte: bitsandbytes' int8_vectorwise_quant of `disk` in float16 (what Int8Params._quantize does)
    against the live int8 rows and their scales (SCB). Where the bytes differ, each value must lie in its live int8
    code's cell (code +- 0.5, in units of SCB / 127) and each row's SCB be the folder's row absmax exactly (a
    maximum, which no device rounds)."""
    import bitsandbytes.functional as F

    data, scb = w.data.detach().cpu(), w.SCB.detach().cpu()
    x16 = disk.to(torch.float16)
    ref, ref_scb, _ = F.int8_vectorwise_quant(x16.clone())
    if _same(data, ref) and _same(scb, ref_scb):
        return ""
    x = x16.float()
    rows = x.abs().amax(dim=1)  # exact on every device
    per_value = rows[:, None].expand_as(x)
    cells = _cell_difference((x * 127 / per_value.clamp(min=1e-38)).reshape(-1), data.reshape(-1).float(),
                             torch.arange(-127, 128, dtype=torch.float32), 127 * CELL_SLACK,
                             (per_value > 0).reshape(-1))
    if cells:
        return f"is not what the live int8 weight encodes: {cells}"
    off = (scb.float() != rows).nonzero()
    if len(off):
        i = int(off[0])
        return (f"has absmax {rows[i].item():.6g} in row {i}, the live weight's SCB {scb[i].item():.6g} "
                f"({len(off)} of {len(rows)} rows differ)")
    return ""


# How far outside its live code's cell a value of the right checkpoint may lie, in units of its block's scale. The CPU
# and CUDA kernels scale each value by the block's absmax in float32 and round to the nearest code, each with its own
# arithmetic, so a value within a few float32 ulps of a cell's edge (|scaled| <= 1: an ulp is at most 2**-24) may land
# in the neighbouring cell. Measured on an H200 (bitsandbytes 0.50.2, nf4/fp4, bf16/fp16/fp32 weights, blocksize
# 64/128/256, with and without double quant, 180 weights of up to 45M values): at most 2.98e-7 (5 ulps) outside, and
# int8's rows never outside their cell. 2**-18 (64 ulps) leaves a margin of 12 over that; another checkpoint's values
# leave their cells by far more (another seed: over 90% of them; a fine-tune whose weights moved by 1% of their
# spread: about 3% of them, thousands in a layer's smallest weight).
CELL_SLACK = 2.0 ** -18


def _cell_difference(scaled: torch.Tensor, live: torch.Tensor, book: torch.Tensor, slack: float,
                     counted: torch.Tensor) -> str:
    """'' when every `scaled` value (the folder's, in units of its block's scale, flat) lies in the cell of the code
    value the live weight holds for it (`live`: the values of its codes in the code book `book`), else how many do
    not. A cell is what rounds to its value: from the midpoint with the next smaller value to the midpoint with the
    next larger (unbounded at the ends, where bitsandbytes clamps). Values outside `counted` are skipped (a block whose
    scale is zero dequantizes to 0 whatever its codes)."""
    book = torch.unique(book)  # sorted; fp4 holds 0 twice (+0 and -0)
    mids = (book[1:] + book[:-1]) / 2
    inf = torch.tensor([math.inf], dtype=book.dtype)
    i = torch.searchsorted(book, live)
    low, high = torch.cat([-inf, mids])[i], torch.cat([mids, inf])[i]
    outside = ((scaled < low - slack) | (scaled > high + slack)) & counted
    n = int(outside.sum())
    return f"{n} of its {len(scaled)} values lie outside the cell of their live code" if n else ""


def _codes_4bit(data: torch.Tensor, qs, cpu_packed: bool) -> torch.Tensor:
    """The live weight's 4-bit code indices, one per value, in the weight's own order (bitsandbytes packs two a byte,
    the first in the high nibble; a CPU-repacked weight is unpacked by bitsandbytes' own inverse, on a copy)."""
    if cpu_packed:
        import bitsandbytes.functional as F

        data, _ = F._convert_weight_packed_for_cpu_inverse(data.view(torch.uint8), copy.copy(qs))
    b = data.reshape(-1).view(torch.uint8)
    return torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:math.prod(qs.shape)]


def _live_absmax_4bit(qs, cpu_packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's scale as the live weight dequantizes with it (float64), and how far it may lie from the exact
    absmax of the right weights. Plain absmax: 0 (a float32 maximum, exact on every device). Double quant: one step
    of the 8-bit code book times the block's second-level absmax (the offset is a mean, whose float sum another
    device orders otherwise, so a near-tie may round to the other neighbouring code), plus the offset's rounding.
    Repacked for CPU: the repacking stored the scale in bf16 (half an ulp: at most 2**-8 of it) after dequantizing
    any double quant, whose second-level absmax is gone then (it is at most the largest scale)."""
    import bitsandbytes.functional as F

    if cpu_packed:
        scale = qs.absmax.detach().cpu().T.reshape(-1).to(torch.float64)
        nested = _step(F.create_dynamic_map(signed=True)) * scale.abs().max() if qs.original_nested else 0.0
        return scale, scale.abs() * 2.0 ** -8 + nested
    absmax = qs.absmax.detach().cpu()
    if not qs.nested:
        return absmax.to(torch.float64), torch.zeros(len(absmax), dtype=torch.float64)
    s2 = qs.state2
    code2, absmax2, offset = s2.code.detach().cpu(), s2.absmax.detach().cpu(), qs.offset.detach().cpu()
    scale = F.dequantize_blockwise(absmax, absmax=absmax2, code=code2, blocksize=s2.blocksize) + offset
    second = absmax2.to(torch.float64).repeat_interleave(s2.blocksize)[:len(absmax)]
    return scale.to(torch.float64), second * _step(code2) + abs(offset.item()) * 2.0 ** -20


def _step(book: torch.Tensor) -> float:
    """The largest gap between neighbouring values of a code book."""
    book = torch.unique(book.to(torch.float64))
    return float((book[1:] - book[:-1]).max())


def _blocks(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x (flat) as rows of `blocksize`, the last padded with zeros (bitsandbytes' last block may be short)."""
    return torch.nn.functional.pad(x, (0, -len(x) % blocksize)).reshape(-1, blocksize)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (not torch.equal: 4-bit codes stored as bf16 hold NaN patterns)."""
    a = a.detach().cpu()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))


def _same_state(mine: dict, ref: dict) -> bool:
    """Two QuantState.as_dict()s are equal: tensors byte for byte, the rest (blocksize, type, dtype, shape) by value."""
    if set(mine) != set(ref):
        return False
    return all(_same(v, ref[k]) if isinstance(v, torch.Tensor) else v == ref[k] for k, v in mine.items())


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
