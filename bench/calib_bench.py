"""GPTQ side by side: `supervisor run` (layerwise, calibrated) against llm-compressor's `oneshot` sequential pipeline.

Builds a random bf16 Llama checkpoint (Llama-3-8B shape by default) and a calibration set of random token ids
(128 samples x 2048 tokens), warms the page cache and the import caches, then runs each tool in its own process,
sampling that process's whole tree (psutil RSS, nvidia-smi GPU memory; bench/export_bench.py's TreeSampler):

  supervisor   `supervisor run job.toml --json`: method = "gptq", [calibration] over the JSONL file
  oneshot      from_pretrained on CPU (bf16) + oneshot(GPTQModifier, the same rows, shuffle off; its sequential
               pipeline onloads one layer at a time to the GPU) + save_pretrained(save_compressed=True)

Both pin torch's thread count to --threads. It prints one table (wall, start-up, per layer, peak GPU allocated
and as nvidia-smi sees the tree, peak tree RSS), checks every tensor and config.json for equality, and measures
what a crash costs: the worker SIGKILLed while calibrating layer --kill-at (a) retried inside the same run, and
(b) with no retries left, followed by a second `supervisor run` (restart and imports included); each is reported
as seconds beyond the uninterrupted run and in units of one layer's time.

    python bench/calib_bench.py                               # 32 layers, 128 x 2048, W4A16, cuda
    python bench/calib_bench.py --layers 4 --samples 16 --seq-len 256 --skip kill     # a quick check
    python bench/calib_bench.py --device cpu --world 2 --threads 1 ...   # ours on a group of 2 ranks (and W = 1)

`--world W` (W > 1): ours runs on a group of W ranks (`resources.workers = W`; on GPUs `device = "cuda"`, one rank
per GPU) and, unless `--skip w1`, once more with W = 1 for the ratio; a second table gives, per rank, the mean
seconds per layer of each calibration stage (forward, calibrate, reduce, solve, broadcast, propagate, quantize, from
the journal's `ranks`) and the wait for the slowest rank (the group's time per layer less the rank's own stages).

In pieces (each under 10 minutes on one H200): `--skip oneshot,kill,retry` first (builds, runs ours, saves its
figures), then `--keep --skip supervisor,...` runs the others against the saved uninterrupted run and outputs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from export_bench import (IGNORE, SUPERVISOR, add_shape_args, build, compare, disk_write_speed,  # noqa: E402
                          mean_stages, private_runtime, stop_warm, timed, timeline, warm)

WARM_GPTQ = r"""
import sys, torch
from compressed_tensors.quantization import preset_name_to_scheme
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
d, scheme = torch.device(sys.argv[1]), sys.argv[2]
args = preset_name_to_scheme(scheme, ["Linear"]).weights
for batch in (1, 2):
    w = torch.randn(batch, 512, 1024, device=d) * 0.02
    x = torch.randn(batch, 2048, 1024, device=d)
    h = x.transpose(1, 2) @ x / 2048
    group = args.group_size or 128
    scale = (w.reshape(batch, 512, -1, group).abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    if getattr(args.strategy, "value", args.strategy) != "group":
        scale = scale.amax(-1, keepdim=True)
    quantize_weight(w, h, scale, torch.zeros_like(scale, dtype=torch.int8), None, args)
torch.cuda.synchronize()
"""


def warm_gptq(scheme: str, device: str) -> None:
    """GPTQ's compiled kernels (the library's Triton block update, cached on disk by Triton): compiled here, so the
    first tool of a fresh machine (ours) does not pay the compile the second then finds in the cache."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WARM_GPTQ, device, scheme], capture_output=True, text=True)
    print(f"GPTQ kernels warmed ({scheme}) in {time.perf_counter() - t:.1f} s"
          + ("" if r.returncode == 0 else f": FAILED {r.stderr[-500:]}"), flush=True)


ONESHOT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
src, out, scheme, data, seq_len, threads, ignore, method = sys.argv[1:9]
torch.set_num_threads(int(threads))
if method == "gptq":
    recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=json.loads(ignore))
