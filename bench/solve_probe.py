"""Where GPTQ's solve goes on one 8B-shaped layer, and would its batches overlap on CUDA streams bit for bit?

llm-compressor 0.14.0.1 solves a layer's modules in batches of equal shape (`assign_batches`): on the Llama-3-8B
shape q/o [2, 4096, 4096], k/v [2, 1024, 4096], gate/up [2, 14336, 4096], down [1, 4096, 14336], one
`quantize_weight` each (Cholesky, inverse, 128-column Triton block updates). This probe runs those four calls on
random weights and random Hessians (X^T X of random bf16 activations, q/k/v sharing one as in a real layer, W4A16's
group-128 scales from each weight's own absmax), first one after another (each timed), then each batch in a thread
of its own on a CUDA stream of its own, and compares every output bit.

    python bench/solve_probe.py --device cuda --tokens 4096
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def hessian(width: int, tokens: int, g: torch.Generator, device) -> torch.Tensor:
    x = torch.randn(tokens, width, generator=g, device=device).to(torch.bfloat16).float()
    return (x.t() @ x).div_(tokens)


def group_scales(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    # [rows, cols] -> [rows, cols / group], symmetric int4: absmax / 7.5 as the library's minmax observer roughly does
    return (w.float().reshape(w.shape[0], -1, group).abs().amax(-1) / 7.5).clamp_min(1e-8).to(w.dtype)


def main() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the random activations behind each Hessian")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--kv", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true",
                    help="then the kernels of one solve of each batch (torch.profiler), and each batch timed again with "
                         "TF32 matmuls allowed (what match_oneshot = false could use), its losses against fp32's")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    h_attn, h_o, h_mlp = (hessian(a.hidden, a.tokens, g, dev) for _ in range(3))
    h_down = hessian(a.intermediate, a.tokens, g, dev)
    w = lambda r, c: (torch.randn(r, c, generator=g, device=dev) * 0.02).to(torch.bfloat16)  # noqa: E731
    batches = {  # name -> (weights [B, rows, cols] bf16, Hessians [B, cols, cols])
        "q,o": ([w(a.hidden, a.hidden), w(a.hidden, a.hidden)], [h_attn, h_o]),
        "k,v": ([w(a.kv, a.hidden), w(a.kv, a.hidden)], [h_attn, h_attn]),
        "gate,up": ([w(a.intermediate, a.hidden), w(a.intermediate, a.hidden)], [h_mlp, h_mlp]),
        "down": ([w(a.hidden, a.intermediate)], [h_down]),
    }
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)

    def solve(name):
        ws, hs = batches[name]
        scale = torch.stack([group_scales(x) for x in ws])
        zp = torch.zeros_like(scale, dtype=torch.int8)
        q, losses, _ = quantize_weight(torch.stack(ws).float(), torch.stack(hs), scale, zp, None, args)
        return q, losses

    print(f"device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for name in batches:  # warm-up: Triton compiles, cuSOLVER loads
        solve(name)
    sync()
    ref, timings = {}, {n: [] for n in batches}
    seq = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for name in batches:
            t = time.perf_counter()
            ref[name] = solve(name)
            sync()
            timings[name].append(time.perf_counter() - t)
        seq.append(time.perf_counter() - t0)
    par, equal = [], True
    for _ in range(a.rounds):
        got = {}
        streams = {n: torch.cuda.Stream(dev) for n in batches} if dev.type == "cuda" else {}

        def run(name):
            if streams:
                with torch.cuda.stream(streams[name]):
                    got[name] = solve(name)
                streams[name].synchronize()
            else:
                got[name] = solve(name)

        sync()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(n,)) for n in sorted(batches, key=lambda n: n != "down")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sync()
        par.append(time.perf_counter() - t0)
        for n in batches:
            equal &= all(torch.equal(x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32),
                                     y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32))
                         for x, y in zip(ref[n], got[n]))
    print("| batch | seconds (min of rounds) |")
    print("| --- | --- |")
    for n, ts in timings.items():
        print(f"| {n} | {min(ts):.3f} |")
    print(f"| all, one after another | {min(seq):.3f} |")
    print(f"| all, a thread and a stream each | {min(par):.3f} |")
    print(f"outputs and losses bit for bit equal across the two ways: {equal}")
    if dev.type == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated(dev) / 2**30:.2f} GiB")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        for name in batches:
            sync()
            with profile(activities=acts) as prof:
                solve(name)
                sync()
            key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
            print(f"\n{name}: kernels, one solve")
            print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            print("| batch | TF32 seconds | fp32 seconds | worst loss TF32 / fp32 |")
            print("| --- | --- | --- | --- |")
            for name in batches:
                times = []
                for _ in range(a.rounds):
                    sync()
                    t = time.perf_counter()
                    q, losses = solve(name)
                    sync()
                    times.append(time.perf_counter() - t)
                ratio = (losses / ref[name][1]).max().item()
                print(f"| {name} | {min(times):.3f} | {min(timings[name]):.3f} | {ratio:.5f} |")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old


if __name__ == "__main__":
    main()
