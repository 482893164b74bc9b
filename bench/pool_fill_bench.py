"""How fast host memory can be made ready for a first release: shared (memfd) memory, faulted in and registered
with CUDA (cudaHostRegister), by several strategies, then one copy from the GPU into it.

    python bench/pool_fill_bench.py --gib 16            # on a GPU machine
    python bench/pool_fill_bench.py --gib 1 --no-cuda   # dry run: the fill strategies only

Each row: seconds to allocate + fault (fill), to register, and to copy --gib GiB down from the GPU into it.
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import torch

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def sysfs(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"({exc.strerror})"


def new_chunk(nbytes: int, *, huge: bool = False, fallocate: bool = False):
    fd = os.memfd_create("bench-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    if fallocate:
        os.posix_fallocate(fd, 0, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge:
        try:
            m.madvise(MADV_HUGEPAGE)
        except OSError as exc:
            print("   MADV_HUGEPAGE:", exc)
    return fd, m, torch.frombuffer(m, dtype=torch.uint8)


def populate(m) -> None:
    m.madvise(MADV_POPULATE_WRITE)


def register(t: torch.Tensor) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 1))


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def run(name: str, gib: float, chunks: int, threads: int, fill: str, huge: bool, cuda: bool, src) -> None:
    total = int(gib * 2**30)
    size = total // chunks
    t0 = time.perf_counter()
    made = [None] * chunks
    timings = {"fill": 0.0, "register": 0.0, "copy": 0.0}

    def one(i: int):
        fd, m, t = new_chunk(size, huge=huge, fallocate=fill.startswith("fallocate"))
        if fill == "zero":
            t.zero_()
        elif fill in ("populate", "fallocate+populate"):
            populate(m)
        made[i] = (fd, m, t)
        return i

    def reg(i: int):
        register(made[i][2])
        return i

    if threads <= 1:
        for i in range(chunks):
            one(i)
        timings["fill"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if cuda:
            for i in range(chunks):
                reg(i)
        timings["register"] = time.perf_counter() - t1
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(chunks)))
            timings["fill"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if cuda:
                list(ex.map(reg, range(chunks)))
            timings["register"] = time.perf_counter() - t1
    if cuda:
        t2 = time.perf_counter()
        off = 0
        for fd, m, t in made:
            t.copy_(src[off:off + size], non_blocking=True)
            off += size
        torch.cuda.synchronize()
        timings["copy"] = time.perf_counter() - t2
    wall = time.perf_counter() - t0
    print(f"| {name} | {chunks} | {threads} | {timings['fill']:.2f} | {timings['register']:.2f} | "
          f"{timings['copy']:.2f} | **{wall:.2f}** |", flush=True)
    for fd, m, t in made:
        if cuda:
            unregister(t)
        del t
        m.close()
        os.close(fd)


def pipelined(gib: float, chunks: int, threads: int, src) -> None:
    """Chunks faulted and registered by a thread pool; each copied down as soon as it is ready."""
    total = int(gib * 2**30)
    size = total // chunks
    t0 = time.perf_counter()

    def one(i: int):
        fd, m, t = new_chunk(size, fallocate=True)
        register(t)
        return fd, m, t

    made = []
    with ThreadPoolExecutor(threads) as ex:
        for i, (fd, m, t) in enumerate(ex.map(one, range(chunks))):
            t.copy_(src[i * size:(i + 1) * size], non_blocking=True)
            made.append((fd, m, t))
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    print(f"| pipelined fallocate+register, copy as ready | {chunks} | {threads} | - | - | - | **{wall:.2f}** |",
          flush=True)
    for fd, m, t in made:
        unregister(t)
        del t
        m.close()
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--pair", action="store_true",
                   help="only the parallel zero_() fill, then today's way: each on memory the other did not touch "
                        "first (the rows above can profit from pages an earlier row made the host back)")
    args = p.parse_args()
    cuda = not args.no_cuda and torch.cuda.is_available()
    print(f"kernel {platform.release()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    for k in ("enabled", "shmem_enabled", "defrag"):
        print(f"THP {k}: {sysfs('/sys/kernel/mm/transparent_hugepage/' + k)}")
    src = None
    if cuda:
        src = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, device="cuda:0").fill_(7)
        torch.cuda.synchronize()
        t = time.perf_counter()
        hb = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)  # also starts the CUDA context's host side
        print(f"cudaHostAlloc 1 GiB: {time.perf_counter() - t:.2f} s")
        del hb
    n = os.cpu_count() or 1
    print(f"\n{args.gib} GiB\n\n| strategy | chunks | threads | fill s | register s | copy s | wall s |\n| --- | --- | --- | --- | --- | --- | --- |")
    if args.pair:
        run("one memfd, zero_() (intra-op threads)", args.gib, 1, 1, "zero", False, cuda, src)
        run("today: one memfd, register faults it", args.gib, 1, 1, "none", False, cuda, src)
        run("one memfd, zero_() (intra-op threads)", args.gib, 1, 1, "zero", False, cuda, src)
        torch.set_num_threads(1)
        run("memfds, zero_() each, one thread per memfd", args.gib, 16, min(16, n), "zero", False, cuda, src)
        return
    run("today: one memfd, register faults it", args.gib, 1, 1, "none", False, cuda, src)
    run("one memfd, zero_() (intra-op threads)", args.gib, 1, 1, "zero", False, cuda, src)
    run("one memfd, MADV_POPULATE_WRITE", args.gib, 1, 1, "populate", False, cuda, src)
    run("one memfd, fallocate", args.gib, 1, 1, "fallocate", False, cuda, src)
    run("one memfd, fallocate, MADV_POPULATE_WRITE", args.gib, 1, 1, "fallocate+populate", False, cuda, src)
    run("one memfd, MADV_HUGEPAGE, zero_()", args.gib, 1, 1, "zero", True, cuda, src)
    for chunks, threads in ((16, 8), (16, 16), (64, 16)):
        run("memfds, MADV_POPULATE_WRITE each", args.gib, chunks, min(threads, n), "populate", False, cuda, src)
    run("memfds, fallocate each", args.gib, 16, min(16, n), "fallocate", False, cuda, src)
    run("memfds, fallocate + MADV_POPULATE_WRITE each", args.gib, 16, min(16, n), "fallocate+populate", False, cuda,
        src)
    run("memfds, register faults each", args.gib, 16, min(16, n), "none", False, cuda, src)
    if cuda:
        pipelined(args.gib, 16, min(16, n), src)
        pipelined(args.gib, 64, min(16, n), src)


if __name__ == "__main__":
    main()
