"""Side by side: `supervisor run` against llm-compressor's `oneshot` and `model_free_ptq` on one checkpoint.

Builds a random bf16 Llama checkpoint (Llama-3-8B shape by default), warms the page cache, the import caches and,
on a GPU, the quantization's compiled kernels (so no tool pays a cold start the others do not), measures the disk's
write speed (the floor), then runs each tool in its own process, one after the other, sampling that process's whole
tree with psutil (RSS and PSS: a worker forked from a warm parent shares its pages, which RSS counts twice) and
nvidia-smi (GPU memory):

  supervisor       `supervisor run job.toml --json`, resources.workers as given (default: 0, the job's default)
  supervisor-1w    the same with workers = 1 (only when the default would use more)
  oneshot          from_pretrained + oneshot(QuantizationModifier) + save_pretrained(save_compressed=True)
  model_free_ptq   llm-compressor's model_free_ptq, 1 worker, the same ignore list (embeddings named explicitly)
  supervisor, warm parent kept   the first run again into a new folder, forking from the warm parent the first
                   run kept (resources.keep_warm): what a re-run or a studio's next export costs. Every other
                   supervisor run is cold (keep_warm = 0 or the first of its kind), in a runtime folder of the
                   bench's own

and prints one table: wall, start-up, work, per layer, peak GPU, peak tree RSS/PSS. Then it checks every tensor
of the outputs for equality (torch.equal on the bits) and config.json's quantization_config, times a re-run of
the finished export, and kills a worker mid-export (SIGKILL at a middle layer) to time its replacement.

    python bench/export_bench.py                                  # 32 layers (16 GB), FP8_DYNAMIC, cuda
    python bench/export_bench.py --scheme W4A16
    python bench/export_bench.py --scheme W4A16 --measure-error false --skip oneshot,model_free_ptq,kill  # its cost
    python bench/export_bench.py --device cpu --layers 8 --hidden 2048 --intermediate 5632 --vocab 32000
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
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SUPERVISOR = os.environ.get("SUPERVISOR_BIN") or os.path.join(os.path.dirname(sys.executable), "supervisor")
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.shared_expert_gate$"]

ONESHOT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, scheme, device, ignore = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto", device_map=device)
t2 = time.perf_counter()
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore))
t3 = time.perf_counter()
model.save_pretrained(out, save_compressed=True)
t4 = time.perf_counter()
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print(json.dumps({"startup": t1 - t0, "load": t2 - t1, "quantize": t3 - t2, "save": t4 - t3, "peak_gpu": gpu}))
"""

MODEL_FREE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from llmcompressor import model_free_ptq
src, out, scheme, device, ignore = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
t1 = time.perf_counter()
model_free_ptq(model_stub=src, save_directory=out, scheme=scheme, ignore=ignore, max_workers=1, device=device)
t2 = time.perf_counter()
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
print(json.dumps({"startup": t1 - t0, "work": t2 - t1, "peak_gpu": gpu}))
"""


# ---- measuring a process tree ------------------------------------------------------------------------------
def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gpu_used() -> dict[int, int]:
    """pid -> bytes of GPU memory, from nvidia-smi (empty without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used: dict[int, int] = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if pid.isdigit() and mib.isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return used


class TreeSampler(threading.Thread):
    """Peak RSS, PSS and GPU memory summed over a process and all its descendants: RSS sampled every `every` s,
    PSS and GPU memory every fifth sample. PSS reads /proc/PID/smaps_rollup, which walks the process's page tables
    under its memory-map lock: read every 0.1 s it slowed the sampled tool itself (a supervisor worker faulting in
    its mapped source: 0.26-0.30 s a layer unsampled, 0.36-0.42 s sampled, on the 2-core VM)."""

    def __init__(self, pid: int, every: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak_rss = self.peak_pss = self.peak_gpu = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        n = 0
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                break
            rss = pss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    continue
                if n % 5 == 0:
                    pss += _pss(p.pid)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            if n % 5 == 0:  # nvidia-smi is slow; every 0.5 s
                used = _gpu_used()
                pids = {p.pid for p in procs}
                self.peak_gpu = max(self.peak_gpu, sum(v for k, v in used.items() if k in pids))
            n += 1
            self.stop.wait(self.every)


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None
          ) -> tuple[subprocess.CompletedProcess, float, TreeSampler]:
    # Every tool starts on a quiet disk: without this, the checkpoint the bench just wrote (16 GB for the 8B
    # shape) was still being flushed while the first tool ran, and a tool that does not fsync (oneshot's
    # save_pretrained) left its output's flush to the next one. Not counted in any wall.
    os.sync()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    sampler.stop.set()
    sampler.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), wall, sampler


