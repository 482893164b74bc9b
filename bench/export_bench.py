"""Export an 8B-shaped checkpoint with `supervisor run` and with llm-compressor's whole-model `oneshot`.

Builds a random bf16 Llama checkpoint on disk (Llama-3-8B shape by default), then times, in separate processes:
  supervisor   `supervisor run job.toml --json` (child worker, layer by layer, journaled shards)
  oneshot      AutoModelForCausalLM.from_pretrained + oneshot(QuantizationModifier) + save_pretrained
and prints a table: wall seconds, worker start-up, seconds per layer, peak child RSS, peak GPU memory. Finally it
checks every tensor of the two outputs for equality (torch.equal) and config.json's quantization_config.

    python bench/export_bench.py                          # 32 layers (16 GB), FP8_DYNAMIC, cuda:0
    python bench/export_bench.py --layers 4 --scheme W4A16
    python bench/export_bench.py --layers 4 --scheme W4A16 --no-measure-error   # the error measurement's cost
    python bench/export_bench.py --device cpu --layers 2 --hidden 512 --intermediate 1024 --vocab 1024  # dry run
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SUPERVISOR = os.environ.get("SUPERVISOR_BIN") or os.path.join(os.path.dirname(sys.executable), "supervisor")

ONESHOT = r"""
import json, resource, sys, time, torch
t0 = time.perf_counter()
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, scheme, device = sys.argv[1:5]
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", device_map=device)
t2 = time.perf_counter()
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme,
        ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.shared_expert_gate$"]))
t3 = time.perf_counter()
model.save_pretrained(out, save_compressed=True)
t4 = time.perf_counter()
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print(json.dumps({"imports": t1 - t0, "load": t2 - t1, "quantize": t3 - t2, "save": t4 - t3,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_gpu": gpu}))
"""


def build(args, path: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=32 if args.hidden >= 4096 else 8, num_key_value_heads=8,
                      vocab_size=args.vocab, tie_word_embeddings=False)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    del model
    return size


def run_supervisor(args, src: str, out: str, work: str) -> dict:
    job = os.path.join(work, "job.toml")
    with open(job, "w") as f:
        f.write(f'[source]\npath = "{src}"\n[export]\nscheme = "{args.scheme}"\noutput = "{out}"\n'
                f'measure_error = {str(not args.no_measure_error).lower()}\n[resources]\ndevice = "{args.device}"\n')
    t = time.perf_counter()
    proc = subprocess.run([SUPERVISOR, "run", job, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"supervisor failed: {proc.stderr[-2000:]}")
    events = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    written = [e for e in events if e["type"] == "LayerWritten"]
    layers = [e for e in written if e["index"] >= 0]
    started = next(e for e in events if e["type"] == "WorkerStarted")
    return {"wall": wall, "startup": started["seconds"], "per_layer": sum(e["seconds"] for e in layers) / len(layers),
            "peak_rss": max(e["peak_rss"] for e in written), "peak_gpu": max(e["peak_gpu"] for e in written)}


def run_oneshot(args, src: str, out: str) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", ONESHOT, src, out, args.scheme, args.device], capture_output=True,
                          text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"oneshot failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall"] = wall
    return res


def compare(a: str, b: str) -> str:
    import torch
    from safetensors import safe_open

    def names(d):
        out = {}
        for fn in glob.glob(os.path.join(d, "*.safetensors")):
            with safe_open(fn, "pt") as f:
                out.update({k: fn for k in f.keys()})
        return out

    na, nb = names(a), names(b)
    if set(na) != set(nb):
        return f"DIFFERENT tensor names ({len(set(na) ^ set(nb))} differ)"
    bad = 0
    for k in na:
        with safe_open(na[k], "pt") as fa, safe_open(nb[k], "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad += 1
    qa = json.load(open(os.path.join(a, "config.json")))["quantization_config"]
    qb = json.load(open(os.path.join(b, "config.json")))["quantization_config"]
    return f"{len(na)} tensors, {bad} differ; quantization_config {'equal' if qa == qb else 'DIFFERS'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--workdir", default="/tmp/export-bench")
    ap.add_argument("--no-measure-error", action="store_true",
                    help="[export] measure_error = false: skip the per-module quantization error (its cost)")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    src = os.path.join(args.workdir, "model")
    t = time.perf_counter()
    size = build(args, src)
    print(f"checkpoint: {args.layers} layers, {size / 1e9:.2f} GB bf16, written in {time.perf_counter() - t:.1f} s")
    sup = run_supervisor(args, src, os.path.join(args.workdir, "sup"), args.workdir)
    one = run_oneshot(args, src, os.path.join(args.workdir, "oneshot"))
    gib = 2**30
    print(f"{'tool':<12}{'wall s':>8}{'start-up s':>12}{'s/layer':>9}{'quantize s':>12}{'save s':>8}"
          f"{'peak RSS GiB':>14}{'peak GPU GiB':>14}")
    print(f"{'supervisor':<12}{sup['wall']:>8.1f}{sup['startup']:>12.1f}{sup['per_layer']:>9.2f}{'-':>12}{'-':>8}"
          f"{sup['peak_rss'] / gib:>14.2f}{sup['peak_gpu'] / gib:>14.2f}")
    print(f"{'oneshot':<12}{one['wall']:>8.1f}{one['imports']:>12.1f}{'-':>9}{one['quantize']:>12.1f}"
          f"{one['save']:>8.1f}{one['peak_rss'] / gib:>14.2f}{one['peak_gpu'] / gib:>14.2f}")
    print("outputs:", compare(os.path.join(args.workdir, "sup"), os.path.join(args.workdir, "oneshot")))
    print(f"{args.scheme} on {args.device}; supervisor start-up = spawn to Ready (imports); oneshot start-up = "
          "imports; oneshot load is in its wall time")


if __name__ == "__main__":
    main()