elif method == "awq":
    recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme=scheme, ignore=json.loads(ignore))]
else:  # static activation scales (NVFP4, FP8): observers over the samples
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=json.loads(ignore))
rows = [json.loads(line)["input_ids"] for line in open(data)]
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)  # on CPU, as oneshot users load it
t2 = time.perf_counter()
oneshot(model=model, processor=AutoTokenizer.from_pretrained(src),
        dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}),
        recipe=recipe, num_calibration_samples=len(rows), max_seq_length=int(seq_len), shuffle_calibration_samples=False)
t3 = time.perf_counter()
model.save_pretrained(out, save_compressed=True)
t4 = time.perf_counter()
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
res = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0
print(json.dumps({"startup": t1 - t0, "load": t2 - t1, "gptq": t3 - t2, "save": t4 - t3, "peak_gpu": gpu,
                  "peak_reserved": res}))
"""


class _Tree:
    def __init__(self, peak_rss: int, peak_gpu: int):
        self.peak_rss, self.peak_gpu = peak_rss, peak_gpu


def write_dataset(path: str, samples: int, seq_len: int, vocab: int, seed: int = 1234) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, seq_len), generator=g)
    with open(path, "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    return path


def save_tokenizer(path: str, vocab: int) -> None:
    # oneshot refuses a dataset without a processor, even of token ids; a word-level one needs no download
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2").save_pretrained(path)


def write_job(args, path: str, src: str, out: str, data: str, calibration: dict | None = None, **resources) -> str:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in resources.items())
    more = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (calibration or {}).items())
    with open(path, "w") as f:
        f.write(f'[source]\npath = "{src}"\n[export]\nscheme = "{args.scheme}"\nmethod = "{args.method}"\n'
                f'output = "{out}"\n[resources]\ndevice = "{args.device}"\ntorch_threads = {args.threads}\n{extra}'
                f'[calibration]\ndataset = "{data}"\nsamples = {args.samples}\nseq_len = {args.seq_len}\n{more}')
    return path


def world_resources(args, world: int) -> dict:
    """The job keys that give a group of `world` ranks (1: one worker)."""
    if args.device == "cpu":
        return {"workers": world}
    return {"workers": world} if world > 1 else {}


def run_supervisor(args, src: str, data: str, name: str, env: dict | None = None, check: bool = True,
                   code: str | None = None, calibration: dict | None = None, **resources) -> dict:
    """`code`: another checkout (e.g. the commit before a change) whose code runs instead, for a before/after pair."""
    out = os.path.join(args.workdir, name)
    world = resources.pop("world", args.world)
    resources = {**world_resources(args, world), **resources}
    job = write_job(args, os.path.join(args.workdir, f"job-{name}.toml"), src, out, data, calibration, **resources)
    full_env = dict(os.environ)
    full_env.pop("SUPERVISOR_TEST_FAULT", None)
    full_env.update(env or {})
    peaks = os.path.join(args.workdir, f"peaks-{name}.jsonl")
    if args.stage_peaks:  # each layer's peak GPU memory so far as each stage ends (child/faults.py)
        full_env["SUPERVISOR_BENCH_STAGE_PEAKS"] = peaks
        if os.path.exists(peaks):
            os.remove(peaks)
    traced = os.path.join(args.workdir, f"rss-{name}.jsonl")
    if args.rss_trace:  # where each layer's host memory peaked, and what the worker's threads did then (faults.py)
        full_env["SUPERVISOR_BENCH_RSS_TRACE"] = traced
        if os.path.exists(traced):
            os.remove(traced)
    if code is not None:  # its code first, this checkout's not at all (`python -m` also puts the cwd first: cwd)
        keep = [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
        full_env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(code), *keep])
    proc, wall, tree = timed([SUPERVISOR, "run", job, "--json"], full_env, cwd=code)
    if check and proc.returncode != 0:
        sys.exit(f"supervisor failed: {proc.stderr[-3000:]}")
    events = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    layers = [e for e in events if e["type"] == "LayerWritten" and e["index"] >= 0]
    first = min((e["t"] for e in events if e["type"] == "LayerStarted"), default=0.0)
    pool = next((e for e in events if e["type"] == "PoolStarted"), {})
    # the worker logs' lines on eager attention's fused prefix (child/backends/eager_attention.py) and the graphed
    # passes (child/backends/graphed_pass.py)
    logged = set()
    for log in sorted(glob.glob(os.path.join(out, ".export", "logs", "worker-*.log"))):
        for x in open(log, errors="replace"):
            for prefix in ("fused attention:", "graphed passes:"):
                if prefix in x:
                    logged.add(x[x.index(prefix):].strip())
    return {"wall": wall, "startup": first, "events": events, "rc": proc.returncode, "stderr": proc.stderr,
            "logged": sorted(logged),
            "reused": pool.get("reused", False),
            "stages": mean_stages(layers),
            "per_layer": sum(e["seconds"] for e in layers) / max(len(layers), 1), "layers": layers,
            "peak_gpu": max((e["peak_gpu"] for e in layers), default=0), "tree": tree, "out": out, "world": world,
            "peaks": [json.loads(x) for x in open(peaks)] if os.path.exists(peaks) else [],
            "rss": [json.loads(x) for x in open(traced)] if os.path.exists(traced) else []}


def rss_table(sup: dict, top: int = 3) -> list[str]:
    """Per part: its peak RSS (LayerWritten.peak_rss, VmHWM from its request to its reply) and the `top` largest
    host-memory samples of the trace (--rss-trace) in that window, each with RssAnon / RssFile / RssShmem and what
    the worker's threads were doing (main: the main loop's stage; ahead: the layer started ahead's; read-ahead: the
    next part's copy onto the GPU)."""
    gib, hwm = 2**30, {e["index"]: e["peak_rss"] for e in sup["layers"]}
    lines = ["| part | peak RSS | traced: total (anon / file / shmem) GiB, what the threads did |", "| --- | --- | --- |"]
    for p in sup.get("rss", []):
        cells = [f"{t / gib:.3f} ({a / gib:.3f} / {f / gib:.3f} / {s / gib:.3f}) "
                 + ", ".join(f"{k}: {v}" for k, v in sorted(doing.items()))
                 for t, a, f, s, doing in p["peaks"][:top]]
        lines.append(f"| {p['index']} | {hwm.get(p['index'], 0) / gib:.3f} | " + "<br>".join(cells) + " |")
    if sup.get("rss") and sup["rss"][-1].get("files"):
        lines.append("\nthe file mappings with the most resident pages as the last part ended (MiB): "
                     + ", ".join(f"{os.path.basename(p)} {n / 2**20:.1f}" for p, n in sup["rss"][-1]["files"]))
    return lines if len(lines) > 2 else []