# ---- the tools --------------------------------------------------------------------------------------------
def write_job(path: str, src: str, out: str, scheme: str, device: str, workers: int,
              measure_error: bool | None = None, keep_warm: float = 0, cluster: bool = False) -> str:
    measure = "" if measure_error is None else f"measure_error = {str(measure_error).lower()}\n"
    on_ray = 'cluster = "ray"\n' if cluster else ""
    with open(path, "w") as f:
        f.write(f'[source]\npath = "{src}"\n[export]\nscheme = "{scheme}"\noutput = "{out}"\n{measure}'
                f'[resources]\ndevice = "{device}"\nworkers = {workers}\nkeep_warm = {keep_warm}\n{on_ray}')
    return path


def _label(run: dict, extra: str = "") -> str:
    """A supervisor run's row name in the table: its worker count, and `extra`."""
    n = run["workers"]
    return f"supervisor ({n} worker{'s' if n > 1 else ''}{extra})"


def private_runtime(workdir: str) -> None:
    """Kept warm parents of this bench live in a folder of its own (XDG_RUNTIME_DIR), so its first run is cold
    whatever ran on the machine before; stop_warm() ends them."""
    rt = os.path.join(workdir, "rt")
    os.makedirs(rt, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = rt


def stop_warm() -> None:
    """Stop the warm parents this bench kept and wait until they are gone."""
    subprocess.run([SUPERVISOR, "warm", "--stop"], capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = subprocess.run([SUPERVISOR, "warm", "--json"], capture_output=True, text=True, timeout=60)
        if '"pid"' not in listed.stdout:
            return
        time.sleep(0.2)


def run_supervisor(args, src: str, out: str, work: str, workers: int, env: dict | None = None,
                   check: bool = True, keep_warm: float = 0, cluster: bool = False, code: str | None = None) -> dict:
    """One `supervisor run`. keep_warm 0: its warm parent ends with it (a cold run: imports included); > 0: it
    stays for the next run, or this run forks from one an earlier run kept ("reused"). `code`: another checkout (the
    code before a change) whose code runs instead."""
    job = write_job(os.path.join(work, f"job-{os.path.basename(out)}.toml"), src, out, args.scheme,
                    args.device, workers, measure_error=args.measure_error, keep_warm=keep_warm, cluster=cluster)
    if code is not None:  # its code first, this checkout's not at all (`python -m` also puts the cwd first: cwd)
        env = dict(env or os.environ)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(code), *keep])
    proc, wall, tree = timed([SUPERVISOR, "run", job, "--json"], env, cwd=code)
    if check and proc.returncode != 0:
        sys.exit(f"supervisor failed: {proc.stderr[-3000:]}")
    events = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    written = [e for e in events if e["type"] == "LayerWritten"]
    layers = [e for e in written if e["index"] >= 0]
    first = min((e["t"] for e in events if e["type"] == "LayerStarted"), default=0.0)
    pool = next((e for e in events if e["type"] == "PoolStarted"), {})
    return {"wall": wall, "startup": first, "imports": pool.get("imports", 0.0), "forking": pool.get("forking"),
            "reused": pool.get("reused", False),
            "events": events, "stages": mean_stages(layers),
            "per_layer": sum(e["seconds"] for e in layers) / max(len(layers), 1),
            "workers": len({e["worker"] for e in events if e["type"] == "WorkerStarted"}),
            "peak_gpu": max((e["peak_gpu"] for e in written), default=0), "tree": tree, "rc": proc.returncode,
            "stderr": proc.stderr}


def per_layer_table(events: list[dict]) -> str:
    """The run's parts in the order they were written: which worker, when it started and was written (event times),
    and its seconds by stage, so a slow first part per worker (a per-process start cost) reads apart from a slow
    pace (contention)."""
    started = {e["index"]: e for e in events if e["type"] == "LayerStarted"}
    written = [e for e in events if e["type"] == "LayerWritten"]
    names = list(dict.fromkeys(k for e in written for k in e.get("stages", {})))
    lines = ["| part | worker | started s | written s | " + " | ".join(names) + " |",
             "| --- " * (4 + len(names)) + "|"]
    for e in written:
        s = started.get(e["index"], {})
        lines.append(f"| {e['index']} | {s.get('worker', '-')} | {s.get('t', float('nan')):.2f} | {e['t']:.2f} | "
                     + " | ".join(f"{e.get('stages', {}).get(k, 0.0):.3f}" for k in names) + " |")
    return "\n".join(lines)


