"""Where one decoder layer's quantize stage goes: wall per call, the Python functions (cProfile) and the device
kernels (torch.profiler), for one Llama-3-8B-shaped layer already on the device, as a worker quantizes it; with
--moe, one DeepSeek-V3-shaped MoE layer (bench/moe_bench.py's shape) read from a safetensors file, as a worker that
takes turns on the GPU gets it (on the host), with its output copied off the GPU as before (`.to("cpu")`) and into
the worker's pinned buffer (child/staging.py), and with its input first copied into pinned memory too.

    python bench/layer_profile.py --device cuda:0 --schemes W4A16,FP8_DYNAMIC
    python bench/layer_profile.py --device cuda:0 --moe --schemes FP8_DYNAMIC
    python bench/layer_profile.py --device cpu --hidden 512 --intermediate 1536    # dry run on a CPU machine
    python bench/layer_profile.py --device cpu --moe --hidden 512 --moe-intermediate 128 --experts 4
"""
from __future__ import annotations

import argparse
import cProfile
import glob
import io
import json
import os
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
    p.add_argument("--moe", action="store_true", help="one DeepSeek-V3-shaped MoE layer instead")
    p.add_argument("--moe-intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args()
    if args.moe:
        return moe(args)

    from child.imports import hide_unused

    hide_unused("compressed-tensors")
    import torch
    from transformers import LlamaConfig

    from child.backends import quant_error
    from child.backends.quantize import LayerQuantizer

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
            walls = timed_calls(lambda: q.quantize_layer(0, tensors), args.rounds, sync)
            out = q.quantize_layer(0, tensors)
            print(f"\n== {scheme} on {device}: quantize_layer wall per call (s): "
                  + " ".join(f"{w:.3f}" for w in walls))
            staged = staged_walls(tmp, scheme, names, tensors, device, args.rounds)
            print(f"== {scheme} on {device}, output into the pinned buffer: wall per call (s): "
                  + " ".join(f"{w:.3f}" for w in staged))
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
                kernels(lambda: q.quantize_layer(0, tensors), sync, 22)


def timed_calls(call, rounds: int, sync) -> list[float]:
    """Seconds of each of `rounds` calls, the device synchronized before and after each."""
    walls = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        call()
        sync()
        walls.append(time.perf_counter() - t)
    return walls


def kernels(call, sync, rows: int) -> None:
    """torch.profiler's tables of one call: by host time, then by device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        call()
        sync()
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))


def staged_walls(config_dir, scheme, names, tensors, device, rounds, input_pinned=None) -> list[float]:
    import torch

    from child.backends.quantize import LayerQuantizer
    from child.staging import HostStaging

    staging = HostStaging(str(device))
    q = LayerQuantizer(config_dir, scheme, ["lm_head"], device=str(device), tensor_names=names,
                       to_host=staging.to_host)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    index = int(next(iter(tensors)).split(".")[2])
    walls = timed_calls(lambda: q.quantize_layer(
        index, input_pinned.to_host(tensors) if input_pinned is not None else tensors), rounds, sync)
    staging.release()
    return walls


def moe(args) -> None:
    """One MoE layer of a DeepseekV3 model (layer 1; layer 0 is dense), written to a safetensors file and read back
    mapped, as a worker's source gives it."""
    from child.imports import hide_unused

    hide_unused("compressed-tensors")
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from child.backends import quant_error
    from child.backends.quantize import LayerQuantizer
    from child.staging import HostStaging

    quant_error.enabled = args.error
    cfg = DeepseekV3Config(
        hidden_size=args.hidden, num_hidden_layers=2, num_attention_heads=128 if args.hidden >= 4096 else 8,
        num_key_value_heads=128 if args.hidden >= 4096 else 8, q_lora_rank=1536 if args.hidden >= 4096 else 256,
        kv_lora_rank=512 if args.hidden >= 4096 else 128, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, intermediate_size=args.intermediate, moe_intermediate_size=args.moe_intermediate,
        n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=min(8, args.experts), n_group=1,
        topk_group=1, first_k_dense_replace=1, vocab_size=1024, tie_word_embeddings=False)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        t = time.perf_counter()
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # real checkpoints keep it in float32
                model.get_submodule(name.rsplit(".", 1)[0]).e_score_correction_bias = buf.float()
        model.save_pretrained(tmp, max_shard_size="5GB")  # the checkpoint's own names (experts one by one)
        del model
        names, tensors = [], {}
        for path in sorted(glob.glob(os.path.join(tmp, "*.safetensors"))):
            f = safe_open(path, framework="pt")
            names += list(f.keys())
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.1.")})
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        print(f"MoE layer: {len(tensors)} tensors, {nbytes / 1e9:.2f} GB, checkpoint written in "
              f"{time.perf_counter() - t:.1f} s")
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        for scheme in args.schemes.split(","):
            q = LayerQuantizer(tmp, scheme, ["lm_head", "re:.*mlp\\.gate$"], device=str(device), tensor_names=names)
            walls = timed_calls(lambda: q.quantize_layer(1, tensors), args.rounds, sync)
            print(f"== MoE {scheme}: mapped input, .to('cpu') output: " + " ".join(f"{w:.2f}" for w in walls))
            staged = staged_walls(tmp, scheme, names, tensors, device, args.rounds)
            print(f"== MoE {scheme}: mapped input, pinned output: " + " ".join(f"{w:.2f}" for w in staged))
            pinned_in = HostStaging(str(device), stage_host=True)
            t = time.perf_counter()
            pinned_in.to_host(tensors)
            first = time.perf_counter() - t
            t = time.perf_counter()
            pinned_in.to_host(tensors)
            print(f"== MoE {scheme}: input into a pinned buffer: first {first:.2f} s (allocation included), "
                  f"then {time.perf_counter() - t:.2f} s")
            staged = staged_walls(tmp, scheme, names, tensors, device, args.rounds, input_pinned=pinned_in)
            print(f"== MoE {scheme}: pinned input (its copy included), pinned output: "
                  + " ".join(f"{w:.2f}" for w in staged))
            given = pinned_in.to_host(tensors)
            staging = HostStaging(str(device))
            q2 = LayerQuantizer(tmp, scheme, ["lm_head", "re:.*mlp\\.gate$"], device=str(device),
                                tensor_names=names, to_host=staging.to_host)
            walls = timed_calls(lambda: q2.quantize_layer(1, given), args.rounds, sync)
            print(f"== MoE {scheme}: pinned input (already there), pinned output: "
                  + " ".join(f"{w:.2f}" for w in walls))
            on_device = {k: v.to(device) for k, v in tensors.items()}
            walls = timed_calls(lambda: q2.quantize_layer(1, on_device), args.rounds, sync)
            print(f"== MoE {scheme}: input on the device, pinned output: " + " ".join(f"{w:.2f}" for w in walls))
            if device.type == "cuda":
                kernels(lambda: q2.quantize_layer(1, given), sync, 15)
            del on_device, given, q, q2
            staging.release()
            pinned_in.release()


if __name__ == "__main__":
    main()
