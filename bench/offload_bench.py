"""Release/restore time of an 8B-shaped bf16 model on one GPU, against model.to() and plain pinned copies.

Methods, each for --rounds rounds on the same model:
  release/restore   supervisor.offload with one PinnedPool kept across rounds (round 1 pays for pinning)
  pinned copies     the same bytes copied into pre-pinned host buffers and back into the same GPU tensors:
                    the transfer floor, with no allocation, bookkeeping or freeing
  model.to          model.to("cpu") / model.to(device), what a caller does without this module
Prints one row per method and round (down s, up s, GB/s down/up) and checks that the weights survived.

    python bench/offload_bench.py                  # 32 layers, ~16 GB, well under 5 minutes on an H200
    python bench/offload_bench.py --layers 4       # quick
    python bench/offload_bench.py --device cpu --layers 1 --hidden 256 --intermediate 512 --vocab 1024
                                                   # dry run of this script on a CPU-only machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from supervisor import offload  # noqa: E402
from supervisor.offload import PinnedPool, Released, release, restore  # noqa: E402


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        offload.ACCELERATOR_TYPES = frozenset({"cpu"})  # dry run: exercise the code, the numbers mean nothing
    device = torch.device(args.device)
    started = time.perf_counter()
    model = build(args, device)
    nbytes = model_bytes(model)
    probe = fingerprint(model)
    built = time.perf_counter() - started
    print(f"model: {args.layers} layers, {nbytes / 1e9:.2f} GB bf16 on {device}, built in {built:.1f} s")
    rows = []
    rows += bench_release(model, args.rounds)
    rows += bench_pinned(model, device, args.rounds)
    rows += bench_to(model, device, args.rounds)
    assert all(torch.equal(a, b) for a, b in zip(fingerprint(model), probe)), "weights changed during the bench"
    print_table(rows, nbytes)
    print(f"weights intact after every round; total {time.perf_counter() - started:.1f} s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B shape)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    return parser.parse_args()


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    # Built on the device directly: a 16 GB CPU build plus a move would dominate the bench's run time.
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def bench_release(model, rounds: int) -> list[tuple]:
    pool, rows = PinnedPool(), []
    for r in range(1, rounds + 1):
        handle = release(model, buffers=pool)
        assert isinstance(handle, Released), handle
        freed = sum(handle.freed.values())
        restore(handle)
        rows.append(("release/restore", r, handle.seconds, handle.restore_seconds, f"freed {freed / 1e9:.2f} GB"))
    rows[0] = (*rows[0][:4], f"{rows[0][4]}, pinned={pool.pinned}, pool {pool.capacity / 1e9:.2f} GB")
    pool.close()
    return rows


def bench_pinned(model, device: torch.device, rounds: int) -> list[tuple]:
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.device == device]
    pool = PinnedPool()
    hosts = pool.lease([t.numel() * t.element_size() for t in tensors])  # registered once, outside the timing
    hosts = [h.view(t.dtype).view(t.shape) for h, t in zip(hosts, tensors)]
    rows = []
    with torch.no_grad():
        for r in range(1, rounds + 1):
            down = timed(device, lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hosts, tensors)])
            up = timed(device, lambda: [t.copy_(h, non_blocking=True) for h, t in zip(hosts, tensors)])
            rows.append(("pinned copies", r, down, up, "no alloc/free: the floor"))
    pool.end_lease()
    pool.close()
    return rows


def bench_to(model, device: torch.device, rounds: int) -> list[tuple]:
    rows = []
    for r in range(1, rounds + 1):
        down = timed(device, lambda: model.to("cpu"))
        up = timed(device, lambda: model.to(device))
        rows.append(("model.to", r, down, up, ""))
    return rows


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def fingerprint(model) -> list[torch.Tensor]:
    """CPU copies of a few slices spread over the model, to check the bytes survive every method."""
    params = list(model.parameters())
    return [params[i].detach().flatten()[:4096].cpu().clone() for i in range(0, len(params), max(1, len(params) // 8))]


def print_table(rows: list[tuple], nbytes: int) -> None:
    print(f"{'method':<16} {'round':>5} {'down s':>8} {'up s':>8} {'GB/s down/up':>14}  note")
    for method, r, down, up, note in rows:
        rates = f"{nbytes / down / 1e9:.1f}/{nbytes / up / 1e9:.1f}"
        print(f"{method:<16} {r:>5} {down:>8.3f} {up:>8.3f} {rates:>14}  {note}")


if __name__ == "__main__":
    main()