def mean_stages(layers: list[dict]) -> dict[str, float]:
    """Stage name -> mean seconds over these LayerWritten events."""
    stages: dict[str, float] = {}
    for e in layers:
        for k, v in e.get("stages", {}).items():
            stages[k] = stages.get(k, 0.0) + v / len(layers)
    return stages


def timeline(events: list[dict], wall: float) -> str:
    """Where a `supervisor run --json` spent its wall clock: when the warm parent and the first worker were ready,
    the first part started, the last layer, the non-layer part and the last part were written, the run finished
    (finalize and the workers' exit after the last part; event times), and what the
    CLI process spent outside the run (its imports and planning before, its exit after)."""
    def t(kind: str, **match) -> float | None:
        return min((e["t"] for e in events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())),
                   default=None)

    finished = t("Finished")
    marks = [("pool ready", t("PoolStarted")), ("first worker ready", t("WorkerStarted")),
             ("first part", t("LayerStarted")),
             ("last layer written", max((e["t"] for e in events if e["type"] == "LayerWritten" and e["index"] >= 0),
                                        default=None)),
             ("non-layer part written", t("LayerWritten", index=-1)),
             ("last part written", max((e["t"] for e in events if e["type"] == "LayerWritten"), default=None)),
             ("finished", finished)]
    text = ", ".join(f"{name} {v:.2f}" for name, v in marks if v is not None)
    done = [e for e in events if e["type"] == "Finished"]
    after = done[0].get("stages") if done else None
    if after:  # the steps between the last part and Finished (supervisor.events.Finished.stages)
        text += " (after the last part: " + ", ".join(f"{k} {v:.2f}" for k, v in after.items()) + ")"
    rest = f"; the CLI's own start and exit {wall - finished:.1f}" if finished is not None else ""
    return f"timeline, s from the run's start: {text}{rest} (wall {wall:.1f})"


def work_against_floor(events: list[dict], floor: float) -> str:
    """The work after start-up (first part started → last part written) against the write floor of the bytes the
    workers wrote; the non-layer part, when the supervisor copied it during the imports (supervisor/run/verbatim.py,
    its stages copy/hash/sync), is shown apart: its bytes were written before the first part."""
    written = [e for e in events if e["type"] == "LayerWritten"]
    starts = [e["t"] for e in events if e["type"] == "LayerStarted"]
    if not written or not starts:
        return "work: no part written"
    ahead = [e for e in written if "copy" in e.get("stages", {})]
    by_workers = [e for e in written if e not in ahead]
    work = max(e["t"] for e in by_workers) - min(starts) if by_workers else 0.0
    nbytes = sum(e["nbytes"] for e in by_workers)
    text = (f"work: first part to last part {work:.2f} s, writing {nbytes / 1e9:.2f} GB (floor {nbytes / 1e9 / floor:.2f}"
            f" s: {work / max(nbytes / 1e9 / floor, 1e-9):.2f}x)")
    for e in ahead:
        st = e["stages"]
        text += (f"; the non-layer part ({e['nbytes'] / 1e9:.2f} GB) copied ahead by the supervisor: copy "
                 f"{st.get('copy', 0):.2f} s, hash {st.get('hash', 0):.2f} s, sync {st.get('sync', 0):.2f} s, "
                 f"journaled at {e['t']:.2f} s")
    return text


