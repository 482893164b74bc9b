"""A calibrated job's data, checked before anything is written, and what of it decides the output's bytes.

    job [calibration] + the source ─▶ check() ─▶ Calibration(sha256 of the lines used, fingerprint parts)
      dataset: exists, not empty, every line used is {"text": ...} or {"input_ids": [...]}, enough lines,
               ids inside the vocabulary (shared.calibdata.read_rows)
      text:    the source has a tokenizer (its files are hashed into the fingerprint)
      seq_len: at most the model's max_position_embeddings

    + the workers ─▶ check_arithmetic: a resume computes with the thread counts and device models the folder's
                    calibrated layers were computed with (the journal's Arithmetic record), else it is refused

Raises CalibrationError or ArithmeticMismatch (exit 2, one line). Owns these checks only: it never tokenizes and
never imports torch (the child tokenizes and orders the samples, after checking that it reads the same bytes, by
their sha256).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from shared.arithmetic import FAST
from shared.calibdata import CalibrationDataError, read_rows
from shared.job import Job
from shared.versions import installed
from supervisor.errors import ArithmeticMismatch, CalibrationError
from supervisor.checks.source import SourceInfo

# Files AutoTokenizer reads from a checkpoint folder; any of the first three makes a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "chat_template.jinja")
_MAKES_A_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass
class Calibration:
    sha256: str  # of the dataset lines used; the child checks it reads the same bytes
    fingerprint: dict  # everything about the data that decides the output's bytes


# Whether a group over several GPUs (NCCL) has been measured: byte-identical runs, kill and resume, on a host of
# several GPUs. Until then such a group runs only where `resources.workers` asks for it, and W = 1 is the default.
NCCL_GROUP_MEASURED = False


def group_size(job: Job, devices: list[str]) -> tuple[int, str]:
    """W, the ranks that calibrate each layer together (one worker each), and why it is 1 where more were possible
    ("" otherwise). On GPUs `resources.workers` ranks, one per GPU, at most one per GPU in use (0, the default:
    one rank while an NCCL group is not measured, NCCL_GROUP_MEASURED; then one per GPU); on the CPU
    `resources.workers` ranks (0, the default, and 1: one worker, in order, as before groups existed)."""
    r, c = job.resources, job.calibration
    if devices == ["cpu"]:
        want = max(r.workers, 1)
    elif r.workers <= 0 and len(devices) > 1 and not NCCL_GROUP_MEASURED:
        return 1, (f"1 rank calibrates ({len(devices)} GPUs here): a group over several GPUs (NCCL) is not yet "
                   f"measured; set [resources] workers = N to use N GPUs")
    else:
        want = len(devices) if r.workers <= 0 else min(r.workers, len(devices))
    if want <= 1:
        return 1, ""
    if job.export.method == "awq" and devices == ["cpu"]:
        return 1, (f"AWQ calibrates on one rank on the CPU ({want} asked): llm-compressor 0.14's AWQ reduces its "
                   "statistics through an accelerator")
    if c.samples < want:
        return c.samples, f"{c.samples} ranks, one per calibration sample ({want} asked)"
    return want, ""


def check(job: Job, source: SourceInfo, device: str, world: int = 1) -> Calibration:
    """Validate the job's calibration data against the source; `device` is the resolved device ("cpu"/"cuda:N"),
    `world` the group size (group_size)."""
    c = job.calibration
    text_config = source.config.get("text_config", source.config)
    limit = text_config.get("max_position_embeddings")
    if isinstance(limit, int) and c.seq_len > limit:
        raise CalibrationError(f"[calibration] seq_len = {c.seq_len} exceeds the model's max_position_embeddings "
                               f"({limit}); lower seq_len")
    vocab = text_config.get("vocab_size")
    try:
        rows = read_rows(c.dataset, c.samples, vocab if isinstance(vocab, int) else None)
    except CalibrationDataError as exc:
        raise CalibrationError(str(exc)) from None
    tokenizer = _tokenizer_files(source.path) if rows.has_text else []
    if rows.has_text and not any(name in _MAKES_A_TOKENIZER for name, _, _ in tokenizer):
        raise CalibrationError(f"calibration dataset {c.dataset!r} has text lines but the source {source.path!r} "
                               "has no tokenizer (tokenizer.json); add its tokenizer files, or give "
                               '{"input_ids": [...]} lines')
    parts = {
        "method": job.export.method,
        "dataset_sha256": rows.sha256,
        "samples": c.samples,
        "seq_len": c.seq_len,
        # the arithmetic depends on the device kind and on the thread count (measured): the kind here, the threads
        # each rank really ran with (and its device's model) in the journal (check_arithmetic), not the count asked
        "device": device.split(":")[0],
    }
    if world > 1:  # each rank calibrates its own slice of the samples: the partition decides the bytes
        parts["world"] = world
    if not c.match_oneshot:  # other arithmetic, other bytes (absent by default: fingerprints stay as they were)
        parts["match_oneshot"] = False
        parts["fast_arithmetic"] = FAST  # and its version: a half-done folder is finished by the same arithmetic
    if rows.has_text:
        parts["tokenizer"] = [list(t) for t in tokenizer]
        parts["tokenizers"] = _version("tokenizers")
    return Calibration(rows.sha256, parts)


def planned_arithmetic(job: Job, devices: list[str], world: int) -> tuple[list[int | None], list[str | None]]:
    """Per rank, what this host's workers will compute with, as far as the supervisor decides it before they start:
    the torch thread count it gives them (None: torch's default, which only the worker knows) and the device's
    model (None for a GPU: naming it initialises CUDA, which only the worker does)."""
    from shared.arithmetic import device_model
    from supervisor.workers.devices import worker_threads

    ranks = [devices[r] for r in range(world)] if devices != ["cpu"] else ["cpu"] * world
    sharing = world if devices == ["cpu"] else 1  # each rank its share of the cores (run.launch)
    threads = [worker_threads(job.resources.torch_threads, d, sharing, os.cpu_count() or 1) or None for d in ranks]
    return threads, [device_model("cpu") if d == "cpu" else None for d in ranks]


def check_arithmetic(output: str, recorded, has_layers: bool, threads: list[int | None],
                     models: list[str | None]) -> None:
    """Refuse (ArithmeticMismatch, exit 2) workers that would compute with another thread count (CPU ranks: on a GPU
    the layer's arithmetic is the device's) or on another device model than the folder's calibrated layers were
    (`recorded`: the journal's latest Arithmetic), while the journal holds a layer; None: not known yet."""
    if recorded is None or not has_layers or len(recorded.threads) != len(threads):
        return
    then, now, fixes = [], [], {}
    for r, (t0, m0, t, m) in enumerate(zip(recorded.threads, recorded.devices, threads, models)):
        if t is not None and m0.startswith("cpu") and t != t0:
            then.append((r, f"{t0} torch thread{'s' if t0 != 1 else ''}"))
            now.append((r, f"{t} torch thread{'s' if t != 1 else ''}"))
            cpu = {n for n, d in zip(recorded.threads, recorded.devices) if d.startswith("cpu")}
            fixes["threads"] = f"[resources] torch_threads = {t0} as before" if len(cpu) == 1 else \
                "the torch thread counts it was started with"
        if m is not None and m != m0:
            then.append((r, m0))
            now.append((r, m))
            fixes["device"] = f"on {', '.join(sorted(set(recorded.devices)))} as before"
    if then:
        world = len(threads)
        raise ArithmeticMismatch(
            f"output {output!r} holds calibrated layers computed with {_by_rank(then, world)}; this run's workers "
            f"would compute with {_by_rank(now, world)} (a calibrated layer's bytes depend on the thread count and "
            f"the device model); resume with {' and '.join(fixes.values())}, or start fresh in a new folder")


def _by_rank(items: list[tuple[int, str]], world: int) -> str:
    """"2 torch threads" (one worker), "… on every rank" when all W ranks agree, else "rank 0: …, rank 1: …"."""
    if len({text for _, text in items}) == 1 and len({r for r, _ in items}) == world:
        return items[0][1] + (" on every rank" if world > 1 else "")
    return ", ".join(f"rank {r}: {text}" for r, text in items)


def _tokenizer_files(folder: str) -> list[tuple[str, int, int]]:
    from shared.durable import sha256_file

    out = []
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            out.append((name, os.path.getsize(path), sha256_file(path)))
    return out


def _version(pkg: str) -> str:
    return installed((pkg,))[pkg]
