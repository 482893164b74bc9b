"""How a run's boundary files are best made durable one after another: fresh files unlinked when spent, or spent
files rewritten in place?

A calibrated run writes one boundary per layer (2.1 GB at the 8B shape: 128 x 2048 bf16 hidden states), past the
page cache (shared.durable.write_direct) and fsynced, while the next layer computes; the one before is spent and
unlinked on a thread of its own (supervisor/run/boundaries.py). On ext4 an O_DIRECT write into blocks never written
allocates them and converts the extents as each write completes, and the unlink frees them again: metadata work
beside the data. A file whose blocks are already written takes the data alone. This writes --rounds files of --gb GB
in turn, as a run writes its boundaries, in three ways, and prints a table (seconds per file, GB/s sustained):

  fresh        a new file each round (O_CREAT), written, fsynced, renamed; the one two rounds back unlinked on a
               thread (today's run)
  prealloc     as fresh, with posix_fallocate before the writes
  reuse        the file three rounds back renamed to the new temp name and rewritten in place (the same size:
               fdatasync), then renamed; three files in all

Then the unlink of one 2.1 GB file alone, and one file's single write by each way, as a check of the sustained
figures.

    python3 bench/unlink_probe.py --dir /tmp --gb 2.1 --rounds 8
"""
from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shared import durable  # noqa: E402


def write(path: str, buf: memoryview, *, prealloc: bool = False, reuse_from: str | None = None) -> float:
    """One boundary-like file at `path`, durable; `reuse_from`: an existing file of the same size, rewritten."""
    t = time.perf_counter()
    tmp = path + ".tmp"
    if reuse_from is not None:
        os.replace(reuse_from, tmp)
        fd = os.open(tmp, os.O_WRONLY)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if prealloc:
            os.posix_fallocate(fd, 0, len(buf))
        durable.write_direct(fd, tmp, buf, 0)
        if reuse_from is not None:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
    finally:
        os.close(fd)
    durable.place(tmp, path)
    return time.perf_counter() - t


def sustained(d: str, buf: memoryview, rounds: int, how: str) -> list[float]:
    names = [os.path.join(d, f"probe-{how}-{k}.bin") for k in range(rounds)]
    deleter = concurrent.futures.ThreadPoolExecutor(1)
    times = []
    try:
        for k, name in enumerate(names):
            if how == "reuse" and k >= 3:
                times.append(write(name, buf, reuse_from=names[k - 3]))
            else:
                times.append(write(name, buf, prealloc=how == "prealloc"))
            if how != "reuse" and k >= 2:
                deleter.submit(durable.unlink_quietly, names[k - 2])
    finally:
        deleter.shutdown(wait=True)
        for name in names:
            durable.unlink_quietly(name)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--gb", type=float, default=2.1)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    d = os.path.join(args.dir, "unlink-probe")
    os.makedirs(d, exist_ok=True)
    n = int(args.gb * 1e9) // 4096 * 4096
    mapping = mmap.mmap(-1, n)  # page-aligned: write_direct takes the O_DIRECT path
    buf = memoryview(mapping)
    chunk = os.urandom(1 << 20)
    for a in range(0, n, 1 << 20):
        m = min(1 << 20, n - a)
        buf[a:a + m] = chunk[:m]
    print(f"{args.rounds} files of {n / 1e9:.2f} GB in turn, in {d}")
    print("| way | s per file (each) | mean s | GB/s sustained |")
    print("| --- | --- | --- | --- |")
    for how in ("fresh", "prealloc", "reuse", "fresh", "reuse"):
        times = sustained(d, buf, args.rounds, how)
        steady = times[3:] if len(times) > 3 else times  # reuse begins at the fourth file
        mean = sum(steady) / len(steady)
        print(f"| {how} | {' '.join(f'{t:.2f}' for t in times)} | {mean:.3f} (files 4-) | {n / 1e9 / mean:.2f} |",
              flush=True)
    path = os.path.join(d, "one.bin")
    write(path, buf)
    t = time.perf_counter()
    os.unlink(path)
    print(f"unlink of one {n / 1e9:.2f} GB file: {time.perf_counter() - t:.3f} s")
    os.rmdir(d)


if __name__ == "__main__":
    main()