def run_script(script: str, args, src: str, out: str, ignore: list[str]) -> dict:
    proc, wall, tree = timed([sys.executable, "-c", script, src, out, args.scheme, args.torch_device,
                              json.dumps(ignore)])
    if proc.returncode != 0:
        sys.exit(f"reference tool failed: {proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(wall=wall, tree=tree)
    return res


# ---- evidence ---------------------------------------------------------------------------------------------
def compare(a: str, b: str, names_only_in_b_ok: bool = False) -> str:
    import torch
    from safetensors import safe_open

    def names(d):
        out = {}
        for fn in glob.glob(os.path.join(d, "*.safetensors")):
            with safe_open(fn, "pt") as f:
                out.update({k: fn for k in f.keys()})
        return out

    na, nb = names(a), names(b)
    common = set(na) & set(nb)
    diff = set(na) ^ set(nb)
    bad = 0
    for k in sorted(common):
        with safe_open(na[k], "pt") as fa, safe_open(nb[k], "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                     y.reshape(-1).view(torch.uint8)):
            bad += 1
    qa = json.load(open(os.path.join(a, "config.json"))).get("quantization_config")
    qb = json.load(open(os.path.join(b, "config.json"))).get("quantization_config")
    names_note = f", {len(diff)} names in one only" if diff else ""
    return f"{len(common)} common tensors, {bad} differ{names_note}; quantization_config {'equal' if qa == qb else 'differs'}"


def disk_write_speed(folder: str, nbytes: int = 2 << 30) -> float:
    """GB/s of write + fsync of one file in `folder` (the floor for writing shards there)."""
    buf = os.urandom(64 << 20)
    path = os.path.join(folder, "disk-speed.tmp")
    os.sync()  # measured on a quiet disk, not while the checkpoint just written is still being flushed
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(buf)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    s = time.perf_counter() - t
    os.unlink(path)
    return nbytes / s / 1e9


def build(args, path: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=32 if args.hidden >= 4096 else 8, num_key_value_heads=8,
                      vocab_size=args.vocab, tie_word_embeddings=False)
    with torch.device(args.torch_device if args.torch_device != "auto" else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, "*.safetensors")))


# The device kernels the quantization uses, compiled once before any tool runs: on a GPU, compressed-tensors quantizes
# through a triton kernel (ImplBackend "_quantize"), which triton compiles at its first use and caches on disk
# (~/.triton/cache). Without this, the first tool of a bench on a fresh machine (ours) compiles it and every tool
# after it finds it cached. Layer 0 quantized once, through the same compressed-tensors calls every tool makes.
WARM_KERNELS = r"""
import sys
import torch
from child.imports import hide_unused
hide_unused("compressed-tensors")
from child.backends.quantize import LayerQuantizer
from child.sources.checkpoint import Checkpoint
src, scheme, device, ignore = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
checkpoint = Checkpoint(src)
q = LayerQuantizer(src, scheme, ignore, device=device, tensor_names=checkpoint.all_names())
layer = checkpoint.read(checkpoint.layer_names(q.layer_prefix, 0))
q.quantize_layer(0, {k: v.to(device) for k, v in layer.items()})
if device.startswith("cuda"):
    torch.cuda.synchronize()
"""


WARM_LIBRARIES = r"""
import sys, torch
d = torch.device(sys.argv[1])
a = torch.randn(512, 512, device=d, dtype=torch.bfloat16)
h = a.float() @ a.float().T + 512 * torch.eye(512, device=d)  # cuBLAS, fp32 and bf16
(a @ a).sum().item()
torch.addmm(h, a.T, a, out_dtype=torch.float32)
u = torch.linalg.cholesky(h)  # cuSOLVER
torch.cholesky_inverse(u)
torch.linalg.solve_triangular(u, h, upper=False)
q = torch.randn(1, 8, 256, 64, device=d, dtype=torch.bfloat16)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
torch.softmax(q.float() @ q.float().transpose(-1, -2), -1).sum().item()
torch.cuda.synchronize()
"""


