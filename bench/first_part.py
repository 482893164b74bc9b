"""Two costs of a GPU worker's quantize stage that a steady single-process profile (bench/layer_profile.py) hides:

1. the first part a fresh worker quantizes (0.70-0.78 s on an H200 against 0.08 s for the next ones, 2026-12-01,
   `export_bench.py --per-layer`): where it goes, by cProfile of that first call in a fresh process;
2. the next part copied onto the device while this one is quantized (what child/exporter.py's prefetch thread did
   until 2026-12-01; it now copies after the quantize stage): the quantize call alone, then with another layer's
   mapped tensors copied to the device in a thread at the same time, on the default stream and on a stream of the
   thread's own, the output taken off the GPU as a worker does (child/staging.py).

    python bench/first_part.py --device cuda:0 --scheme W4A16
    python bench/first_part.py --device cpu --hidden 512 --intermediate 1536     # dry run on a CPU machine
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--scheme", default="W4A16")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--error", action="store_true", help="measure the quantization error as a worker does by default")
    args = p.parse_args()

    t0 = time.perf_counter()
    from child.imports import preload

    preload("compressed-tensors")
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from child.backends import quant_error
    from child.backends.quantize import LayerQuantizer

    quant_error.enabled = args.error
    print(f"imports {time.perf_counter() - t0:.2f} s")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)
        sync()
    print(f"device context {time.perf_counter() - t:.2f} s")

    h, i, heads, kv = args.hidden, args.intermediate, 32, 8
    d = h // heads
    shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv * d, h),
              "self_attn.v_proj.weight": (kv * d, h), "self_attn.o_proj.weight": (h, h),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
              "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
                      num_hidden_layers=2, vocab_size=1024, torch_dtype="bfloat16")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        cfg.save_pretrained(tmp)
        path = os.path.join(tmp, "model.safetensors")
        gen = torch.Generator().manual_seed(0)
        save_file({f"model.layers.{n}.{k}": (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
                   for n in (0, 1) for k, s in shapes.items()}, path)
        f = safe_open(path, framework="pt")
        names = list(f.keys()) + ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        mapped = {n: {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"model.layers.{n}.")} for n in (0, 1)}
        for layer in mapped.values():  # the page cache warm, as in export_bench
            for v in layer.values():
                v.sum()
        on_device = {k: v.to(device) for k, v in mapped[0].items()}
        sync()

        t = time.perf_counter()
        q = LayerQuantizer(tmp, args.scheme, ["lm_head"], device=str(device), tensor_names=names)
        print(f"LayerQuantizer() {time.perf_counter() - t:.2f} s")
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        q.quantize_layer(0, on_device)
        sync()
        prof.disable()
        print(f"first quantize_layer: {time.perf_counter() - t:.3f} s")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:5000])

        from child.staging import HostStaging

        staging = HostStaging(str(device))
        device_wide = [False]

        def to_host(tensors: dict) -> dict:
            out = staging.to_host(tensors)
            if device_wide[0]:
                torch.cuda.synchronize(device)  # what the worker's staging did until 2026-12-01
            return out

        qs = LayerQuantizer(tmp, args.scheme, ["lm_head"], device=str(device), tensor_names=names, to_host=to_host)

        def quantize() -> float:  # as a worker's quantize stage: the output in its pinned buffer, its stream synced
            t = time.perf_counter()
            qs.quantize_layer(0, on_device)
            return time.perf_counter() - t

        quantize()
        print("alone, output into the pinned buffer: " + " ".join(f"{quantize():.3f}" for _ in range(args.rounds)))
        if not cuda:
            return

        def copy(stream) -> None:
            with torch.cuda.stream(stream):
                out = {k: v.to(device) for k, v in mapped[1].items()}
            stream.synchronize()
            del out

        for label, own, wide in (("default stream, the device synchronized after the quantize stage", False, True),
                                 ("default stream", False, False), ("a stream of its own", True, False)):
            device_wide[0] = wide
            walls, copies = [], []
            for _ in range(args.rounds):
                stream = torch.cuda.Stream(device) if own else torch.cuda.current_stream(device)
                done = []
                th = threading.Thread(target=lambda: (copy(stream), done.append(time.perf_counter())))
                sync()
                t = time.perf_counter()
                th.start()
                walls.append(quantize())
                th.join()
                copies.append(done[0] - t)
            print(f"with the next layer copied to the device in a thread, {label}: quantize "
                  + " ".join(f"{w:.3f}" for w in walls) + "; the copy " + " ".join(f"{c:.3f}" for c in copies))


if __name__ == "__main__":
    main()
