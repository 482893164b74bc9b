"""Durable file writes and file digests, the one helper both sides use.

Writes: temp file, flush, fsync, os.replace, fsync the folder; a file written through here is either absent or
complete at its final name, whatever kills the process. The temp folder must be on the same filesystem as the
destination (rename is atomic only there).

Digests are "algo:hex" strings, so a journal says how each was made. New files get xxh3-128: the digest guards
against files damaged or truncated after they were written (a disk error, a partial copy, a stray edit), not
against an adversary who can write the output folder (who could rewrite the journal too), so a fast
non-cryptographic hash is enough, and at ~17 GB/s (measured, one core) against sha256's ~1.7 GB/s it costs
nothing beside the write. Bare hex digests (journals of earlier versions) are sha256.
"""
from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
from typing import Callable

import xxhash

from shared import checkpoint

_CHUNK = 8 * 1024 * 1024
ALGO = "xxh3-128"
DIRECT_ALIGN = 4096  # O_DIRECT's offsets, lengths and addresses: a multiple of any disk's logical block size
_DIRECT_PIECE = 32 << 20
DIRECT_THREADS = 4


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str, drop_cache: bool = False) -> None:
    """fsync `path`; with `drop_cache`, then hand its pages (clean once synced) back to the kernel."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def replace(tmp: str, dest: str, drop_cache: bool = False) -> None:
    """Make a complete, fsynced `tmp` appear at `dest` atomically and durably. `drop_cache`: a file written once
    and not read again soon (an export's shard) leaves the page cache once on disk, so the next file's writes take
    its pages instead of new ones, and what others cache (the source checkpoint) is not pushed out for it."""
    fsync_file(tmp, drop_cache)
    os.replace(tmp, dest)
    fsync_dir(os.path.dirname(os.path.abspath(dest)))


def replace_all(pairs: list[tuple[str, str]]) -> None:
    """replace() for several complete files at once: every temp file fsynced (side by side: the filesystem commits
    them together), then each renamed, then each destination folder fsynced once: one folder commit for the lot
    instead of one per file (an export's config, index and tokenizer files). A crash part way leaves each file
    complete at its final name or absent, as replace() does; all are durable when this returns. An error before
    the renames renames nothing."""
    if not pairs:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(pairs))) as pool:
        list(pool.map(fsync_file, [tmp for tmp, _ in pairs]))
    for tmp, dest in pairs:
        os.replace(tmp, dest)
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(dest)) for _, dest in pairs):
        fsync_dir(folder)


def place(tmp: str, dest: str) -> None:
    """Move a complete file that its writer already fsynced (`tmp`) to `dest`, atomically and durably: the second
    half of replace(), for the supervisor placing a shard a worker staged (child/writer.py)."""
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
        unlink_quietly(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(dest)))


def pwrite_all(fd: int, data, offset: int) -> None:
    """All of `data` at `offset` of `fd` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _address(view: memoryview) -> int:
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).__array_interface__["data"][0] if len(view) else 0


def write_direct(fd: int, path: str, data, offset: int, update: Callable[[memoryview], None] | None = None,
                 threads: int = DIRECT_THREADS) -> bool:
    """Write `data` (a bytes-like object) at `offset` of the open file `fd`, whose name is `path`, bypassing the page
    cache where it can: the whole 4 KiB blocks through a second descriptor opened with O_DIRECT, `threads` writing
    32 MiB pieces in turn, the rest through `fd`. Measured on the H200 machine's disk (bench/disk_probe.py, 2.1 GB,
    each ending with fsync): 2.1 GB/s against 1.2-1.4 for writes into the page cache (one thread or several), which
    the fsync then waits for; on the CPU VM 2.3 against 0.26-1.0. The caller still fsyncs `fd` (the disk's cache
    and the file's size). Where the filesystem refuses O_DIRECT (tmpfs), or `data`'s memory or `offset` is not
    4 KiB-aligned, the whole of it goes through `fd` instead: the same bytes either way. `update(view)` (a hash's)
    gets `data` once, in order, while the threads write. Returns whether O_DIRECT wrote the blocks."""
    view = memoryview(data).cast("B")
    body = len(view) // DIRECT_ALIGN * DIRECT_ALIGN
    dfd = None
    if body and offset % DIRECT_ALIGN == 0 and _address(view) % DIRECT_ALIGN == 0 and hasattr(os, "O_DIRECT"):
        try:
            dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    hashed = False
    if dfd is not None:
        starts = list(range(0, body, _DIRECT_PIECE))

        def run(k: int) -> None:
            for a in starts[k::threads]:
                pwrite_all(dfd, view[a:min(a + _DIRECT_PIECE, body)], offset + a)

        try:
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="direct-write") as pool:
                parts = [pool.submit(run, k) for k in range(min(threads, len(starts)))]
                if update is not None:
                    update(view)
                    hashed = True
                for part in parts:
                    part.result()  # bounded: its pieces' writes
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a block size above 4 KiB: the page cache after all, below
                raise
            body = 0
        finally:
            os.close(dfd)
    else:
        body = 0
    pwrite_all(fd, view[body:], offset + body)
    if update is not None and not hashed:
        update(view)
    return body > 0


