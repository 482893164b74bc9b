"""How fast can AWQ's attention search be and keep oneshot's bits? The floor of one eager attention pass, measured.

llm-compressor's AWQ runs the attention's parent (`self_attn`, eager as its calibration context forces) over every
sample for each of its 20 grid points and the unscaled reference: 21 passes a layer. Eager attention materialises
its rounding: `bf16(q @ k^T)` from cuBLAS, then `* scaling` and `+ mask` each rounded to bf16, the softmax in fp32,
the probabilities rounded to bf16, and `P @ V` from cuBLAS. A pass that keeps those bits must keep the two products
(their accumulation order is cuBLAS's) and at the least read the scores once and write the probabilities once in
between. This probe times, over the same samples through one `LlamaAttention` of the given shape:

  eager          transformers' eager attention (what the library's search runs)
  fused          the product's `child/backends/eager_attention.fused_eager_attention`: the same products, and
                 between them the scaling, mask, PyTorch's fp32 warp softmax and the cast in one kernel for rows of
                 up to 2048 (child/backends/warp_softmax.py), else the scaling, mask and upcast fused by Inductor
                 before PyTorch's softmax; bits checked
  half-to-float  the softmax reading the bf16 scores itself (`torch._softmax(x, -1, half_to_float=True)`, CUDA only);
                 bits checked (its reduction may be laid out differently from the fp32 kernel's)
  floor          the products, and between them one pass that reads the scores and writes bf16 probabilities
                 (`S.neg()`: the traffic of a perfect fused scale + mask + softmax + cast kernel, not its values)
  sdpa           the fused kernel (other rounding: the match_oneshot = false path), for reference

and prints each pass's seconds, whether its output equals eager's bit for bit, and what a layer of the default AWQ
would take if every attention pass of its search ran at that speed (from a measured layer and wall: `--layer-s`,
`--wall-s`, `--oneshot-wall-s`, `--layers`; the defaults are the twenty-seventh session's H100 run, s27d).

    python bench/attention_floor_probe.py                                  # the 8B shape, 128 x 2048, cuda
    python bench/attention_floor_probe.py --device cpu --hidden 256 --heads 4 --kv-heads 2 --samples 2 --seq-len 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: child.backends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="timed passes of each variant (the fastest is kept)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--passes", type=int, default=21, help="attention passes in one layer's search (20 points + 1)")
    ap.add_argument("--layer-s", type=float, default=12.0, help="a measured steady layer of the default AWQ, s")
    ap.add_argument("--wall-s", type=float, default=101.8, help="the measured wall of the default AWQ run, s")
    ap.add_argument("--oneshot-wall-s", type=float, default=121.6, help="oneshot's wall on the same job, s")
    ap.add_argument("--layers", type=int, default=8, help="layers in that run")
    args = ap.parse_args()

    import torch
    from transformers import AttentionInterface, LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, repeat_kv

    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    def tail(module, probs, value):
        out = torch.matmul(probs, repeat_kv(value, module.num_key_value_groups))
        return out.transpose(1, 2).contiguous(), probs

    def scores_of(module, query, key):
        return torch.matmul(query, repeat_kv(key, module.num_key_value_groups).transpose(2, 3))

    def half_to_float(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        x = scores_of(module, query, key) * scaling + attention_mask
        return tail(module, torch._softmax(x, -1, True).to(query.dtype), value)

    def floor(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return tail(module, scores_of(module, query, key).neg(), value)

    from child.backends.eager_attention import fused_eager_attention  # compared with eager at its first call

    for name, fn in (("fused", fused_eager_attention), ("half-to-float", half_to_float), ("floor", floor)):
        AttentionInterface.register(name, fn)
    AttentionInterface.register("sdpa-reference", sdpa_attention_forward)

    cfg = LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=4 * args.hidden)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        attn = LlamaAttention(cfg, 0).to(torch.bfloat16).eval()
        for prm in attn.parameters():
            prm.data.normal_(0, 0.02)
        xs = [torch.randn(1, args.seq_len, args.hidden, dtype=torch.bfloat16) for _ in range(args.samples)]
        pos = torch.arange(args.seq_len).unsqueeze(0)
        emb = LlamaRotaryEmbedding(cfg)(xs[0], pos)
        # the 4D mask transformers gives eager attention: 0 where attended, the dtype's minimum elsewhere
        mask = torch.full((1, 1, args.seq_len, args.seq_len), torch.finfo(torch.bfloat16).min,
                          dtype=torch.bfloat16).triu(1)

    def run(impl: str) -> list:
        cfg._attn_implementation = impl
        return [attn(x, position_embeddings=emb, attention_mask=mask)[0] for x in xs]

    variants = ["eager", "fused", "half-to-float", "floor", "sdpa-reference"]
    rows, reference = [], None
    with torch.no_grad():
        for impl in variants:
            try:
                t = time.perf_counter()
                outs = run(impl)  # first use: kernels loaded or compiled, memory cached
                sync()
                first = time.perf_counter() - t
            except Exception as exc:  # half-to-float on a CPU, or where the build refuses it
                rows.append((impl, None, None, f"not run: {str(exc).splitlines()[0][:90]}"))
                continue
            best = float("inf")
            for _ in range(args.rounds):
                sync()
                t = time.perf_counter()
                outs = run(impl)
                sync()
                best = min(best, time.perf_counter() - t)
            if reference is None:
                reference = outs
                equal = "(reference)"
            elif impl == "floor":
                equal = "n/a (traffic only)"
            else:
                differ = sum(not torch.equal(a, b) for a, b in zip(reference, outs))
                equal = "yes" if differ == 0 else f"no: {differ} of {len(outs)} samples differ"
            rows.append((impl, best, first, equal))
            del outs

    eager = rows[0][1]
    print(f"\nattention passes: {args.samples} samples x {args.seq_len}, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} kv), {device}, {torch.cuda.get_device_name(device) if cuda else 'cpu'}; "
          f"fastest of {args.rounds}")
    print("\n| attention | pass s | first pass s | output equals eager's | layer s at this pass | wall s | x oneshot |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for impl, secs, first, equal in rows:
        if secs is None:
            print(f"| {impl} | | | {equal} | | | |")
            continue
        saved = args.passes * (eager - secs)  # a layer's search runs the attention's parent this many times
        layer = args.layer_s - saved
        wall = args.wall_s - args.layers * saved
        print(f"| {impl} | {secs:.3f} | {first:.2f} | {equal} | {layer:.2f} | {wall:.1f} | "
              f"{wall / args.oneshot_wall_s:.3f} |")
    from child.backends import eager_attention, warp_softmax

    kinds = sorted({call[-1][0] for call in eager_attention._checked})
    print(f"\nfused: the path its calls took: {kinds}; one-kernel softmax: "
          f"{warp_softmax.available() or 'available'}; fusion off: {eager_attention._state['off']}")
    print(f"\n(layer and wall: the measured {args.layer_s} s layer and {args.wall_s} s wall less {args.passes} passes "
          f"a layer at the row's speed instead of eager's; x oneshot against {args.oneshot_wall_s} s)")


if __name__ == "__main__":
    main()
