"""How fast can one boundary-sized file be made durable on this machine's disk, and how?

Writes the same random buffer (default 2.1 GB: one 8B layer's boundary of 128 x 2048 bf16 hidden states) to a file
in --dir by several methods, each ending with the file fsynced, and prints a table of seconds and GB/s:

  buffered-1     one thread, 256 MiB writes, fdatasync after each (child/backends/boundary.py's sync path today)
  buffered-N     N threads pwrite one contiguous part each into the page cache, then one fsync
  direct-N-C     O_DIRECT (no page cache): N threads pwrite C MiB pieces in turn from the aligned buffer, then fsync

    python3 bench/disk_probe.py --dir /tmp --gb 2.1 --rounds 2
"""
from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shared.durable import pwrite_all as _pwrite_all  # noqa: E402

MiB = 1 << 20


def buffered_one(path: str, buf: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = 256 * MiB
        for a in range(0, len(buf), step):
            _pwrite_all(fd, buf[a:a + step], a)
            os.fdatasync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def buffered_parallel(path: str, buf: memoryview, threads: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        step = -(-len(buf) // threads)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(_pwrite_all, fd, buf[a:a + step], a) for a in range(0, len(buf), step)]:
                f.result()
        os.fsync(fd)
    finally:
        os.close(fd)


def direct(path: str, buf: memoryview, threads: int, piece: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        offsets = list(range(0, len(buf), piece))

        def run(k: int) -> None:
            for a in offsets[k::threads]:
                _pwrite_all(fd, buf[a:a + piece], a)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(run, k) for k in range(threads)]:
                f.result()
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--gb", type=float, default=2.1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="buffered-1,buffered-4,buffered-8,direct-1-32,direct-4-8,direct-4-32,"
                                         "direct-8-32,direct-16-32")
    args = ap.parse_args()
    n = int(args.gb * 1e9) // MiB * MiB
    mm = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT needs
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.random_()
    buf = memoryview(mm)
    path = os.path.join(args.dir, f"disk-probe-{os.getpid()}.bin")
    st = os.statvfs(args.dir)
    print(f"{args.dir}: {st.f_bavail * st.f_frsize / 1e9:.1f} GB free; file {n / 1e9:.2f} GB; {os.cpu_count()} cores")
    rows = {m: [] for m in args.methods.split(",")}
    try:
        for _ in range(args.rounds):
            for m in rows:
                parts = m.split("-")
                t0 = time.perf_counter()
                try:
                    if parts[0] == "buffered" and parts[1] == "1":
                        buffered_one(path, buf)
                    elif parts[0] == "buffered":
                        buffered_parallel(path, buf, int(parts[1]))
                    else:
                        direct(path, buf, int(parts[1]), int(parts[2]) * MiB)
                except OSError as exc:
                    print(f"{m}: {exc}")
                    rows[m].append(float("nan"))
                    continue
                rows[m].append(time.perf_counter() - t0)
                os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print("| method | seconds (each round) | best GB/s |")
    print("| --- | --- | --- |")
    for m, secs in rows.items():
        best = min(secs)
        print(f"| {m} | {' '.join(f'{s:.2f}' for s in secs)} | {n / best / 1e9:.2f} |")


if __name__ == "__main__":
    main()
