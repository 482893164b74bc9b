"""Does making a boundary's pinned host memory on a thread slow the GPU work beside it?

A calibrated worker's layer 0 makes two boundaries' host memory (child/staging.py pinned_host_buffer: mapped, its
pages zeroed by torch's threads, then cudaHostRegister): its inputs' while the embeddings are computed, its outputs'
on a thread while the layer's forward runs (child/backends/boundary.py host_buffer_meanwhile). Layer 0's forward
stage is about 0.6 s longer than a steady layer's on an H200 (docs/benchmarks.md, twenty-ninth session). This times,
in a fresh process: one buffer made alone; a run of GPTQ-sized fp32 products (the forward stage's bulk) alone; the
same run with a buffer made on a thread beside it. If the products slow down by about the buffer's time, the
buffers belong where the GPU idles (while the export plan is judged) rather than beside layer 0.

    python3 bench/pin_probe.py --device cuda --gib 2.1     # on a GPU machine (bench/gpu_session.sh)
    python3 bench/pin_probe.py --device cpu --gib 0.2      # the same steps without pinning (a check of the script)
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def make_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    from child.backends.boundary import host_buffer

    return host_buffer(nbytes // 2, torch.bfloat16, pin)


def products(inp: torch.Tensor, n: int, sync) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(n):
        inp.matmul(inp.t())
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gib", type=float, default=2.1, help="each buffer's size (2.1 GB: 128 x 2048 x 4096 bf16)")
    ap.add_argument("--width", type=int, default=14336)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--products", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:  # a thread of its own needs the index (torch.cuda.set_device)
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    nbytes = int(a.gib * 2**30) // 4096 * 4096
    t = time.perf_counter()
    torch.empty(1, device=dev)
    sync()
    print(f"device {torch.cuda.get_device_name(dev) if cuda else 'cpu'}, torch {torch.__version__}; "
          f"first tensor {time.perf_counter() - t:.3f} s")
    inp = torch.randn(a.width, a.tokens, device=dev, dtype=torch.float32)
    products(inp, 2, sync)  # the kernel loaded and chosen
    keep = []
    t = time.perf_counter()
    keep.append(make_buffer(nbytes, cuda))
    first = time.perf_counter() - t
    print(f"first buffer of {nbytes / 1e9:.2f} GB ({'pinned' if cuda else 'plain'}): {first:.3f} s")
    print("| round | buffer alone s | products alone s | products beside a buffer s | that buffer s | slowdown s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in range(a.rounds):
        t = time.perf_counter()
        keep.append(make_buffer(nbytes, cuda))
        alone = time.perf_counter() - t
        base = products(inp, a.products, sync)
        made: list[float] = []

        def beside() -> None:
            if cuda:
                torch.cuda.set_device(dev)
            s = time.perf_counter()
            keep.append(make_buffer(nbytes, cuda))
            made.append(time.perf_counter() - s)

        th = threading.Thread(target=beside)
        sync()
        th.start()
        both = products(inp, a.products, sync)
        th.join(timeout=120)
        print(f"| {r} | {alone:.3f} | {base:.3f} | {both:.3f} | {made[0] if made else float('nan'):.3f} | "
              f"{both - base:+.3f} |", flush=True)
        del keep[1:]


if __name__ == "__main__":
    main()
