"""Where `verify --quality`'s head goes: the logits and figures of both models over the samples, phase by phase.

The 8B Llama-3 head (hidden 4096, vocabulary 128256) with random weights, --samples hidden-state rows of --seq-len
tokens per model in pinned host memory, on one device. Times (seconds over every sample, the device synchronized
around each phase, so the phases add up to more than the unsynchronized whole):

  copy in     both models' hidden states to the device
  head        final norm + lm_head, bf16 (the floor's part: what a forward does)
  float       the logits to float32
  log_softmax over the vocabulary, float32
  kl          kl_div(le, ls, log_target) summed per row, then in float64 (child/backends/evaluate.py)
  argmax      both argmaxes and their agreement
  gather      the next tokens' log-probabilities, float64 sums

and the whole loop as evaluate.py runs it (no synchronization inside), against the head alone.

    python bench/head_probe.py --device cuda
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    heads = [torch.randn(args.vocab, args.hidden, generator=g, dtype=torch.bfloat16).mul_(0.02).to(dev)
             for _ in range(2)]
    norms = [torch.ones(args.hidden, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    pin = dev.type == "cuda"
    states = [torch.randn(1, args.seq_len, args.hidden, generator=g, dtype=torch.bfloat16).pin_memory()
              if pin else torch.randn(1, args.seq_len, args.hidden, generator=g, dtype=torch.bfloat16)
              for _ in range(2 * args.samples)]
    ids = [torch.randint(0, args.vocab, (args.seq_len,), generator=g) for _ in range(args.samples)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def norm_head(h, k):
        v = h.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)
        return torch.nn.functional.linear(norms[k] * v.to(torch.bfloat16), heads[k])[0]

    def loop(clock: dict | None):
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        agree = torch.zeros((), dtype=torch.int64, device=dev)

        def phase(name, fn):
            if clock is None:
                return fn()
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t
            return out

        for j in range(args.samples):
            hs, he = phase("copy in", lambda: [states[2 * j + k].to(dev, non_blocking=True) for k in range(2)])
            zs, ze = phase("head", lambda: (norm_head(hs, 0), norm_head(he, 1)))
            zs, ze = phase("float", lambda: (zs.float(), ze.float()))
            ls, le = phase("log_softmax", lambda: (torch.log_softmax(zs, -1), torch.log_softmax(ze, -1)))
            phase("kl", lambda: sums[0].add_(torch.nn.functional.kl_div(le, ls, log_target=True, reduction="none")
                                             .sum(-1).sum(dtype=torch.float64)))
            phase("argmax", lambda: agree.add_((ls.argmax(-1) == le.argmax(-1)).sum()))
            nxt = ids[j][1:].to(dev)
            phase("gather", lambda: (sums[1].sub_(ls[:-1].gather(-1, nxt[:, None]).sum(dtype=torch.float64)),
                                     sums[2].sub_(le[:-1].gather(-1, nxt[:, None]).sum(dtype=torch.float64))))
        return sums.tolist()

    def head_only():
        for j in range(args.samples):
            for k in range(2):
                norm_head(states[2 * j + k].to(dev, non_blocking=True), k)

    loop(None)  # warm: the allocator's blocks, cuBLAS's handles
    clock: dict = {}
    loop(clock)
    sync()
    t = time.perf_counter()
    loop(None)
    sync()
    whole = time.perf_counter() - t
    t = time.perf_counter()
    head_only()
    sync()
    floor = time.perf_counter() - t
    print(f"{args.samples} samples x {args.seq_len} tokens, vocabulary {args.vocab}, hidden {args.hidden}, "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")
    print("| phase | s (synchronized) |\n| --- | --- |")
    for name, s in clock.items():
        print(f"| {name} | {s:.3f} |")
    print(f"| sum of phases | {sum(clock.values()):.3f} |")
    print(f"whole loop unsynchronized: {whole:.3f} s; norm + lm_head alone (the floor's part): {floor:.3f} s; "
          f"peak allocated {torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == 'cuda' else 0:.2f} GiB")


if __name__ == "__main__":
    main()
