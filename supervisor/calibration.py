"""A calibrated job's data, checked before anything is written, and what of it decides the output's bytes.

    job [calibration] + the source ─▶ check() ─▶ Calibration(sha256 of the lines used, fingerprint parts)
      dataset: exists, not empty, every line used is {"text": ...} or {"input_ids": [...]}, enough lines,
               ids inside the vocabulary (shared.calibdata.read_rows)
      text:    the source has a tokenizer (its files are hashed into the fingerprint)
      seq_len: at most the model's max_position_embeddings

Raises CalibrationError (exit 2, one line). Owns these checks only: it never tokenizes and never imports torch
(the child tokenizes and orders the samples, after checking that it reads the same bytes, by their sha256).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from shared.calibdata import CalibrationDataError, read_rows
from shared.job import Job
from supervisor.errors import CalibrationError
from supervisor.source import SourceInfo

# Files AutoTokenizer reads from a checkpoint folder; any of the first three makes a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "chat_template.jinja")
_MAKES_A_TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass
class Calibration:
    sha256: str  # of the dataset lines used; the child checks it reads the same bytes
    fingerprint: dict  # everything about the data that decides the output's bytes


def group_size(job: Job, devices: list[str]) -> tuple[int, str]:
    """W, the ranks that calibrate each layer together (one worker each), and why it is 1 where more were asked
    ("" otherwise). On GPUs one rank per GPU in use (`resources.workers`, when set, caps it); on the CPU
    `resources.workers` ranks (0, the default, and 1: one worker, in order, as before groups existed)."""
    r, c = job.resources, job.calibration
    if devices == ["cpu"]:
        want = max(r.workers, 1)
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
        # GPTQ's arithmetic depends on the thread count and on the device (measured), so a resume must match
        "torch_threads": job.resources.torch_threads,
        "device": device.split(":")[0],
    }
    if world > 1:  # each rank calibrates its own slice of the samples: the partition decides the bytes
        parts["world"] = world
    if not c.match_oneshot:  # other arithmetic, other bytes (absent by default: fingerprints stay as they were)
        parts["match_oneshot"] = False
    if rows.has_text:
        parts["tokenizer"] = [list(t) for t in tokenizer]
        parts["tokenizers"] = _version("tokenizers")
    return Calibration(rows.sha256, parts)


def _tokenizer_files(folder: str) -> list[tuple[str, int, int]]:
    from shared.durable import sha256_file

    out = []
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            out.append((name, os.path.getsize(path), sha256_file(path)))
    return out


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "missing"