def peak_table(sup: dict) -> list[str]:
    """Per layer: its peak GPU memory allocated so far as each calibration stage last ended (GiB), the layer's own
    peak (LayerWritten.peak_gpu: until its reply), and the stage in which it was first reached, in the order the
    stages ran ("after": the write, beside which the next layer is read ahead onto the GPU)."""
    gib, whole = 2**30, {e["index"]: e["peak_gpu"] for e in sup["layers"]}
    logged = sup.get("peaks", [])
    stages = [k for k in CLOCK if any(k == s for p in logged for s, _ in p["peaks"])]
    lines = ["| layer | " + " | ".join(stages) + " | layer's peak | reached in |",
             "| --- | " + " | ".join("---" for _ in stages) + " | --- | --- |"]
    for p in logged:
        top, last = whole.get(p["index"], 0), dict(p["peaks"])
        where = next((s for s, v in p["peaks"] if v >= top), "after")
        lines.append(f"| {p['index']} | " + " | ".join(f"{last[k] / gib:.4f}" if k in last else "" for k in stages)
                     + f" | {top / gib:.4f} | {where} |")
    return lines if len(lines) > 2 else []


def fidelity(default: dict, fast: dict) -> str:
    """match_oneshot = false against the default, by GPTQ's own losses (LayerWritten.losses): layer 0's worst module
    and every layer's total, as ratios (docs/fidelity.md's bounds: 0.5%, 1%)."""
    a = {k: v for e in default["layers"] for k, v in e.get("losses", {}).items()}
    b = {k: v for e in fast["layers"] for k, v in e.get("losses", {}).items()}
    if not a or a.keys() != b.keys():
        return ""
    first = [abs(b[k] / a[k] - 1) for k in a if ".layers.0." in k and a[k]]
    totals = []
    for e in default["layers"]:
        ks = [k for k in a if f".layers.{e['index']}." in k]
        totals.append(sum(b[k] for k in ks) / max(sum(a[k] for k in ks), 1e-30))
    return (f"match_oneshot = false vs default: layer 0 worst module {100 * max(first, default=0):.3f}%; layer totals "
            + " ".join(f"{t:.5f}" for t in totals))


