"""What an export will write, before it writes anything: each part's output on meta tensors, and the loader's verdict.

    Source.meta(part i's names) ─▶ Backend.quantize_layer / quantize_non_layer on meta tensors
        ─▶ {name: meta tensor}: which source tensors are quantized (replaced) and which are kept, output bytes
    every part's predicted tensors + the backend's config.json (in a temp folder) ─▶ loadcheck.check ─▶ LoadReport

`supervisor plan` prints it; the run loop asks for it before the first part (on GPUs: a worker of its own, while
the first parts run) and refuses an export whose output transformers would not load (missing or unexpected
weights), with the reason, before any part is journaled; a new output folder is left as it was. Layers with
the same tensors (names relative to the layer, dtypes, shapes) give the same plan, so one of each kind is computed
unless an ignore entry holds a digit (it may name one layer). Owns this prediction only; it reads no weight and
writes only in a temporary folder it removes.
"""
from __future__ import annotations

import tempfile

from child import loadcheck
from shared.messages import NON_LAYER, Described, LoadReport, PartPlan


def describe(source, backend, source_config_json: str, trust_remote_code: bool = False, on_part=None) -> Described:
    """The plan of every part (layers, then the non-layer part) and the loader check of the predicted output."""
    prefix, n = backend.layer_prefix, backend.num_layers
    if not backend.previews:
        return Described(backend=backend.describe(), layer_prefix=prefix, ignore=list(backend.ignore),
                         load=LoadReport(checked=False, reason="this format's output is not predicted"))
    cacheable = not any(ch.isdigit() for entry in backend.ignore for ch in entry)
    cache: dict[tuple, dict] = {}
    predicted: dict = {}
    parts = []
    for index in list(range(n)) + [NON_LAYER]:
        if on_part is not None:
            on_part(index)
        names = source.non_layer_names(prefix, n) if index == NON_LAYER else source.layer_names(prefix, index)
        tensors = source.meta(names)
        if index == NON_LAYER:
            out = backend.quantize_non_layer(tensors)
        else:
            out = _layer(backend, index, f"{prefix}{index}.", tensors, cache if cacheable else None)
        predicted.update(out)
        # kept: written under its own name with its own dtype and shape (FP8 keeps the name "weight", not the dtype),
        # and with its own values (meta tensors cannot show a value change: the backend names those it makes)
        rewritten = set(backend.rewritten(names)) if index == NON_LAYER and hasattr(backend, "rewritten") else set()
        kept = [k for k in names if k in out and k not in rewritten
                and (out[k].dtype, out[k].shape) == (tensors[k].dtype, tensors[k].shape)]
        parts.append(PartPlan(index=index, quantized=sorted(set(names) - set(kept) - rewritten), kept=kept,
                              rewritten=sorted(rewritten),
                              out_bytes=sum(t.numel() * t.element_size() for t in out.values())))
    if not backend.checks_loading:
        load = LoadReport(checked=False, reason="the loader check covers compressed-tensors outputs")
    else:
        with tempfile.TemporaryDirectory(prefix="plan-config-") as tmp:
            backend.write_config(source_config_json, tmp)
            load = loadcheck.check(tmp, predicted, trust_remote_code)
    return Described(backend=backend.describe(), layer_prefix=prefix, ignore=list(backend.ignore), parts=parts,
                     load=load)


def _layer(backend, index: int, prefix: str, tensors: dict, cache: dict | None) -> dict:
    if cache is None:
        return backend.quantize_layer(index, tensors)
    key = tuple(sorted((k[len(prefix):], str(t.dtype), tuple(t.shape)) for k, t in tensors.items()))
    if key not in cache:
        out = backend.quantize_layer(index, tensors)
        if not all(k.startswith(prefix) for k in out):
            return out  # an output name outside the layer: not relative, not cacheable
        cache[key] = {k[len(prefix):]: t for k, t in out.items()}
    return {prefix + rel: t for rel, t in cache[key].items()}
