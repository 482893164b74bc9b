"""Eager attention (what llm-compressor's calibration forces, and so the default export) against SDPA, for one
decoder layer of a given shape: seconds for N samples' forwards, and how far the outputs are apart.

A calibrated layer runs every sample through the layer twice (the forward stage with the hooks, and propagate);
with `[calibration] match_oneshot = false` the attention could use SDPA, a change of rounding only. This probe says
how much time that would save before anyone builds it. One decoder layer of the 8B Llama shape by default, random
weights, bf16, each sample `--tokens` long; the model's own forward (inputs_embeds) so each implementation gets the
mask it asks for (eager: the 4D causal mask; SDPA: none, causal by flag).

    python3 bench/attention_probe.py --device cuda --samples 128
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    device = torch.device(args.device)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=1,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=256,
                         max_position_embeddings=max(args.tokens, 2048), use_cache=False)
    torch.manual_seed(0)
    models = {}
    for impl in ("eager", "sdpa"):
        # a config of its own: the attention reads config._attn_implementation at each forward, and _from_config sets
        # it on the config it is given (one shared config made both models SDPA: the 2026-12-03 H200 run, s23a)
        m = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.bfloat16)
        if models:
            m.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = m.to(device).eval()
    x = torch.randn(args.samples, 1, args.tokens, args.hidden, dtype=torch.bfloat16, device=device) * 0.02
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    outs, rows = {}, []
    with torch.no_grad():
        for impl, m in models.items():
            m.model(inputs_embeds=x[0])  # warm-up: kernels, allocator
            sync()
            t = time.perf_counter()
            last = None
            for j in range(args.samples):
                last = m.model(inputs_embeds=x[j]).last_hidden_state
            sync()
            seconds = time.perf_counter() - t
            outs[impl] = last.float()
            assert m.config._attn_implementation == impl, m.config._attn_implementation
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            rows.append((impl, seconds, seconds / args.samples * 1e3, peak))
    diff = (outs["eager"] - outs["sdpa"]).abs()
    print(f"one decoder layer, hidden {args.hidden}, intermediate {args.intermediate}, {args.heads}/{args.kv_heads} "
          f"heads, {args.samples} samples x {args.tokens} tokens, {device}")
    print("| attention | s for all samples | ms a sample | peak GPU GiB (so far) |")
    print("| --- | --- | --- | --- |")
    for impl, seconds, ms, peak in rows:
        print(f"| {impl} | {seconds:.3f} | {ms:.2f} | {peak:.2f} |")
    print(f"last sample's output: max |eager - sdpa| {diff.max().item():.3g}, mean {diff.mean().item():.3g} "
          f"(mean |output| {outs['eager'].abs().mean().item():.3g})")
    print(f"a layer's two passes would save ~{2 * (rows[0][1] - rows[1][1]):.3f} s")


if __name__ == "__main__":
    main()
