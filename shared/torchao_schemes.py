"""torchao schemes: the names job.toml accepts for `format = "torchao"`, how `[export.torchao]` spells each
keyword, and the one function that turns them into a torchao config object.

    [export]
    scheme = "Float8WeightOnly"          ─▶  torchao.quantization.Float8WeightOnlyConfig(
    [export.torchao]                              granularity=PerTensor(),
    granularity = "PerTensor"                     weight_dtype=torch.float8_e5m2)
    weight_dtype = "float8_e5m2"

Spellings (TOML has no torchao objects):
- granularity: "PerRow" | "PerTensor"; for the dynamic-activation schemes also ["PerRow", "PerRow"]
  (activation, weight), as torchao's own list form;
- float8 dtypes: "float8_e4m3fn" | "float8_e5m2" (the torch.dtype's name);
- enums: the member's lower-case name, e.g. "tile_packed_to_4d", "hqq", "asymmetric";
- ints, floats, booleans: TOML's own. Any other keyword of the torchao config is refused.

Names and spellings are checked without importing torch (the CLI validates a job before any heavy import);
`build` imports torchao lazily and is the only place a job becomes a torchao object: the supervisor builds it
once so torchao's own checks run before anything is written, the child builds it to quantize.
tests/test_torchao_schemes.py checks every spelling against torchao's enums and config fields, so this table
cannot drift from the library silently. Owns names and that translation; it never quantizes, never touches files.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

GRANULARITIES = ("PerRow", "PerTensor")
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class Keyword:
    kind: str  # "granularity" | "granularity_pair" | "float8_dtype" | "enum" | "int" | "float" | "bool"
    choices: tuple = ()  # allowed values (enum: lower-case member names; int: allowed numbers, empty = any)
    enum: str = ""  # torchao enum class, as "module:Name" (kind "enum" only)


@dataclass(frozen=True)
class Scheme:
    config: str  # torchao.quantization class name
    keywords: dict[str, Keyword]
    gpu_only: str = ""  # why it cannot run on a CPU device; empty: it can
    defaults: dict = field(default_factory=dict)  # our defaults where they differ from torchao's (see README)


_GRAN = Keyword("granularity", GRANULARITIES)
_GRAN_PAIR = Keyword("granularity_pair", GRANULARITIES)
_F8 = Keyword("float8_dtype", FLOAT8_DTYPES)
_KERNEL = Keyword("enum", ("auto", "torch", "mslk", "emulated", "triton"),
                  "torchao.quantization.quantize_.common:KernelPreference")
_MAPPING = Keyword("enum", ("symmetric", "asymmetric"), "torchao.quantization:MappingType")
_INT4_PACKING = Keyword("enum", ("tile_packed_to_4d", "plain"),
                        "torchao.quantization.quantize_.workflows.int4.int4_packing_format:Int4PackingFormat")
_INT4_QPARAMS = Keyword("enum", ("tinygemm", "hqq"),
                        "torchao.quantization.quantize_.workflows.int4.int4_choose_qparams_algorithm:"
                        "Int4ChooseQParamsAlgorithm")

SCHEMES: dict[str, Scheme] = {
    "Int8WeightOnly": Scheme("Int8WeightOnlyConfig", {"granularity": _GRAN}),
    "Int8DynamicActivationInt8Weight": Scheme(
        "Int8DynamicActivationInt8WeightConfig",
        {"granularity": _GRAN_PAIR, "act_mapping_type": _MAPPING, "reduce_range": Keyword("bool"),
         "weight_only_decode": Keyword("bool")}),
    "Float8WeightOnly": Scheme("Float8WeightOnlyConfig", {"granularity": _GRAN, "weight_dtype": _F8}),
    "Float8DynamicActivationFloat8Weight": Scheme(
        "Float8DynamicActivationFloat8WeightConfig",
        {"granularity": _GRAN_PAIR, "activation_dtype": _F8, "weight_dtype": _F8,
         "activation_value_lb": Keyword("float"), "activation_value_ub": Keyword("float"),
         "kernel_preference": _KERNEL},
        gpu_only="needs a CUDA GPU with compute capability 8.9 or newer (torchao's own requirement)"),
    "Int4WeightOnly": Scheme(
        "Int4WeightOnlyConfig",
        {"group_size": Keyword("int", (32, 64, 128, 256)), "int4_packing_format": _INT4_PACKING,
         "int4_choose_qparams_algorithm": _INT4_QPARAMS},
        gpu_only="needs a CUDA GPU (tile_packed_to_4d packs with CUDA kernels; plain needs the mslk-cuda package)",
        # torchao's default packing is "plain", whose quantization needs the mslk-cuda package; tile_packed_to_4d
        # needs only torch's CUDA build and is what torchao's published INT4 checkpoints use (transformers and
        # vLLM both load it). See docs/torchao.md.
        defaults={"int4_packing_format": "tile_packed_to_4d"}),
}

# Schemes whose quantize_ runs on a CPU (measured with torchao 0.18: quantize, save, reload, forward).
CPU_SCHEMES = tuple(name for name, s in SCHEMES.items() if not s.gpu_only)


def _closest(name: str, options) -> str | None:
    hits = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    if not hits:  # "int8weightonly", "Int8WeightOnlyConfig": compare case-insensitively, without "Config"
        folded = {o.lower(): o for o in options}
        key = name.lower().removesuffix("config")
        hits = [folded[h] for h in difflib.get_close_matches(key, list(folded), n=1, cutoff=0.5)]
    return hits[0] if hits else None


def _did_you_mean(name: str, options) -> str:
    hint = _closest(name, options)
    return f"did you mean {hint!r}? " if hint else ""


def check_scheme(name: str) -> str | None:
    """None when `name` is a torchao scheme we export, else a one-line reason with a suggestion."""
    if name in SCHEMES:
        return None
    return (f"unknown torchao scheme {name!r}; {_did_you_mean(name, SCHEMES)}supported: {', '.join(SCHEMES)} "
            "(torchao config names without 'Config')")


def _check_value(key: str, kw: Keyword, value) -> str | None:
    shown = f"{key} = {value!r}"
    if kw.kind == "bool":
        return None if isinstance(value, bool) else f"{shown} must be true or false"
    if kw.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{shown} must be an integer"
        if kw.choices and value not in kw.choices:
            return f"{shown} is not supported; use one of {', '.join(map(str, kw.choices))}"
        return None
    if kw.kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{shown} must be a number"
    if kw.kind == "granularity_pair" and isinstance(value, list):
        if len(value) != 2:
            return f"{shown} must be one granularity or a list of two (activation, weight)"
        for v in value:
            problem = _check_value(key, Keyword("granularity", kw.choices), v)
            if problem:
                return problem
        return None
    if not isinstance(value, str) or value not in kw.choices:
        hint = _did_you_mean(value, kw.choices) if isinstance(value, str) else ""
        return f"{shown} is not valid; {hint}use one of {', '.join(repr(c) for c in kw.choices)}"
    return None


def check_keywords(scheme: str, keywords: dict) -> str | None:
    """None when every `[export.torchao]` keyword is one `scheme` takes and is spelled right, else why not."""
    allowed = SCHEMES[scheme].keywords
    for key, value in keywords.items():
        if key not in allowed:
            takes = ", ".join(allowed) or "none"
            return (f"unknown keyword {key!r} for {scheme}; {_did_you_mean(key, allowed)}"
                    f"it takes: {takes}")
        problem = _check_value(key, allowed[key], value)
        if problem:
            return problem
    merged = {**SCHEMES[scheme].defaults, **keywords}
    if merged.get("int4_choose_qparams_algorithm") == "hqq" and merged.get("int4_packing_format") != "tile_packed_to_4d":
        return "int4_choose_qparams_algorithm = 'hqq' needs int4_packing_format = 'tile_packed_to_4d' (torchao's rule)"
    return None


def _convert(kw: Keyword, value):
    import torch
    from torchao.quantization import PerRow, PerTensor

    if kw.kind in ("granularity", "granularity_pair"):
        if isinstance(value, list):
            return [_convert(Keyword("granularity"), v) for v in value]
        return {"PerRow": PerRow, "PerTensor": PerTensor}[value]()
    if kw.kind == "float8_dtype":
        return getattr(torch, value)
    if kw.kind == "enum":
        import importlib

        module, name = kw.enum.split(":")
        return getattr(importlib.import_module(module), name)[value.upper()]
    if kw.kind == "float":
        return float(value)
    return value


def build(scheme: str, keywords: dict | None = None):
    """The torchao config object (an AOBaseConfig) for `scheme` and its `[export.torchao]` keywords.

    Raises ValueError (one line) for a bad table, including torchao's own refusals of a combination."""
    problem = check_scheme(scheme) or check_keywords(scheme, keywords or {})
    if problem:
        raise ValueError(problem)
    import torchao.quantization as tq

    spec = SCHEMES[scheme]
    merged = {**spec.defaults, **(keywords or {})}
    kwargs = {k: _convert(spec.keywords[k], v) for k, v in merged.items()}
    try:
        return getattr(tq, spec.config)(**kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"torchao refuses {spec.config} with {merged}: {reason}") from exc