def warm(src: str, scheme: str | None = None, device: str = "cpu") -> None:
    """The page cache (the checkpoint, and on a GPU the device libraries' files: cuBLAS, cuSOLVER, attention
    kernels), the import caches and, with `scheme` on a GPU, the quantization's compiled kernels: so no tool pays a
    cold start the others do not (the first tool of a fresh machine paid about 3 s of library loading in its first
    layer and pool start, measured on an H200: docs/benchmarks.md, twenty-third session)."""
    for fn in glob.glob(os.path.join(src, "*")):
        with open(fn, "rb") as f:
            while f.read(64 << 20):
                pass
    subprocess.run([sys.executable, "-c", "import torch, transformers, llmcompressor, compressed_tensors"],
                   capture_output=True)
    if device.startswith("cuda"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", WARM_LIBRARIES, device], capture_output=True, text=True)
        print(f"device libraries warmed on {device} in {time.perf_counter() - t:.1f} s"
              + ("" if r.returncode == 0 else f": FAILED {r.stderr[-500:]}"), flush=True)
    if scheme is not None and device.startswith("cuda"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", WARM_KERNELS, src, scheme, device, *IGNORE], capture_output=True,
                           text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        print(f"device kernels warmed ({scheme}, layer 0 on {device}) in {time.perf_counter() - t:.1f} s"
              + ("" if r.returncode == 0 else f": FAILED {r.stderr[-500:]}"), flush=True)


def output_bytes(folder: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--layers/--hidden/--intermediate/--vocab of the random Llama the benches build (default: Llama-3-8B)."""
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B shape)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--device", default="cuda", help="the job's resources.device: cuda (every GPU), cuda:N, cpu")
    ap.add_argument("--workers", default="0", help="resources.workers for the supervisor runs: one run per value "
                    "of a comma-separated list (0: the job default); the first is the one compared")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "export-bench"))
    ap.add_argument("--skip", default="", help="comma-separated tools to skip: oneshot,model_free_ptq,kill,1w,warm")
    ap.add_argument("--per-layer", action="store_true", help="also print each supervisor run's parts one per row: worker, "
                    "start and end (s from the run's start), seconds by stage")
    ap.add_argument("--before", default=None, metavar="TREE",
                    help="also run ours from another checkout (the code before a change), cold, after the others")
    ap.add_argument("--measure-error", default=None, type=lambda v: v.lower() in ("1", "true", "yes"),
                    help="[export] measure_error = true|false (default: the job default, on a GPU only)")
    args = ap.parse_args()
    args.torch_device = "cpu" if args.device == "cpu" else ("cuda:0" if args.device == "cuda" else args.device)
    skip = set(filter(None, args.skip.split(",")))
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    private_runtime(args.workdir)
    src = os.path.join(args.workdir, "model")
    t = time.perf_counter()
    size = build(args, src)
    print(f"checkpoint: {args.layers} layers, {size / 1e9:.2f} GB bf16, written in {time.perf_counter() - t:.1f} s")
    warm(src, args.scheme, args.torch_device)
    floor = disk_write_speed(args.workdir)
    print(f"disk: {floor:.2f} GB/s write+fsync in {args.workdir}")

    rows = []
    counts = [int(w) for w in args.workers.split(",")]
    args.workers = counts[0]
    # cold: the first run keeps its warm parent for the "warm parent kept" row below; the others end theirs
    sup = run_supervisor(args, src, os.path.join(args.workdir, "sup"), args.workdir, counts[0], keep_warm=600)
    rows.append((_label(sup), sup))
    for n in counts[1:]:
        r = run_supervisor(args, src, os.path.join(args.workdir, f"sup{n}"), args.workdir, n)
        rows.append((_label(r), r))
        print(f"{n} workers' output vs the first run's:", compare(os.path.join(args.workdir, f"sup{n}"),
                                                                 os.path.join(args.workdir, "sup")), flush=True)
        shutil.rmtree(os.path.join(args.workdir, f"sup{n}"))
    if sup["workers"] > 1 and "1w" not in skip and 1 not in counts:
        rows.append(("supervisor (1 worker)", run_supervisor(args, src, os.path.join(args.workdir, "sup1"),
                                                             args.workdir, 1)))
    out_bytes = output_bytes(os.path.join(args.workdir, "sup"))
    one = mfp = None
    if "oneshot" not in skip:
        one = run_script(ONESHOT, args, src, os.path.join(args.workdir, "oneshot"), IGNORE)
        rows.append(("oneshot", one))
    if "model_free_ptq" not in skip:
        mfp = run_script(MODEL_FREE, args, src, os.path.join(args.workdir, "mfp"), IGNORE + ["model.embed_tokens"])
        rows.append(("model_free_ptq", mfp))
    if "warm" not in skip:
        # a second export of the same environment (a re-run after a crash, a studio's next export): its workers
        # fork from the warm parent the first run kept, so it imports nothing
        r = run_supervisor(args, src, os.path.join(args.workdir, "sup-warm"), args.workdir, counts[0], keep_warm=600)
        rows.append((_label(r, ", warm parent " + ("kept" if r["reused"] else "NOT reused")), r))
        print("warm run's output vs the first run's:", compare(os.path.join(args.workdir, "sup-warm"),
                                                              os.path.join(args.workdir, "sup")), flush=True)
        shutil.rmtree(os.path.join(args.workdir, "sup-warm"))

    if args.before:
        stop_warm()  # the first run's warm parent runs this checkout's code: the before run must not fork from it
        r = run_supervisor(args, src, os.path.join(args.workdir, "sup-before"), args.workdir, counts[0],
                           code=args.before)
        rows.insert(1, (_label(r, f", before: {args.before}"), r))
        print("before's output vs the first run's:", compare(os.path.join(args.workdir, "sup-before"),
                                                            os.path.join(args.workdir, "sup")), flush=True)
        shutil.rmtree(os.path.join(args.workdir, "sup-before"))

    gib = 2**30
    print()
    print("| tool | wall s | start-up s | work s | s/layer | peak GPU GiB (alloc / nvidia-smi) | peak RSS GiB | peak PSS GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        work = r["wall"] - r["startup"]
        per_layer = f"{r['per_layer']:.3f}" if "per_layer" in r else "-"
        tree = r["tree"]
        if r.get("reused"):
            # its workers are the kept warm parent's children, not the CLI's: the tree sampler does not see
            # them, so show what the workers reported themselves
            wrote = [e for e in r["events"] if e["type"] == "LayerWritten"]
            rss = max((e["peak_rss"] for e in wrote), default=0)
            print(f"| {name} | {r['wall']:.1f} | {r['startup']:.1f} | {work:.1f} | {per_layer} | "
                  f"{r['peak_gpu'] / gib:.2f} / - | {rss / gib:.2f} (worker) | - |")
            continue
        print(f"| {name} | {r['wall']:.1f} | {r['startup']:.1f} | {work:.1f} | {per_layer} | "
              f"{r['peak_gpu'] / gib:.2f} / {tree.peak_gpu / gib:.2f} | {tree.peak_rss / gib:.2f} | "
              f"{tree.peak_pss / gib:.2f} |")
    print()
    print(f"written: {out_bytes / 1e9:.2f} GB; write floor {out_bytes / 1e9 / floor:.2f} s in all, "
          f"{out_bytes / 1e9 / floor / (args.layers + 1):.3f} s per part")
    print(work_against_floor(sup["events"], floor))
    print(f"supervisor: imports {sup['imports']:.1f} s in the warm parent; {sup['workers']} worker(s), "
          f"{'forked from it' if sup['forking'] else 'spawned fresh (the imports touched CUDA)'}")
    for name, r in rows:
        if r.get("stages"):
            print(f"{name}: mean seconds per layer by stage: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["stages"].items()))
        if r.get("events"):
            print(f"{name}: {timeline(r['events'], r['wall'])}")
    for name, r in rows if args.per_layer else ():
        if r.get("events"):
            print(f"{name}, part by part:\n{per_layer_table(r['events'])}")
    if one:
        print(f"ratio wall supervisor / oneshot: {sup['wall'] / one['wall']:.2f}")
        print("ours vs oneshot:", compare(os.path.join(args.workdir, "sup"), os.path.join(args.workdir, "oneshot")))
    if mfp:
        print(f"ratio wall supervisor / model_free_ptq: {sup['wall'] / mfp['wall']:.2f}")
        print("ours vs model_free_ptq:", compare(os.path.join(args.workdir, "sup"), os.path.join(args.workdir, "mfp")))

    again, wall_again, _ = timed([SUPERVISOR, "run",
                                  os.path.join(args.workdir, "job-sup.toml"), "--json"])
    print(f"re-run of the finished export: {wall_again:.2f} s (exit {again.returncode})")
    if "kill" not in skip and args.layers >= 4:
        kill_run(args, src)
    stop_warm()


def kill_run(args, src: str) -> None:
    """SIGKILL the worker once at a middle layer; report how long until its replacement was ready and working."""
    marker = os.path.join(args.workdir, "killed.json")
    env = dict(os.environ)
    env["SUPERVISOR_TEST_FAULT"] = json.dumps({"point": "quantize", "action": "sigkill", "index": args.layers // 2,
                                               "once": marker})
    r = run_supervisor(args, src, os.path.join(args.workdir, "killed"), args.workdir, args.workers, env=env)
    with open(marker) as f:
        fired = json.load(f)
    ev = r["events"]
    retry = next((e for e in ev if e["type"] == "Retrying"), None)
    again = next((e for e in ev if e["type"] == "LayerStarted" and e["attempt"] == 2), None)
    ready = next((e for e in ev if e["type"] == "WorkerStarted" and e.get("since_death") is not None), None)
    if retry and again and ready:
        print(f"kill at layer {fired['index']}: the loss was noticed and the layer restarted "
              f"{again['t'] - retry['t']:.2f} s later (backoff {retry['delay']:.1f} s; the new worker was ready "
              f"{ready['since_death']:.2f} s after the loss, {ready['seconds']:.2f} s from fork to Ready)")
    else:
        print("kill run: no restart seen")
    print("killed run vs uninterrupted:", compare(os.path.join(args.workdir, "killed"), os.path.join(args.workdir, "sup")))


if __name__ == "__main__":
    main()
