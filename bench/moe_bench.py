"""A DeepSeek-V3-shaped MoE at real width: `supervisor run` against llm-compressor's `oneshot`, in one run.

Builds a random bf16 DeepseekV3 checkpoint on the machine (hidden 7168, MLA with q_lora_rank 1536 / kv_lora_rank 512,
128 heads, experts of width 2048, 64 routed experts + 1 shared, one dense first layer; 6 layers in all, about 35 GB:
5.6 GB of experts per MoE layer), then, each tool in its own process and sampled by export_bench's TreeSampler:

  supervisor   `supervisor run job.toml --json` (one worker on cuda:0)
  oneshot      from_pretrained(device_map=cuda) + oneshot(QuantizationModifier) + save_pretrained(save_compressed)

and prints: wall, per-layer time (the worker's, per MoE layer; oneshot's quantize time / layers), peak GPU (the
worker's torch allocator per layer, and nvidia-smi for the process tree), peak tree RSS, and whether every tensor
and config.json's quantization_config are equal. The disk of the GPU machine (~60 GB) cannot hold the source and
both FP8 outputs, so each output is reduced to per-tensor digests (dtype, shape, sha256 of the bytes) and deleted
before the next tool runs; everything is deleted at the end (--keep keeps it).

Targets (issue 10): wall <= 0.75x oneshot's; the worker's peak GPU <= 1.5x one MoE layer's bf16 bytes; per-layer
peak RSS and GPU flat (last MoE layer within 5% of the first).

    python bench/moe_bench.py                        # FP8_DYNAMIC on cuda, /tmp/moe-bench
    python bench/moe_bench.py --scheme W4A16
    python bench/moe_bench.py --measure-error false     # without the per-module error measurement
    python bench/moe_bench.py --device cpu --hidden 1024 --moe-intermediate 256 --experts 8 --heads 8 \\
        --q-lora 256 --kv-lora 128 --intermediate 2048 --vocab 4096      # a dry run of the script itself
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import export_bench as eb  # noqa: E402 - the samplers, the oneshot script and the supervisor runner


def build(args, path: str) -> tuple[int, int]:
    """Write the checkpoint (shards of 5 GB); returns (total bytes, bytes of one MoE layer)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, q_lora_rank=args.q_lora, kv_lora_rank=args.kv_lora, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate, n_routed_experts=args.experts, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1, vocab_size=args.vocab,
        tie_word_embeddings=False)
    with torch.device(args.torch_device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # real checkpoints keep it in float32, as the class does
            model.get_submodule(name.rsplit(".", 1)[0]).e_score_correction_bias = buf.float()
    model.save_pretrained(path, max_shard_size="5GB")
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[1].parameters())
    del model
    return eb.output_bytes(path), layer


def digests(folder: str) -> dict[str, tuple[str, list[int], str]]:
    """name -> (dtype, shape, sha256 of the bytes) of every tensor in folder/*.safetensors (read once, no torch)."""
    import struct

    out = {}
    for fn in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(fn, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            base = 8 + n
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]
                                     if kv[0] != "__metadata__" else -1):
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                f.seek(base + start)
                h = hashlib.sha256()
                left = end - start
                while left:
                    chunk = f.read(min(left, 64 << 20))
                    h.update(chunk)
                    left -= len(chunk)
                out[name] = (info["dtype"], info["shape"], h.hexdigest())
    return out


