"""The export job: what `job.toml` parses into, shared by the supervisor and the child.

Owns the schema and its parsing (tomllib + msgspec, unknown keys refused). It checks shapes and names only; it
must never touch the source or output folders (that is the supervisor's validation) and never import torch.
New fields always get defaults, so journals written by an older version still decode.
"""
from __future__ import annotations

import difflib
import re
import tomllib
from typing import Any, Literal

import msgspec

from shared import schemes, torchao_schemes


class Source(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str
    # config.json with auto_map asks for code from the checkpoint; refused unless this is set.
    allow_remote_code: bool = False
    # A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), merged per layer in the child.
    adapter: str | None = None


class Export(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    scheme: str
    output: str
    # None means the defaults: lm_head and MoE routers (DEFAULT_IGNORE below).
    ignore: list[str] | None = None
    format: str = "compressed-tensors"  # one of FORMATS (a str, so that a typo gets a suggestion)
    # [export.torchao]: keyword arguments of the torchao config (format "torchao" only); spellings in
    # shared/torchao_schemes.py. None: torchao's defaults (and ours, where the README says so).
    torchao: dict[str, Any] | None = None
    # Each module's quantization error, for `supervisor report`: the worker dequantizes what it writes, which
    # costs 45-180% more CPU time per layer on a CPU export (docs/report.md) and little on a GPU; it never
    # changes the output's bytes. None: measure on a GPU, not on the CPU.
    measure_error: bool | None = None
    # rtn: round-to-nearest (llm-compressor's QuantizationModifier); gptq / awq need [calibration].
    method: Literal["rtn", "gptq", "awq"] = "rtn"
    # Who loads the export: "transformers" (default) refuses an export transformers' loader would load wrong;
    # "vllm" still runs that check and reports it, but lets an export through whose only problem is a known
    # limitation of transformers' MoE expert loader (shared.load_verdict.transformers_only), which vLLM does not
    # share. Never changes the output's bytes (so it is not in the fingerprint).
    consumer: Literal["transformers", "vllm"] = "transformers"


FORMATS = ("compressed-tensors", "torchao")


class Calibration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    dataset: str  # local JSONL: one {"text": ...} or {"input_ids": [...]} per line
    samples: int = 128  # the first N lines of the file
    seq_len: int = 2048  # each sample is truncated to this many tokens
    # true: every tensor bit for bit oneshot's. false: GPTQ's Hessians from bf16 inputs on tensor cores with fp32
    # accumulation; on a GPU SDPA attention, in AWQ's grid search too (rounding only; docs/fidelity.md)
    match_oneshot: bool = True


class Evaluate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """[evaluate]: at the end of every export, `verify --quality` over these held-out samples (docs/quality.md)."""

    dataset: str  # local JSONL, the calibration file's form
    samples: int = 64
    seq_len: int = 2048


class Resources(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    max_attempts: int = 3  # attempts per layer before the export fails
    heartbeat_timeout: float = 120.0  # seconds of silence after which a child counts as hung
    startup_timeout: float = 300.0  # seconds a child may take to import and answer the handshake
    part_timeout: float = 0.0  # seconds one layer may take even while heartbeats arrive (0: no limit)
    recycle_after_layers: int = 0  # restart the worker after this many layers (0: never)
    recycle_above_rss_mb: int = 0  # restart the worker when its RSS exceeds this (0: never)
    torch_threads: int = 0  # torch.set_num_threads in the child (0: leave torch's default)
    workers: int = 0  # worker processes exporting parts at once (0: one per GPU and three in all, as memory allows;
    # two for layers over 1 GiB, taking turns on a shared GPU; an extra one its GPU cannot hold is left out; on CPU,
    # one per 4 cores and two at least, as memory allows)
    # Host memory (GiB) the calibration activations of one layer (its inputs and outputs) may take; above it
    # they stay on disk under OUT/.export and are read back one sample at a time. 0: a quarter of the RAM.
    activation_ram_gb: float = 0.0
    # Seconds a rank of a calibrated group (W > 1 workers calibrating each layer together) may wait in a collective
    # for the slowest rank; past it the layer fails for the group and is redone by a fresh group. Bounds a rank
    # stuck in a C call while its heartbeats go on.
    collective_timeout: float = 600.0
    # Seconds the warm parent (imported libraries, no CUDA) stays after the run, so that the next run of the same
    # environment (a re-run after a crash, the next export) forks its workers instead of importing again. 0: it
    # ends with the run. Unset: $SUPERVISOR_KEEP_WARM, else 300.
    keep_warm: float | None = None
    # Where the workers run: "" this host only; "ray": one worker per GPU (or `workers` CPU workers) on the nodes of
    # the Ray cluster at `ray_address` ("": $RAY_ADDRESS, else the cluster this node belongs to). Source and output
    # must be on a file system every node sees (checked before anything is written).
    cluster: str = ""
    ray_address: str = ""


class Job(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # None only through the Python API with a live model (`Supervisor(job, model=live)`): the model is the source.
    source: Source | None = None
    export: Export
    resources: Resources = msgspec.field(default_factory=Resources)
    calibration: Calibration | None = None
    evaluate: Evaluate | None = None


# lm_head: vLLM and transformers expect it dense unless asked. The rest are MoE routers and shared-expert
# gates (nn.Linear in Mixtral / Qwen-MoE style models): quantizing them breaks routing and vLLM.
DEFAULT_IGNORE: tuple[str, ...] = (
    "lm_head",
    "re:.*mlp\\.gate$",  # MoE routers (Qwen-MoE, DeepSeek)
    "re:.*block_sparse_moe\\.gate$",  # MoE routers (Mixtral)
    "re:.*mlp\\.shared_expert_gate$",
)


# Added to the defaults when a checkpoint is exported by tensor names (an architecture transformers does not know):
# by name alone embeddings look like any Linear weight, and llm-compressor's model_free_ptq would quantize them.
NAME_ONLY_IGNORE: tuple[str, ...] = (
    "re:.*embed[^.]*$",  # embed_tokens, embed_in, word_embeddings, embeddings
    "re:(.*\\.)?wte$",  # GPT-2 style token / position embeddings
    "re:(.*\\.)?wpe$",
)


def effective_ignore(job: Job, by_names: bool = False) -> list[str]:
    """The ignore list in effect: the job's, or the defaults (plus NAME_ONLY_IGNORE for an export by names)."""
    if job.export.ignore is not None:
        return list(job.export.ignore)
    return list(DEFAULT_IGNORE + (NAME_ONLY_IGNORE if by_names else ()))


def is_calibrated(job: Job) -> bool:
    """Whether the export runs calibration data through the model (then its layers run in order, one worker)."""
    return job.export.format == "compressed-tensors" and schemes.needs_calibration(job.export.scheme,
                                                                                 job.export.method)


def warm_profile(job: Job) -> str:
    """What a worker of this job imports, as the warm parent names it (child/zygote.py, child/imports.py preload):
    the format. Part of a kept warm parent's key. Calibrated and data-free exports of a format import the same
    libraries (neither loads `datasets`: child/imports.py _UNLOADED), so one kept parent serves both."""
    return job.export.format


def ignores_lm_head(ignore: list[str]) -> bool:
    return any(p == "lm_head" or (p.startswith("re:") and re.fullmatch(p[3:], "lm_head")) for p in ignore)


class JobSyntaxError(ValueError):
    """job.toml could not be parsed or validated; the message is one line."""


_DEVICE_FORMS = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def _check_export(export: Export) -> None:
    if export.format not in FORMATS:
        hint = difflib.get_close_matches(export.format, FORMATS, n=1, cutoff=0.5)
        did_you_mean = f"did you mean {hint[0]!r}? " if hint else ""
        raise JobSyntaxError(f"[export] unknown format {export.format!r}; {did_you_mean}use one of "
                             f"{', '.join(repr(f) for f in FORMATS)}")
    if export.format == "torchao":
        problem = torchao_schemes.check_scheme(export.scheme)
        if problem:
            raise JobSyntaxError(f"[export] {problem}")
        problem = torchao_schemes.check_keywords(export.scheme, export.torchao or {})
        if problem:
            raise JobSyntaxError(f"[export.torchao] {problem}")
        return
    if export.torchao is not None:
        raise JobSyntaxError('[export.torchao] applies only to format = "torchao"; remove it or set that format')
    problem = schemes.check(export.scheme)
    if problem:
        raise JobSyntaxError(f"[export] {problem}")


def _check_values(job: Job) -> None:
    _check_export(job.export)
    dev = job.resources.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise JobSyntaxError(f"[resources] device = {dev!r} is not valid; use {_DEVICE_FORMS}")
    r = job.resources
    if r.max_attempts < 1:
        raise JobSyntaxError("[resources] max_attempts must be at least 1")
    if r.heartbeat_timeout <= 0 or r.startup_timeout <= 0 or r.collective_timeout <= 0:
        raise JobSyntaxError("[resources] heartbeat_timeout, startup_timeout and collective_timeout must be positive")
    if r.part_timeout < 0:
        raise JobSyntaxError("[resources] part_timeout must be 0 (no limit) or positive")
    if r.recycle_after_layers < 0 or r.recycle_above_rss_mb < 0 or r.torch_threads < 0 or r.workers < 0:
        raise JobSyntaxError("[resources] recycle_after_layers, recycle_above_rss_mb, torch_threads and workers "
                             "must be 0 or more")
    if job.source is not None and not job.source.path.strip():
        raise JobSyntaxError("[source] path is empty; set it to a Hugging Face checkpoint folder")
    if job.source is not None and job.source.adapter is not None and not job.source.adapter.strip():
        raise JobSyntaxError("[source] adapter is empty; set it to a PEFT LoRA adapter folder or remove the key")
    if not job.export.output.strip():
        raise JobSyntaxError("[export] output is empty; set it to the folder to export into")
    if r.keep_warm is not None and r.keep_warm < 0:
        raise JobSyntaxError("[resources] keep_warm must be 0 (the warm parent ends with the run) or a number of "
                             "seconds")
    if r.cluster not in ("", "ray"):
        raise JobSyntaxError(f'[resources] cluster = {r.cluster!r} is not valid; use "ray" (a Ray cluster) or remove '
                             "the key (this host only)")
    if r.ray_address and r.cluster != "ray":
        raise JobSyntaxError('[resources] ray_address applies only with cluster = "ray"; add that or remove the key')
    if r.activation_ram_gb < 0:
        raise JobSyntaxError("[resources] activation_ram_gb must be 0 (a quarter of the RAM) or positive")
    _check_calibration(job)


def _check_calibration(job: Job) -> None:
    e, c = job.export, job.calibration
    if e.format != "compressed-tensors" and (e.method != "rtn" or c is not None):
        raise JobSyntaxError(f"[export] method and [calibration] apply to format = \"compressed-tensors\" only; "
                             f"format {e.format!r} rounds to nearest without data")
    if not is_calibrated(job):
        if c is not None:
            raise JobSyntaxError(f"[calibration] has no effect with method = \"rtn\" and scheme {e.scheme!r}; "
                                 "remove it, or set [export] method = \"gptq\" or \"awq\"")
        return
    if c is None:
        why = (f"method = {e.method!r}" if e.method != "rtn"
               else f"scheme {e.scheme!r} (static activation scales)")
        raise JobSyntaxError(f"{why} needs calibration data: add a [calibration] table with dataset "
                             "(a JSONL file), samples and seq_len")
    if not c.dataset.strip():
        raise JobSyntaxError("[calibration] dataset is empty; set it to a JSONL file")
    if c.samples < 1 or c.seq_len < 1:
        raise JobSyntaxError("[calibration] samples and seq_len must be at least 1")
    if not c.match_oneshot and e.method not in ("gptq", "awq"):
        raise JobSyntaxError("[calibration] match_oneshot = false changes GPTQ's and AWQ's arithmetic only; remove "
                             "it, or set [export] method = \"gptq\" or \"awq\"")
    if e.method == "awq" and e.scheme in schemes.PER_TENSOR_WEIGHTS:
        raise JobSyntaxError(f"method = \"awq\" needs per-channel or grouped weight scales and scheme {e.scheme!r} "
                             "has one scale per tensor; use gptq or rtn, or another scheme")
    if not ignores_lm_head(effective_ignore(job)):
        raise JobSyntaxError("calibrated exports quantize the decoder layers only; keep \"lm_head\" in "
                             "[export] ignore")


def _one_line(err: msgspec.ValidationError) -> str:
    # msgspec says e.g. "Object contains unknown field `x` - at `$.export`"; make the path TOML-like.
    text = str(err).replace("`$.", "`").replace("`$`", "the top level")
    return " ".join(text.split())


def parse_job(data: dict) -> Job:
    """Validate a dict (from TOML or from code) into a Job; raises JobSyntaxError."""
    try:
        job = msgspec.convert(data, Job)
    except msgspec.ValidationError as exc:
        raise JobSyntaxError(_one_line(exc)) from exc
    _check_values(job)
    return job


def parse_toml(text: str) -> Job:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise JobSyntaxError(f"not valid TOML: {exc}") from exc
    return parse_job(data)


def to_dict(job: Job) -> dict:
    return msgspec.to_builtins(job)
