"""`supervisor plan`'s text: the parts of an export and, per part, which source tensors are quantized and kept.

    layers 1..60 (each): 774 quantized, 6 kept → 1.91 GB
      quantized  mlp.experts.*.down_proj.weight ×256, mlp.experts.*.gate_proj.weight ×256, self_attn.q_a_proj.weight …
      kept       input_layernorm.weight, mlp.gate.e_score_correction_bias, mlp.gate.weight, …

Names are shown relative to their part with numbered sub-modules folded (experts), and consecutive layers with the
same plan are shown once. Owns wording only: the plan itself comes from the worker (child/preview.py).
"""
from __future__ import annotations

import re
from collections import Counter

from shared.load_verdict import problems, transformers_only
from shared.messages import NON_LAYER, Described, PartPlan

_NUMBERED = re.compile(r"(?<=\.)\d+(?=\.)")


def render(d: Described, source: str, scheme: str, consumer: str = "transformers", arithmetic: str = "") -> list[str]:
    layers = [p for p in d.parts if p.index != NON_LAYER]
    lines = [f"source   {source}", f"scheme   {scheme}", f"by       {d.backend}", f"ignore   {d.ignore}",
             f"parts    {len(d.parts)}: {len(layers)} layers under {d.layer_prefix!r}, then the non-layer part",
             f"loads    {_verdict(d)}", f"for      {_consumer(d, consumer)}"]
    if arithmetic:
        lines.append(f"math     {arithmetic}")
    if d.world:
        lines.append(f"group    {d.world} rank{'s' if d.world > 1 else ''} calibrate each layer"
                     + (" together (one torch.distributed process group)" if d.world > 1 else "")
                     + (f"; {d.world_note}" if d.world_note else ""))
    lines.append("")
    groups: list[tuple[list[int], tuple, PartPlan]] = []
    for part in layers:
        key = _relative(part, f"{d.layer_prefix}{part.index}.")
        if groups and groups[-1][1] == key and groups[-1][0][-1] == part.index - 1:
            groups[-1][0].append(part.index)
        else:
            groups.append(([part.index], key, part))
    for indices, (quantized, kept), part in groups:
        what = f"layer {indices[0]}" if len(indices) == 1 else f"layers {indices[0]}..{indices[-1]} (each)"
        lines += _block(what, quantized, kept, part.out_bytes)
    non_layer = next((p for p in d.parts if p.index == NON_LAYER), None)
    if non_layer is not None:
        lines += _block("non-layer", tuple(non_layer.quantized), tuple(non_layer.kept), non_layer.out_bytes)
    return lines


def _verdict(d: Described) -> str:
    if not d.load.checked:
        return f"not checked: {d.load.reason}"
    problem = problems(d.load)
    return f"NO, transformers would not load it correctly: {problem}" if problem else \
        "yes: transformers' loader places every predicted weight (checked on the meta device)"


def _consumer(d: Described, consumer: str) -> str:
    """Which consumer the export is for ([export] consumer) and whether the run would write it."""
    if consumer != "vllm":
        if d.load.checked and problems(d.load):
            return "transformers ([export] consumer): run refuses it" + (
                '; [export] consumer = "vllm" would write it for vLLM' if transformers_only(d.load) else "")
        return "transformers and vLLM ([export] consumer = \"transformers\": run refuses what transformers would load wrong)"
    if d.load.checked and problems(d.load):
        return ("vLLM ([export] consumer = \"vllm\"): run writes it, transformers' loader would not load it" if
                transformers_only(d.load) else "vLLM ([export] consumer = \"vllm\"): run refuses it all the same "
                "(not a known transformers-only limitation)")
    return "vLLM ([export] consumer = \"vllm\"); transformers loads it too"


def _relative(part: PartPlan, prefix: str) -> tuple[tuple, tuple]:
    def rel(names):
        return tuple(n[len(prefix):] if n.startswith(prefix) else n for n in names)
    return rel(part.quantized), rel(part.kept)


def _block(what: str, quantized: tuple, kept: tuple, out_bytes: int) -> list[str]:
    head = f"{what}: {len(quantized)} quantized, {len(kept)} kept → {out_bytes / 1e6:.1f} MB"
    return [head, f"  quantized  {_folded(quantized)}", f"  kept       {_folded(kept)}"]


def _folded(names: tuple) -> str:
    if not names:
        return "-"
    counts = Counter(_NUMBERED.sub("*", n) for n in names)
    return ", ".join(f"{n} ×{c}" if c > 1 else n for n, c in sorted(counts.items()))