def hasher(algo: str = ALGO):
    """A fresh hashlib-style object (update, hexdigest) for `algo`."""
    if algo == "xxh3-128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algo!r}")


def algo_of(digest: str) -> str:
    return digest.split(":", 1)[0] if ":" in digest else "sha256"


def hash_file(path: str, algo: str = ALGO) -> str:
    """The digest ("algo:hex") of the file's bytes."""
    h = hasher(algo)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return f"{algo}:{h.hexdigest()}"


def digest_safetensors(path: str, data: Callable[[str], object], algo: str = ALGO) -> str:
    """The digest of the safetensors file at `path`, just written from bytes the caller still holds: its header is
    read back (a few KB) and each tensor's bytes, `data(name)` (a bytes-like object, or None), hashed from memory in
    the header's offset order, so the file is not read a second time. Falls back to hashing the file when the layout
    is not the contiguous one safetensors writes, or a tensor's bytes are not at hand or not its size."""
    header, head = checkpoint.header(path)
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1], name)
                   for name, info in header.items() if name != "__metadata__")
    views, pos = [], 0
    for start, end, name in spans:
        view = data(name)
        if start != pos or view is None or memoryview(view).nbytes != end - start:
            return hash_file(path, algo)
        views.append(view)
        pos = end
    if len(head) + pos != os.path.getsize(path):
        return hash_file(path, algo)
    h = hasher(algo)
    h.update(head)
    for view in views:
        h.update(view)
    return f"{algo}:{h.hexdigest()}"


def matches(path: str, digest: str) -> bool:
    """Whether the file's bytes have `digest` (made with the algorithm the digest names)."""
    algo = algo_of(digest)
    got = hash_file(path, algo)
    return got == digest if ":" in digest else got.split(":", 1)[1] == digest


def sha256_file(path: str) -> str:
    return hash_file(path, "sha256").split(":", 1)[1]


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


SPARE_PREFIX = "spare-"  # a spent file kept for the next of its kind to be rewritten in place (take_spare)


def spares(folder: str) -> list[str]:
    """The spares in `folder` (names; none where it does not exist)."""
    try:
        return sorted(fn for fn in os.listdir(folder) if fn.startswith(SPARE_PREFIX))
    except FileNotFoundError:
        return []


def keep_spare(path: str, folder: str) -> None:
    """Keep the spent file `path` in `folder` (on its filesystem) as a spare, under a name of its own. Its name needs no
    folder fsync: a spare is nobody's data, and one a crash leaves behind is removed with the rest of the temp
    folder when the next run begins."""
    os.replace(path, os.path.join(folder, f"{SPARE_PREFIX}{os.urandom(8).hex()}"))


def take_spare(folder: str, dest: str, size: int) -> bool:
    """Move a spare of `folder` to `dest` (a temp name, to be rewritten in place: opened without O_TRUNC), preferring
    one of `size` bytes. Whether one was taken. Several processes may take at once: each rename either takes a spare
    whole or finds it gone (then the next is tried).

    Why: a file whose blocks are written already takes the data alone, where a fresh one also has its blocks
    allocated and their extents converted as the writes complete, and an unlinked one has them freed (discarded, on
    a filesystem mounted with `discard`). Measured on the H200 machine's ext4 (bench/unlink_probe.py, 2.1 GB files
    written past the page cache and synced, one after another): 0.78-0.80 s a file rewritten against 1.33-1.49 s
    fresh; on the CPU VM 0.62-0.70 s against 1.27-1.39 s per 0.5 GB."""
    def rank(fn: str) -> int:
        try:
            return 0 if os.path.getsize(os.path.join(folder, fn)) == size else 1
        except FileNotFoundError:
            return 2
    for fn in sorted(spares(folder), key=rank):
        try:
            os.replace(os.path.join(folder, fn), dest)
            return True
        except FileNotFoundError:
            continue  # another process took it
    return False


def tensor_digest(items, algo: str = ALGO) -> str:
    """The digest ("algo:hex") of (name, dtype, shape, raw bytes) items in name order: a live model's part, as both
    sides see it. `items` yields (name, dtype name, shape, bytes-like of the tensor's contiguous bytes)."""
    h = hasher(algo)
    for name, dtype, shape, data in sorted(items, key=lambda item: item[0]):
        h.update(f"{name}|{dtype}|{list(shape)}\n".encode())
        h.update(data)
    return f"{algo}:{h.hexdigest()}"
