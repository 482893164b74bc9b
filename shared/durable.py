"""Durable file writes, the one helper both sides use: temp file, flush, fsync, os.replace, fsync the folder.

A file written through here is either absent or complete at its final name, whatever kills the process. Owns
nothing else; the temp folder must be on the same filesystem as the destination (rename is atomic only there).
"""
from __future__ import annotations

import hashlib
import os

_CHUNK = 8 * 1024 * 1024


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: str, dest: str) -> None:
    """Make a complete, fsynced `tmp` appear at `dest` atomically and durably."""
    fsync_file(tmp)
    os.replace(tmp, dest)
    fsync_dir(os.path.dirname(os.path.abspath(dest)))


def write_bytes(dest: str, data: bytes, tmp_dir: str | None = None) -> None:
    tmp_dir = tmp_dir or os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(tmp_dir, f".{os.path.basename(dest)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(dest)))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def tensor_digest(items) -> str:
    """sha256 over (name, dtype, shape, raw bytes) items, in name order: a live model's layer, as both sides see it.
    `items` yields (name, dtype name, shape, bytes-like of the tensor's contiguous bytes)."""
    h = hashlib.sha256()
    for name, dtype, shape, data in sorted(items, key=lambda item: item[0]):
        h.update(f"{name}|{dtype}|{list(shape)}\n".encode())
        h.update(data)
    return h.hexdigest()