# the calibrated stages (LayerWritten.ranks); layer 0's inputs first: the embedding table read onto the device, then
# every sample through it (child/backends/calibrate.py _first_inputs); setup: the layer onto the device, its session
# onto-device: a layer started ahead (child/ahead.py) waiting for the read-ahead's copy of it onto the GPU
CLOCK = ["embed-read", "embed", "onto-device", "setup", "forward", "calibrate", "solve", "propagate", "quantize"]
# the worker's own (LayerWritten.stages); ahead: how long before its request the layer started (child/ahead.py)
PART = ["ahead", "read", "inputs", "error", "save", "hash", "sync", "boundary", "cleanup"]


def stage_clock(sup: dict) -> list[str]:
    """Per layer: its seconds, each stage's (the calibration stages of rank 0, then the worker's), peak GPU and RSS."""
    gib = 2**30
    lines = ["| layer | s | " + " | ".join(CLOCK + PART) + " | peak GPU GiB | peak RSS GiB |",
             "| --- | --- | " + " | ".join("---" for _ in CLOCK + PART) + " | --- | --- |"]
    rows = []
    for e in sup["layers"]:
        own = e.get("ranks", {}).get("0", {})
        rows.append([e["seconds"], *(own.get(k, 0.0) for k in CLOCK), *(e["stages"].get(k, 0.0) for k in PART),
                     e["peak_gpu"] / gib, e["peak_rss"] / gib])
        lines.append(f"| {e['index']} | " + " | ".join(f"{v:.3f}" for v in rows[-1][:-2])
                     + f" | {rows[-1][-2]:.2f} | {rows[-1][-1]:.2f} |")
    if rows:
        mean = [sum(col) / len(rows) for col in zip(*rows)]
        lines.append("| mean | " + " | ".join(f"{v:.3f}" for v in mean[:-2]) + f" | {max(r[-2] for r in rows):.2f} "
                     f"(max) | {max(r[-1] for r in rows):.2f} (max) |")
    return lines


def rank_table(sup: dict) -> list[str]:
    """Per rank: mean seconds per layer of each calibration stage, and the wait for the slowest rank."""
    layers = [e for e in sup["layers"] if e.get("ranks")]
    if not layers:
        return []
    stages = ["forward", "calibrate", "reduce", "solve", "broadcast", "propagate", "quantize"]
    ranks = sorted({r for e in layers for r in e["ranks"]}, key=int)
    lines = ["| rank | " + " | ".join(stages) + " | wait for the slowest | layer s |",
             "| --- | " + " | ".join("---" for _ in stages) + " | --- | --- |"]
    for r in ranks:
        own = [e["ranks"].get(r, {}) for e in layers]
        mean = {k: sum(o.get(k, 0.0) for o in own) / len(own) for k in stages}
        # a rank's own work leaves out the collectives, in which it also waits for the others
        busy = [sum(v for k, v in o.items() if k not in ("reduce", "broadcast")) for o in own]
        group = [max(sum(x.values()) for x in e["ranks"].values()) for e in layers]  # the slowest rank's layer
        wait = sum(g - b for g, b in zip(group, busy)) / len(own)
        lines.append(f"| {r} | " + " | ".join(f"{mean[k]:.3f}" for k in stages)
                     + f" | {wait:.3f} | {sum(e['seconds'] for e in layers) / len(layers):.2f} |")
    return lines


