"""The calibration dataset file: a local JSONL file, one sample per line, read and checked the same way on both sides.

    data/calib.jsonl        {"text": "..."}            tokenized with the source's tokenizer (in the child)
                            {"input_ids": [1, 2, ...]} used as given
    read_rows(path, n) ───▶ Rows: the first n lines' samples + sha256 of exactly those lines' bytes

The supervisor calls `read_rows` to refuse a bad file before anything is written (and hashes the lines into the
job's fingerprint); the child calls it again and checks the hash, so both sides provably use the same bytes.
Owns the file format only: it never tokenizes, never orders samples (that is llm-compressor's dataloader rule,
applied in the child) and never imports torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


class CalibrationDataError(ValueError):
    """The dataset file cannot be used; the message is one line and says how to fix it."""


@dataclass
class Rows:
    samples: list[str | list[int]]  # per line: the text, or the token ids
    sha256: str  # of the bytes of the lines used (newlines included)

    @property
    def has_text(self) -> bool:
        return any(isinstance(s, str) for s in self.samples)


def read_rows(path: str, count: int, vocab_size: int | None = None) -> Rows:
    """The first `count` samples of the JSONL file at `path`; raises CalibrationDataError on anything malformed."""
    try:
        with open(path, "rb") as f:
            lines = _first_lines(f, count)
    except FileNotFoundError:
        raise CalibrationDataError(f"calibration dataset {path!r} does not exist; set [calibration] dataset to a "
                                   "JSONL file") from None
    except IsADirectoryError:
        raise CalibrationDataError(f"calibration dataset {path!r} is a folder; set [calibration] dataset to a "
                                   "JSONL file") from None
    except OSError as exc:
        raise CalibrationDataError(f"calibration dataset {path!r} cannot be read: {exc.strerror}") from exc
    if not lines:
        raise CalibrationDataError(f"calibration dataset {path!r} is empty; it needs one JSON object per line")
    if len(lines) < count:
        raise CalibrationDataError(f"calibration dataset {path!r} has {len(lines)} lines but [calibration] samples "
                                   f"= {count}; lower samples or add lines")
    h = hashlib.sha256()
    samples = []
    for number, raw in enumerate(lines, start=1):
        h.update(raw)
        samples.append(_sample(raw, number, path, vocab_size))
    return Rows(samples, h.hexdigest())


def _first_lines(f, count: int) -> list[bytes]:
    lines = []
    for raw in f:
        lines.append(raw)
        if len(lines) == count:
            break
    return lines


def _sample(raw: bytes, number: int, path: str, vocab_size: int | None) -> str | list[int]:
    where = f"calibration dataset {path!r} line {number}"
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CalibrationDataError(f"{where} is not valid JSON ({_short(exc)}); "
                                   'each line must be {"text": "..."} or {"input_ids": [...]}') from None
    if not isinstance(obj, dict) or ("text" in obj) == ("input_ids" in obj):
        raise CalibrationDataError(f'{where} must be a JSON object with exactly one of "text" or "input_ids"')
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise CalibrationDataError(f'{where}: "text" must be a non-empty string')
        return text
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        raise CalibrationDataError(f'{where}: "input_ids" must be a non-empty list of non-negative integers')
    if vocab_size is not None and max(ids) >= vocab_size:
        raise CalibrationDataError(f'{where}: token id {max(ids)} is outside the model\'s vocabulary '
                                   f"(vocab_size {vocab_size})")
    return ids


def _short(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120]