def summary(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config")
    return {"digests": digests(folder), "quantization_config": qcfg, "bytes": eb.output_bytes(folder)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--device", default="cuda", help="the job's [resources] device")
    ap.add_argument("--work", default="/tmp/moe-bench")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--q-lora", type=int, default=1536)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=18432)
    ap.add_argument("--moe-intermediate", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--workers", type=int, default=0,
                    help="[resources] workers (0: the default, two per GPU taking turns on it for layers over 1 GiB)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the outputs")
    ap.add_argument("--measure-error", default=None, type=lambda v: v.lower() in ("1", "true", "yes"),
                    help="[export] measure_error = true|false (default: the job default, on a GPU only)")
    args = ap.parse_args()
    args.torch_device = "cuda" if args.device.startswith("cuda") else "cpu"
    os.makedirs(args.work, exist_ok=True)
    src, ours, ref = (os.path.join(args.work, d) for d in ("src", "ours", "oneshot"))
    for d in (ours, ref):
        shutil.rmtree(d, ignore_errors=True)
    try:
        t = time.perf_counter()
        if not os.path.exists(os.path.join(src, "config.json")):
            size, layer_bytes = build(args, src)
        else:
            size, layer_bytes = eb.output_bytes(src), 0
        print(f"checkpoint: {size / 1e9:.1f} GB, MoE layer {layer_bytes / 1e9:.2f} GB bf16, built in "
              f"{time.perf_counter() - t:.0f}s", flush=True)
        eb.warm(src)

        sup = eb.run_supervisor(args, src, ours, args.work, workers=args.workers)
        written = [e for e in sup["events"] if e["type"] == "LayerWritten" and e["index"] >= 0]
        moe = [e for e in written if e["index"] >= 1]  # layer 0 is the dense one
        ours_summary = summary(ours)
        if not args.keep:
            shutil.rmtree(ours)
        one = eb.run_script(eb.ONESHOT, args, src, ref, eb.IGNORE)
        ref_summary = summary(ref)

        a, b = ours_summary["digests"], ref_summary["digests"]
        differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
        only = sorted(set(a) ^ set(b))
        rows = [
            ("wall s", sup["wall"], one["wall"]),
            ("per MoE layer s", sum(e["seconds"] for e in moe) / max(len(moe), 1), one["quantize"] / args.layers),
            ("peak GPU GiB (allocator)", max(e["peak_gpu"] for e in written) / 2**30, one["peak_gpu"] / 2**30),
            ("peak GPU GiB (nvidia-smi)", sup["tree"].peak_gpu / 2**30, one["tree"].peak_gpu / 2**30),
            ("peak tree RSS GiB", sup["tree"].peak_rss / 2**30, one["tree"].peak_rss / 2**30),
            ("output GB", ours_summary["bytes"] / 1e9, ref_summary["bytes"] / 1e9),
        ]
        print(f"\n{args.scheme} on {args.device}: {args.layers} layers, {args.experts} experts of width "
              f"{args.moe_intermediate}, hidden {args.hidden}")
        print(f"{'':28}{'supervisor':>12}{'oneshot':>12}")
        for name, x, y in rows:
            print(f"{name:28}{x:12.2f}{y:12.2f}")
        print(f"\nwall ratio {sup['wall'] / one['wall']:.2f} (target <= 0.75); worker peak GPU "
              f"{max(e['peak_gpu'] for e in written) / max(layer_bytes, 1):.2f}x one MoE layer (target <= 1.5)")
        print("per layer (index, s, peak RSS GiB, peak GPU GiB): " + ", ".join(
            f"({e['index']}, {e['seconds']:.1f}, {e['peak_rss'] / 2**30:.2f}, {e['peak_gpu'] / 2**30:.2f})"
            for e in written))
        print("supervisor, mean seconds per MoE layer by stage: "
              + ", ".join(f"{k} {v:.2f}" for k, v in eb.mean_stages(moe).items()))
        print("supervisor: " + eb.timeline(sup["events"], sup["wall"]) + f"; imports {sup['imports']:.1f} s, "
              f"{sup['workers']} worker(s), " + ("forked" if sup["forking"] else "spawned"))
        print(f"oneshot: imports {one['startup']:.1f} s, load {one['load']:.1f} s, quantize {one['quantize']:.1f} s, "
              f"save {one['save']:.1f} s")
        print(f"first vs last MoE layer: RSS {moe[-1]['peak_rss'] / moe[0]['peak_rss']:.3f}x, GPU "
              f"{moe[-1]['peak_gpu'] / max(moe[0]['peak_gpu'], 1):.3f}x (target <= 1.05)")
        print(f"tensors: {len(set(a) & set(b))} common, {len(differ)} differ {differ[:5]}, {len(only)} in one only "
              f"{only[:5]}; quantization_config "
              f"{'equal' if ours_summary['quantization_config'] == ref_summary['quantization_config'] else 'differs'}")
    finally:
        if not args.keep:
            for d in (src, ours, ref):
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
