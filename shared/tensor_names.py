"""Where a checkpoint's decoder layers are, from its tensor names alone: the rule both sides agree on.

    model.layers.3.mlp.experts.7.w1.weight   → stack "model.layers.", layer 3  (the first integer segment)
    transformer.h.11.attn.c_attn.weight      → stack "transformer.h.", layer 11  (GPT-2, Falcon, BLOOM, GPT-J)
    model.embed_tokens.weight                → no stack: outside the layers

The decoder layers are the stack whose layer count the config states (`num_hidden_layers`, `n_layer`, …), or,
without one, the stack with the most layers. The supervisor uses this to validate a source before any child
starts; a child that knows the architecture confirms it from the model class (the ModuleList of layers), and one
that does not (an export by tensor names) uses it as is. Pure string logic: no torch, no file access.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_FIRST_INDEX = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?)(?P<index>\d+)\.")
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def stacks(names) -> dict[str, set[int]]:
    """{prefix: layer indices} for every prefix that precedes a name's first integer path segment."""
    found: dict[str, set[int]] = {}
    for n in names:
        m = _FIRST_INDEX.match(n)
        if m and m["prefix"]:
            found.setdefault(m["prefix"], set()).add(int(m["index"]))
    return found


def config_layers(config: dict) -> int | None:
    """The decoder layer count a config.json states, if it states one."""
    for source in (config, config.get("text_config") or {}):
        for key in _LAYER_COUNT_KEYS:
            if isinstance(source.get(key), int):
                return source[key]
    return None


def find_layers(names, config: dict) -> tuple[str, set[int]] | None:
    """(prefix, indices found) of the decoder layer stack, or None when no name has an integer segment."""
    found = stacks(names)
    if not found:
        return None
    expected = config_layers(config)
    if expected is not None:
        # the stack that holds the stated layers (it may hold more: DeepSeek's multi-token-prediction layer)
        fitting = [p for p, idx in found.items() if set(range(expected)) <= idx]
        if fitting:
            prefix = max(fitting, key=lambda p: (p.endswith("layers."), -len(found[p])))
            return prefix, found[prefix]
    prefix = max(found, key=lambda p: (len(found[p]), p.endswith("layers.")))
    return prefix, found[prefix]


def layer_of(name: str, prefix: str) -> int | None:
    """The layer index of tensor `name` in the stack `prefix`, or None when it is outside that stack."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_names(names: Iterable[str], prefix: str, index: int) -> list[str]:
    """The names of decoder layer `index`'s tensors, sorted."""
    p = f"{prefix}{index}."
    return sorted(n for n in names if n.startswith(p))


def non_layer_names(names: Iterable[str], prefix: str, num_layers: int | None = None) -> list[str]:
    """The names outside decoder layers 0..num_layers-1, sorted: layers past the count (DeepSeek's multi-token
    prediction layer) belong here; num_layers None: outside every layer."""
    def outside(name: str) -> bool:
        index = layer_of(name, prefix)
        return index is None or (num_layers is not None and index >= num_layers)
    return sorted(n for n in names if outside(n))
