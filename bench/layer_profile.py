"""Where one decoder layer's quantize stage goes: wall per call, the Python functions (cProfile) and the device
kernels (torch.profiler), for one Llama-3-8B-shaped layer already on the device, as a worker quantizes it.

    python bench/layer_profile.py --device cuda:0 --schemes W4A16,FP8_DYNAMIC
    python bench/layer_profile.py --device cpu --hidden 512 --intermediate 1536    # dry run on a CPU machine
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--schemes", default="W4A16,FP8_DYNAMIC")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--error", action="store_true", help="measure the quantization error as a GPU worker does")
    args = p.parse_args()

    from child.backend import hide_unused

    hide_unused("compressed-tensors")
    import torch
    from transformers import LlamaConfig

    from child import quant_error
    from child.quantize import LayerQuantizer

    quant_error.enabled = args.error
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, num_hidden_layers=1, vocab_size=1024,
                      torch_dtype="bfloat16")
    h, i, d = args.hidden, args.intermediate, args.hidden // args.heads
    shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (args.kv_heads * d, h),
              "self_attn.v_proj.weight": (args.kv_heads * d, h), "self_attn.o_proj.weight": (h, h),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
              "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {f"model.layers.0.{k}": torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
               for k, s in shapes.items()}
    names = list(tensors) + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        for scheme in args.schemes.split(","):
            q = LayerQuantizer(tmp, scheme, ["lm_head"], device=str(device), tensor_names=names)
            walls = []
            for r in range(args.rounds):
                sync()
                t = time.perf_counter()
                out = q.quantize_layer(0, tensors)
                sync()
                walls.append(time.perf_counter() - t)
            print(f"\n== {scheme} on {device}: quantize_layer wall per call (s): "
                  + " ".join(f"{w:.3f}" for w in walls))
            print("   outputs:", json.dumps({k.split("layers.0.")[1]: [str(v.dtype), str(v.device)]
                                             for k, v in list(out.items())[:4]}))
            prof = cProfile.Profile()
            sync()
            prof.enable()
            q.quantize_layer(0, tensors)
            sync()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:4000])
            if device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                    q.quantize_layer(0, tensors)
                    sync()
                print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
                print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
