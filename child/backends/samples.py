"""The calibration samples as token ids, in the order llm-compressor's `oneshot` feeds them to the model.

    [calibration] dataset ─▶ shared.calibdata.read_rows (first `samples` lines, hash checked against the
                             supervisor's) ─▶ text: the source's AutoTokenizer, truncated to seq_len as oneshot's
                             TextGenerationDataset does; input_ids: as given
                          ─▶ a group's rank (W > 1): its contiguous slice of those lines, the bounds llm-compressor's
                             distributed oneshot gives each rank of an identical dataset (_get_partition_start_end)
                          ─▶ order: llm-compressor's own LengthAwareSampler (shuffle_calibration_samples=False):
                             longest first, by the length before the final truncation, with torch's unstable
                             argsort (equal lengths come out permuted once there are more than 16 samples)
                          ─▶ each truncated to seq_len (oneshot's DataCollatorWithTruncation, batch size 1)

The order is taken from the library's sampler rather than re-derived, so it matches oneshot by construction
(GPTQ's result depends on it). Owns this list only; it never touches the model.
"""
from __future__ import annotations

import torch

from shared import calibdata


def calibration_ids(dataset: str, samples: int, seq_len: int, tokenizer_dir: str, expected_sha256: str = "",
                    vocab_size: int | None = None, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """One LongTensor [1, L] per sample, in the order oneshot calibrates with them (a group's `rank` of `world`: its
    own samples, in the order distributed oneshot's rank calibrates with them)."""
    rows = calibdata.read_rows(dataset, samples, vocab_size)
    if expected_sha256 and rows.sha256 != expected_sha256:
        raise calibdata.CalibrationDataError(
            f"calibration dataset {dataset!r} changed since the run started; run again to start over")
    tokens = tokenize(rows.samples, seq_len, tokenizer_dir) if rows.has_text else rows.samples
    if world > 1:
        start, end = partition(len(tokens), rank, world)
        tokens, samples = tokens[start:end], end - start
    order = _oneshot_order(tokens, samples)
    return [torch.tensor([tokens[i][:seq_len]], dtype=torch.long) for i in order]


def partition(num_samples: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's samples: llm-compressor's own bounds (contiguous, the last rank takes the remainder)."""
    from llmcompressor.datasets.utils import _get_partition_start_end

    return _get_partition_start_end(num_samples, rank, world)


def tokenize(samples: list, seq_len: int, tokenizer_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    # oneshot (TextGenerationDataset.tokenize): truncation=True, padding=False, max_length=min(max_seq_length,
    # tokenizer.model_max_length), the tokenizer's default special tokens
    max_length = min(seq_len, tok.model_max_length)
    out = []
    for number, s in enumerate(samples, start=1):
        if not isinstance(s, str):
            out.append(s)
            continue
        ids = tok(s, padding=False, truncation=True, max_length=max_length)["input_ids"]
        if not ids:
            raise calibdata.CalibrationDataError(f"calibration dataset line {number} tokenizes to no tokens")
        out.append(list(ids))
    return out


def _oneshot_order(tokens: list[list[int]], samples: int) -> list[int]:
    from llmcompressor.datasets.utils import LengthAwareSampler

    sampler = LengthAwareSampler(_InputIds(tokens), num_samples=samples, batch_size=1)
    return list(iter(sampler))


class _InputIds:
    """What LengthAwareSampler reads of the dataset it is given (`column_names`, `len`, the `input_ids` column),
    served from the token lists themselves: the same lengths a `datasets.Dataset.from_dict({"input_ids": ...})`
    gives it, without importing `datasets` (with pandas and pyarrow), which no export worker loads
    (child/imports.py _UNLOADED). tests/test_calibrate.py compares the order with oneshot's own dataloader."""

    column_names = ["input_ids"]

    def __init__(self, tokens: list[list[int]]):
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, column: str) -> list[list[int]]:
        if column != "input_ids":
            raise KeyError(column)
        return self._tokens
