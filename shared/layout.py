"""The output folder's layout: file names both sides agree on.

    OUT/
      config.json, model.safetensors.index.json, generation_config.json, tokenizer files
      model-layer-00000.safetensors …   one shard per decoder layer
      model-non-layer.safetensors       embeddings, final norm, lm_head
      .export/                          state, not output: journal, lock, logs, staging, done marker,
                                        boundary/ (calibrated exports: the newest layer's input activations)

Everything that is not part of the model lives under `.export/`, so the rest of the folder is exactly what a
loader reads and is byte-identical from run to run. Owns names (and what every shard's header says) only; never
touches the disk.
"""
from __future__ import annotations

import os

from shared.messages import NON_LAYER

STATE_DIR = ".export"
JOURNAL = "journal.jsonl"
LOCK = "lock"
DONE = "done.json"
LOGS = "logs"
TMP = "tmp"  # each attempt's temp files (staged shards, boundaries being written); on the output's filesystem
STAGING = "staging"  # config.json staging before it is moved into place
BOUNDARY = "boundary"  # calibration activations entering the next layer (only the newest is kept)
INDEX = "model.safetensors.index.json"
NON_LAYER_FILE = "model-non-layer.safetensors"
# the `__metadata__` of every compressed-tensors shard, as transformers' save_pretrained writes it into each of its own
SHARD_METADATA = {"format": "pt"}
# safetensors dtype names -> torch's (the attribute names, and the dtype strings safetensors.torch serializes with)
SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                      "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                      "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                      "F8_E8M0": "float8_e8m0fnu"}


def shard_name(index: int) -> str:
    return NON_LAYER_FILE if index == NON_LAYER else f"model-layer-{index:05d}.safetensors"


def staged_name(index: int, fence: str) -> str:
    """Where the attempt `fence` (ExportLayer.fence) leaves part `index`'s complete, fsynced shard, relative to the
    output folder: only the supervisor moves it to shard_name(index), and only for the attempt it is waiting on."""
    return f"{STATE_DIR}/{TMP}/{shard_name(index)}.{fence}.tmp"


def boundary_name(feeds: int, rank: int | None = None, fence: str = "") -> str:
    """The boundary file feeding layer `feeds`, relative to the output folder; a group's rank has one of its own (the
    activations of its samples). `fence`: the attempt that wrote it (a late writer's file never has the name the
    journal holds); "" in journals written before attempts were fenced."""
    own = "" if rank is None else f"-rank-{rank:03d}"
    attempt = f".{fence}" if fence else ""
    return f"{STATE_DIR}/{BOUNDARY}/inputs-layer-{feeds:05d}{own}{attempt}.bin"


def device_lock(output: str, device: str) -> str:
    """The lock file the workers sharing `device` ("cuda:0") take turns on for their device stage (Hello.device_lock)."""
    return state_path(output, f"device-{device.replace(':', '')}.lock")


def state_dir(output: str) -> str:
    return os.path.join(output, STATE_DIR)


def state_path(output: str, *names: str) -> str:
    return os.path.join(output, STATE_DIR, *names)
