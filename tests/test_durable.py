"""shared/durable.py's digest of a safetensors file hashed from memory: equal to hashing the file, and the file hashed
instead whenever the bytes at hand do not fit its header."""
from __future__ import annotations

import torch
from safetensors.torch import save_file

from shared import durable


def _file(tmp_path) -> tuple[str, dict]:
    tensors = {"b.weight": torch.randn(7, 5, dtype=torch.bfloat16), "a.norm": torch.randn(5, dtype=torch.float32),
               "c.flag": torch.tensor(True)}
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def test_digest_from_memory_equals_the_files(tmp_path):
    path, tensors = _file(tmp_path)
    assert durable.digest_safetensors(path, lambda name: _bytes(tensors[name])) == durable.hash_file(path)


def test_bytes_that_do_not_fit_the_header_fall_back_to_the_file(tmp_path):
    """A missing tensor, or bytes of another size, never yield a digest of bytes the file does not hold."""
    path, tensors = _file(tmp_path)
    whole = durable.hash_file(path)
    assert durable.digest_safetensors(path, lambda name: None if name == "a.norm" else _bytes(tensors[name])) == whole
    assert durable.digest_safetensors(path, lambda name: _bytes(tensors[name])[:-1]) == whole
    # the same sizes but other values: the digest is of those values (the caller vouches for them), so it differs
    other = {k: torch.zeros_like(v) for k, v in tensors.items()}
    assert durable.digest_safetensors(path, lambda name: _bytes(other[name])) != whole