def run_oneshot(args, src: str, data: str) -> dict:
    out = os.path.join(args.workdir, "oneshot")
    proc, wall, tree = timed([sys.executable, "-c", ONESHOT, src, out, args.scheme, data, str(args.seq_len),
                              str(args.threads), json.dumps(IGNORE), args.method])
    if proc.returncode != 0:
        sys.exit(f"oneshot failed: {proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(wall=wall, tree=tree, out=out, per_layer=res["gptq"] / args.layers)
    return res


def run_dist_oneshot(args, src: str, data: str) -> dict:
    """llm-compressor's distributed oneshot at the same W, its documented recipe (tests/ref_dist.py under torchrun:
    init_dist, load_offloaded_model, device_map="auto_offload"), as released (no fixes: the timing a user gets)."""
    out = os.path.join(args.workdir, "oneshot-dist")
    ref = os.path.join(HERE, "..", "tests", "ref_dist.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.world}", ref, "--model", src,
           "--dataset", data, "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--scheme",
           args.scheme, "--method", "gptq", "--out", out, "--threads", str(args.threads)]
    proc, wall, tree = timed(cmd, dict(os.environ, PYTHONPATH=os.path.join(HERE, "..")))
    if proc.returncode != 0:
        sys.exit(f"distributed oneshot failed: {proc.stderr[-3000:]}")
    return {"wall": wall, "tree": tree, "out": out, "startup": 0.0, "load": 0.0,
            "per_layer": float("nan"), "peak_gpu": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--scheme", default="W4A16")
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq", "rtn"],
                    help="both tools' recipe: GPTQ, AWQ + QuantizationModifier, or QuantizationModifier alone "
                         "(static activation scales: NVFP4, FP8)")
    ap.add_argument("--fast", action="store_true",
                    help="also run ours with [calibration] match_oneshot = false (GPTQ's Hessians on tensor cores)")
    ap.add_argument("--before", default=None, metavar="TREE",
                    help="also run ours from another checkout (the code before a change), as the first row (with "
                         "--fast, its match_oneshot = false as well)")
    ap.add_argument("--device", default="cuda:0", help="the job's resources.device")
    ap.add_argument("--sync-stages", action="store_true",
                    help="every worker waits for its GPU at each stage change (SUPERVISOR_BENCH_SYNC_STAGES): each "
                         "stage's seconds are its own kernels'; a tree before it ignores the setting")
    ap.add_argument("--stage-peaks", action="store_true",
                    help="print each layer's peak GPU memory as each stage ended (SUPERVISOR_BENCH_STAGE_PEAKS): "
                         "the stage in which the peak is reached; a tree before it ignores the setting")
    ap.add_argument("--rss-trace", action="store_true",
                    help="print where each part's host memory peaked and what the worker's threads did then "
                         "(SUPERVISOR_BENCH_RSS_TRACE); a tree before it ignores the setting")
    ap.add_argument("--no-ahead-too", nargs="?", const="after", choices=["after", "first"], default=None,
                    help="also run ours with no calibrated layer started ahead (SUPERVISOR_BENCH_NO_AHEAD=1), the "
                         "same code otherwise: after ours, or (=first) before every other run")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both tools")
    ap.add_argument("--kill-at", type=int, default=20, help="the layer whose calibration the kill interrupts")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "calib-bench"))
    ap.add_argument("--skip", default="", help="comma-separated: supervisor,oneshot,kill,retry,w1,dist; default (with --fast: only "
                         "match_oneshot = false runs, in the default's place)")
    ap.add_argument("--world", type=int, default=1, help="ranks of the group that calibrates each layer (ours)")
    ap.add_argument("--keep", action="store_true", help="reuse the workdir's checkpoint, dataset and saved run")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoint and dataset, then stop")
    args = ap.parse_args()
    if args.sync_stages:
        os.environ["SUPERVISOR_BENCH_SYNC_STAGES"] = "1"
    args.torch_device = "cpu" if args.device == "cpu" else "cuda:0"
    skip = set(filter(None, args.skip.split(",")))
    src, data = os.path.join(args.workdir, "model"), os.path.join(args.workdir, "calib.jsonl")
    if not (args.keep and os.path.exists(os.path.join(src, "config.json")) and os.path.exists(data)):
        shutil.rmtree(args.workdir, ignore_errors=True)
        os.makedirs(args.workdir)
        t = time.perf_counter()
        size = build(args, src)
        save_tokenizer(src, args.vocab)
        write_dataset(data, args.samples, args.seq_len, args.vocab)
        print(f"checkpoint: {args.layers} layers, {size / 1e9:.2f} GB bf16; calibration {args.samples} x "
              f"{args.seq_len} random ids; built in {time.perf_counter() - t:.1f} s")
        print(f"disk: {disk_write_speed(args.workdir):.2f} GB/s write+fsync in {args.workdir}")
    if args.build_only:
        return
    warm(src, device=args.device)
    if args.method == "gptq" and args.device.startswith("cuda"):
        warm_gptq(args.scheme, args.device)
    private_runtime(args.workdir)  # kept warm parents of this bench only; each tool's first run is cold

    gib = 2**30
    rows = []
    saved = os.path.join(args.workdir, "supervisor.json")

    def no_ahead() -> dict:
        return run_supervisor(args, src, data, "sup-no-ahead", env={"SUPERVISOR_BENCH_NO_AHEAD": "1"}, keep_warm=0)

    na = no_ahead() if args.no_ahead_too == "first" else None  # whether being the first run is what differs
    if "supervisor" in skip:
        with open(saved) as f:
            sup = json.load(f)
        sup["tree"] = _Tree(**sup["tree"])
        print(f"uninterrupted supervisor run: from {saved}")
    elif "default" in skip and args.fast:  # match_oneshot = false alone, in the default's place (no fidelity lines)
        sup = run_supervisor(args, src, data, "sup-fast", keep_warm=0, calibration={"match_oneshot": False})
        args.fast = False
        print("ours below: match_oneshot = false (--skip default)")
    else:
        sup = run_supervisor(args, src, data, "sup", keep_warm=0)
        with open(saved, "w") as f:
            json.dump({**{k: v for k, v in sup.items() if k != "tree"},
                       "tree": {"peak_rss": sup["tree"].peak_rss, "peak_gpu": sup["tree"].peak_gpu}}, f)
    print(f"supervisor (W = {sup.get('world', 1)}): wall {sup['wall']:.1f} s, start-up {sup['startup']:.1f} s, "
          f"{sup['per_layer']:.2f} s per layer; " + timeline(sup["events"], sup["wall"]), flush=True)
    rows.append((f"supervisor W={sup.get('world', 1)}", sup))
    print("stage clock (seconds per layer; calibration stages of rank 0, then the worker's):\n"
          + "\n".join(stage_clock(sup)), flush=True)
    if peak_table(sup):
        print("peak GPU GiB allocated as each stage ended:\n" + "\n".join(peak_table(sup)), flush=True)
    if rss_table(sup):
        print("where each part's host memory peaked:\n" + "\n".join(rss_table(sup)), flush=True)
    if args.no_ahead_too:
        na = na or no_ahead()
        rows.append(("supervisor, no layer ahead", na))
        print(f"supervisor, no layer ahead: wall {na['wall']:.1f} s, start-up {na['startup']:.1f} s, "
              f"{na['per_layer']:.2f} s per layer; " + timeline(na["events"], na["wall"]), flush=True)
        print("stage clock, no layer ahead:\n" + "\n".join(stage_clock(na)), flush=True)
        if rss_table(na):
            print("where each part's host memory peaked, no layer ahead:\n" + "\n".join(rss_table(na)), flush=True)
        print(f"supervisor no layer ahead / with: tensors: {compare(na['out'], sup['out'])}", flush=True)
    if args.world > 1 and "w1" not in skip:
        w1 = run_supervisor(args, src, data, "sup-w1", keep_warm=0, world=1)
        rows.append(("supervisor W=1", w1))
        print(f"wall W = {args.world} / W = 1: {sup['wall'] / w1['wall']:.3f} (target on GPUs: at most "
              f"{1.2 / args.world:.3f}); work after start-up: "
              f"{(sup['wall'] - sup['startup']) / max(w1['wall'] - w1['startup'], 1e-9):.3f}")
    one = None
    if "oneshot" not in skip:
        one = run_oneshot(args, src, data)
        rows.append(("oneshot", one))
        print(f"oneshot: wall {one['wall']:.1f} s; ours / oneshot {sup['wall'] / one['wall']:.3f}; tensors: "
              f"{compare(sup['out'], one['out'])}", flush=True)
    if args.fast:
        fast = run_supervisor(args, src, data, "sup-fast", keep_warm=0, calibration={"match_oneshot": False})
        print(f"supervisor match_oneshot = false: wall {fast['wall']:.1f} s, {fast['per_layer']:.2f} s per layer"
              + (f"; / oneshot {fast['wall'] / one['wall']:.3f}; tensors: {compare(fast['out'], one['out'])}"
                 if one else ""), flush=True)
        rows.append(("supervisor match_oneshot = false", fast))
        print("stage clock, match_oneshot = false:\n" + "\n".join(stage_clock(fast)), flush=True)
        losses = fidelity(sup, fast)
        if losses:
            print(losses, flush=True)
    if args.before:  # last: the run that matters most comes first when the time is short
        before = run_supervisor(args, src, data, "sup-before", keep_warm=0, code=args.before)
        print(f"supervisor before ({args.before}): wall {before['wall']:.1f} s, start-up {before['startup']:.1f} s, "
              f"{before['per_layer']:.2f} s per layer; " + timeline(before["events"], before["wall"]), flush=True)
        rows.insert(0, ("supervisor (before)", before))
        if one is None:  # no oneshot this time: the two trees' outputs against each other
            print(f"supervisor before / after: tensors: {compare(sup['out'], before['out'])}", flush=True)
        if args.fast:  # and its match_oneshot = false, against this tree's
            bfast = run_supervisor(args, src, data, "sup-before-fast", keep_warm=0, code=args.before,
                                   calibration={"match_oneshot": False})
            print(f"supervisor before, match_oneshot = false: wall {bfast['wall']:.1f} s, "
                  f"{bfast['per_layer']:.2f} s per layer; tensors against this tree's: "
                  f"{compare(fast['out'], bfast['out'])}", flush=True)
            rows.insert(1, ("supervisor (before) match_oneshot = false", bfast))
    if args.world > 1 and "dist" not in skip:
        dist = run_dist_oneshot(args, src, data)
        rows.append((f"distributed oneshot W={args.world}", dist))
        print(f"ratio wall supervisor W = {args.world} / distributed oneshot W = {args.world}: "
              f"{sup['wall'] / dist['wall']:.3f} (target: at most 0.8)")
    print()
    print("| tool | wall s | start-up s | s/layer | peak GPU GiB (allocated / nvidia-smi tree) | peak RSS GiB (tree) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        startup = r["startup"] if name.startswith("supervisor") else r["startup"] + r["load"]
        print(f"| {name} | {r['wall']:.1f} | {startup:.1f} | {r['per_layer']:.2f} | "
              f"{r['peak_gpu'] / gib:.2f} / {r['tree'].peak_gpu / gib:.2f} | {r['tree'].peak_rss / gib:.2f} |")
    if one:
        print(f"\noneshot: imports {one['startup']:.1f} s, load {one['load']:.1f} s, {args.method} {one['gptq']:.1f} s, "
              f"save {one['save']:.1f} s, peak reserved {one['peak_reserved'] / gib:.2f} GiB")
        for name, r in rows:
            if name.startswith("supervisor"):
                print(f"{name} / oneshot: wall {r['wall'] / one['wall']:.3f}; tensors: {compare(r['out'], one['out'])}")
    for name, r in rows:
        if name.startswith("supervisor") and r.get("layers") and r is not sup:
            print(f"\nstage clock, {name} (seconds per layer; calibration stages of rank 0, then the worker's):")
            print("\n".join(stage_clock(r)))
            if peak_table(r):
                print("peak GPU GiB allocated as each stage ended:\n" + "\n".join(peak_table(r)))
    table = rank_table(sup)
    if table:
        print("\nper rank, mean seconds per layer (ours, W = %d):" % sup.get("world", 1))
        print("\n".join(table))
    if sup.get("logged"):
        print("ours, worker logs: " + "; ".join(sup["logged"]))
    if sup.get("stages"):
        print("supervisor, mean seconds per layer by stage: "
              + ", ".join(f"{k} {v:.3f}" for k, v in sup["stages"].items()))
    print(f"per-layer time (supervisor): first {sup['layers'][0]['seconds']:.2f} s, median "
          f"{sorted(e['seconds'] for e in sup['layers'])[len(sup['layers']) // 2]:.2f} s; peak RSS of the worker per "
          f"layer: first {sup['layers'][0]['peak_rss'] / gib:.2f} GiB, last {sup['layers'][-1]['peak_rss'] / gib:.2f} GiB; "
          f"peak GPU per layer: first {sup['layers'][0]['peak_gpu'] / gib:.2f} GiB, second "
          f"{sup['layers'][min(1, len(sup['layers']) - 1)]['peak_gpu'] / gib:.2f} GiB, last "
          f"{sup['layers'][-1]['peak_gpu'] / gib:.2f} GiB")

    k = args.kill_at
    if k >= args.layers:
        return
    fault = {"point": "calibrate", "action": "sigkill", "index": k}
    if "retry" not in skip:
        env = {"SUPERVISOR_TEST_FAULT": json.dumps({**fault, "once": os.path.join(args.workdir, "retry.fired")})}
        r = run_supervisor(args, src, data, "retry", env=env, keep_warm=0)
        extra = r["wall"] - sup["wall"]
        print(f"\nkill at layer {k}, retried in the same run: +{extra:.1f} s = {extra / sup['per_layer']:.2f} layers; "
              f"same bytes as uninterrupted: {compare(r['out'], sup['out'])}")
    if "kill" not in skip:
        # The killed run starts cold (as the uninterrupted one did) and keeps its warm parent (the default,
        # resources.keep_warm); the second run, started at once as a user re-running would, forks from it.
        stop_warm()
        shutil.rmtree(os.path.join(args.workdir, "killed"), ignore_errors=True)
        env = {"SUPERVISOR_TEST_FAULT": json.dumps({**fault, "once": os.path.join(args.workdir, "kill.fired")})}
        first = run_supervisor(args, src, data, "killed", env=env, check=False, max_attempts=1, keep_warm=300)
        second = run_supervisor(args, src, data, "killed", keep_warm=300)
        extra = first["wall"] + second["wall"] - sup["wall"]
        print("killed run: " + timeline(first["events"], first["wall"]))
        print("second run: " + timeline(second["events"], second["wall"]))
        print(f"kill at layer {k}, then a second `supervisor run` ("
              f"{'forking from the warm parent the killed run kept' if second['reused'] else 'warm parent NOT reused'}"
              f"): {first['wall']:.1f} s + {second['wall']:.1f} s (start-up {second['startup']:.1f} s) = "
              f"+{extra:.1f} s beyond uninterrupted = {extra / sup['per_layer']:.2f} layers (exit {first['rc']}, "
              f"then {second['rc']})")
        print("resumed output vs uninterrupted:", compare(second["out"], sup["out"]))
    stop_warm()


if __name__ == "__main__":
    main()
