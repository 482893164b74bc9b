"""Where llm-compressor's distributed oneshot (0.14.0.1, compressed-tensors 0.19.0) loses determinism, shown on CPU.

What it shows (measured on a tiny 3-layer Llama, GPTQ W4A16, 20 samples, W = 2, gloo, 1 thread per rank):

1. The nondeterminism is a race on the shared-memory CPU offload. The weights live in one shared-memory copy that
   every rank maps (DistributedCPUCache). GPTQ gives each module to one rank (greedy bin packing), which solves it
   and writes the quantized weight into that shared copy; `broadcast_qparams_and_cleanup(..., skip_cpu=True)` skips
   modules whose execution device is the CPU (the memory is shared, nothing to send), and with the broadcast goes
   the only synchronisation after the writes. The rank that finishes its own modules first goes straight on to the
   sequential pipeline's propagation pass over the same layer and reads the other rank's modules before they are
   written: it propagates through the pre-GPTQ weights. Its activations, hence the next layer's Hessians, depend on
   the timing, so every layer after the first comes out different (layer 0 itself is always right: its owner
   finishes writing it, and nothing reads it again). The next layer's Hessian reduce is a collective, so the window
   is one layer's propagation. The same race exists at save_pretrained for the LAST layer: the fast rank compresses
   (compressed_tensors replace_module_parallel) a module whose GPTQ owner has not written it yet, and packs the
   pre-GPTQ weight against the still uninitialised (torch.empty) weight_scale, while the file gets the owner's
   scale: 97% of that module's int4 values wrong. Seen with `--delay-writes 0.05`; without a delay it needs the
   owner to lag by more than the last layer's propagation.
   `--fix barrier` (dist.barrier() after GPTQModifier.compress_modules) or `--fix broadcast` (skip_cpu=False: the
   broadcast's wait synchronises) removes both, and runs are bitwise identical, with or without the forced delay.
2. Not causes: the Hessian reduce (gloo, async: reduced Hessians identical across runs wherever the inputs are),
   the bin packing (ties break by bin index; identical on every rank and run), the thread count (changes the bits
   but is deterministic for a fixed count), save_pretrained's distributed compression (apart from the last-layer
   race in 1, every module it packed saw the owner's final weight).
3. Also found: llmcompressor/datasets/utils.py partitions the dataset inside `_make_sampler` (a local
   `dataset.select(range(start, end))`) but the DataLoader indexes the FULL tokenized dataset with that slice's
   indices 0..end-start-1, so every rank calibrates on the FIRST slice (rank r in the length order of its own slice)
   and samples end-start.. are never seen. W = 2 on 20 samples is bitwise the W = 1 oneshot of the first 10.
   `--fix-partition` shifts each rank's indices by its `start`; with it (and a race fix) W = 2 differs from W = 1 on
   all 20 samples only by the order of the float32 Hessian sums (max relative Hessian difference 2e-7; 44 of
   442368 int4 values, one step each, in one tensor).

Usage (from the repository root; every torchrun under `timeout`):

    .venv/bin/python bench/dist_oneshot_probe.py setup /tmp/distprobe            # tiny Llama (3 layers) + JSONL
    timeout 600 .venv/bin/torchrun --nproc-per-node 2 bench/dist_oneshot_probe.py run \\
        [--fix none|barrier|broadcast] [--fix-partition] [--trace DIR] [--delay-writes S] [--dump-hessians DIR] \\
        -- --model /tmp/distprobe/model --dataset /tmp/distprobe/calib.jsonl --samples 20 --seq-len 64 \\
        --scheme W4A16 --method gptq --out OUT --threads 1                      # tests/ref_dist.py's arguments
    .venv/bin/python bench/dist_oneshot_probe.py compare OUT1 OUT2 [OUT3 ...]    # tensor by tensor, every pair
    .venv/bin/python bench/dist_oneshot_probe.py analyze TRACE1 [TRACE2 ...]     # the reads; Hessians across runs

`run` with `--fix none` and no other option is exactly tests/ref_dist.py. The patches are monkeypatches inside this
process only (nothing in site-packages is edited). The trace (one JSONL per rank) holds: GPTQ's module-to-rank
assignment, each rank's local Hessian digest before the reduce and the owner's after it, each owner write (digest
of the weight before and after), every forward read of a quantized Linear's weight (digest, token count, rank,
time), and each weight read by save_pretrained's compression. `analyze` classifies every read made after the
reading rank finished the layer's GPTQ (the propagation pass) as the owner's final weight, the pre-GPTQ weight, or
neither (torn), and says how long before the owner's write it happened. `compare` lists the differing tensors and,
per quantized module, the fraction of int4 values that differ and the max |difference| of dequantized weights and
of weight_scale. The report with the exact commands and numbers: the session report "llm-compressor's distributed
oneshot: where its nondeterminism comes from".
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import itertools
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------------------------------- digests
def digest(t) -> str:
    import torch

    if t is None:
        return "none"
    if t.is_meta:
        return "meta"
    t = t.detach().contiguous().cpu()
    if t.dtype.is_floating_point and t.element_size() == 2:
        t = t.view(torch.int16)
    elif t.dtype.is_floating_point and t.element_size() == 4:
        t = t.view(torch.int32)
    elif t.dtype.is_floating_point and t.element_size() == 8:
        t = t.view(torch.int64)
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------- tracing
class Trace:
    def __init__(self, folder: str | None):
        self.folder = folder
        self.file = None
        self.names: dict = {}  # module -> name
        self.epoch_ends = 0
        self.phase = "oneshot"

    def open(self, rank: int):
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
            self.file = open(os.path.join(self.folder, f"rank{rank}.jsonl"), "w")

    def __call__(self, ev: str, **fields):
        if self.file is None:
            return
        import torch.distributed as dist

        rec = {"t": time.time(), "rank": dist.get_rank(), "ev": ev, "epoch_ends": self.epoch_ends,
               "phase": self.phase, **fields}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()


TRACE = Trace(None)


def install(fix: str, trace_dir: str | None, delay_writes: float, dump_dir: str | None = None) -> None:
    """The monkeypatches: tracing (if trace_dir), the fix, the write delay. Call after init, before oneshot."""
    import torch
    import torch.distributed as dist
    from compressed_tensors.compressors.model_compressors import model_compressor as mc
    from compressed_tensors.quantization.utils import is_module_quantized
    from llmcompressor.modifiers.gptq import base as gptq_base
    lc_dist = importlib.import_module("llmcompressor.utils.dist")  # `llmcompressor.utils.dist` is torch's name

    GPTQ = gptq_base.GPTQModifier
    rank = dist.get_rank()
    TRACE.folder = trace_dir
    TRACE.open(rank)

    # ---- names, and a forward pre-hook on every quantized Linear: the weight each forward reads
    orig_init = GPTQ.on_initialize

    def on_initialize(self, state, **kw):
        out = orig_init(self, state, **kw)
        for name, m in state.model.named_modules():
            TRACE.names[m] = name
            if isinstance(m, torch.nn.Linear) and is_module_quantized(m) and trace_dir:
                m.register_forward_pre_hook(functools.partial(_read_hook, name))
        return out

    def _read_hook(name, module, args):
        TRACE("read", module=name, sha=digest(module.weight), tokens=int(args[0].shape[-2]) if args else None)

    GPTQ.on_initialize = on_initialize

    # ---- phase bookkeeping (labels only: `analyze` tells propagation reads by the rank's finished compress_modules)
    orig_epoch_end = GPTQ.on_sequential_epoch_end

    def on_sequential_epoch_end(self, state, event, modules, **kw):
        TRACE.phase = "epoch_end"
        out = orig_epoch_end(self, state, event, modules, **kw)
        TRACE.epoch_ends += 1
        TRACE.phase = "forward"  # the propagation pass, then the next subgraph's calibration pass
        return out

    GPTQ.on_sequential_epoch_end = on_sequential_epoch_end

    # ---- GPTQ: assignment, Hessians before/after the reduce, the fix
    orig_compress_modules = GPTQ.compress_modules

    def compress_modules(self):
        for m, h in self._hessians.items():
            TRACE("local_hessian", module=TRACE.names.get(m), sha=digest(h), n=float(self._num_samples[m]))
        TRACE("compress_start")
        out = orig_compress_modules(self)
        TRACE("compress_end")
        if fix == "barrier":
            dist.barrier()
            TRACE("barrier_passed")
        return out

    GPTQ.compress_modules = compress_modules

    orig_reduce = GPTQ._reduce_hessian_to_target_rank

    def reduce_hessian(self, module_list, module_to_rank):
        TRACE("assign", owners={TRACE.names.get(m): r for m, r in module_to_rank.items()},
              order=[TRACE.names.get(m) for m in module_list])
        out = orig_reduce(self, module_list, module_to_rank)
        for m in module_list:
            if m in self._hessians:
                TRACE("reduced_hessian", module=TRACE.names.get(m), sha=digest(self._hessians[m]),
                      n=float(self._num_samples[m]))
                if dump_dir:  # the owner's summed Hessian and sample count, for comparing with W = 1
                    os.makedirs(dump_dir, exist_ok=True)
                    torch.save({"H": self._hessians[m].clone(), "n": self._num_samples[m].clone()},
                               os.path.join(dump_dir, f"{TRACE.names.get(m)}.pt"))
        return out

    GPTQ._reduce_hessian_to_target_rank = reduce_hessian

    orig_update = gptq_base.update_batch_qparams

    def update_batch_qparams(modules, quantized, *a, **kw):
        if delay_writes and rank == 0:
            time.sleep(delay_writes)
        names = [TRACE.names.get(m) for m in modules]
        TRACE("write_start", modules=names, before=[digest(m.weight) for m in modules])
        out = orig_update(modules, quantized, *a, **kw)
        TRACE("write_end", modules=names, after=[digest(m.weight) for m in modules],
              scale=[digest(m.weight_scale) for m in modules])
        return out

    gptq_base.update_batch_qparams = update_batch_qparams

    if fix == "broadcast":
        gptq_base.broadcast_qparams_and_cleanup = functools.partial(lc_dist.broadcast_qparams_and_cleanup,
                                                                    skip_cpu=False)
    elif fix not in ("none", "barrier"):
        raise SystemExit(f"unknown --fix {fix!r}")

    # ---- save_pretrained's compression: what each rank reads when it packs a module
    orig_compress_model = mc.ModelCompressor.compress_model

    def compress_model(self, model, *a, **kw):
        TRACE.phase = "save"
        TRACE("save_start")
        return orig_compress_model(self, model, *a, **kw)

    mc.ModelCompressor.compress_model = compress_model
    orig_compress_module = mc.compress_module

    def compress_module(module, *a, **kw):
        w = module._parameters.get("weight") if "weight" in module._parameters else None
        TRACE("save_read", module=TRACE.names.get(module), sha=digest(w) if w is not None else "none",
              scale=digest(getattr(module, "weight_scale", None)))
        return orig_compress_module(module, *a, **kw)

    mc.compress_module = compress_module


def cmd_run(argv) -> None:
    p = argparse.ArgumentParser(prog="dist_oneshot_probe.py run")
    p.add_argument("--fix", default="none", choices=("none", "barrier", "broadcast"))
    p.add_argument("--trace", default=None, help="folder for rank<r>.jsonl")
    p.add_argument("--fix-partition", action="store_true",
                   help="make each rank calibrate its own slice (tests/ref_dist.py fix_partition); off: upstream's behaviour")
    p.add_argument("--dump-hessians", default=None, help="folder: each owner saves <module>.pt = {H, n} after the reduce")
    p.add_argument("--delay-writes", type=float, default=0.0,
                   help="rank 0 sleeps this long before each GPTQ write (forces the race)")
    if "--" not in argv:
        raise SystemExit("usage: run [--fix ...] [--trace DIR] [--delay-writes S] -- <tests/ref_dist.py arguments>")
    cut = argv.index("--")
    opts, ref_args = p.parse_args(argv[:cut]), argv[cut + 1:]

    import tests.ref_dist as ref_dist

    orig_init = ref_dist.init_distributed

    def init_then_patch():
        orig_init()
        install(opts.fix, opts.trace, opts.delay_writes, opts.dump_hessians)
        if opts.fix_partition:
            ref_dist.fix_partition()  # llmcompressor's DataLoader indexes the full dataset with the slice's indices
        ref_dist.log(f"probe: fix={opts.fix} fix_partition={opts.fix_partition} trace={opts.trace} "
                     f"delay_writes={opts.delay_writes}")

    ref_dist.init_distributed = init_then_patch
    ref_dist.main(ref_args)


# --------------------------------------------------------------------------------------------------- setup
def cmd_setup(argv) -> None:
    p = argparse.ArgumentParser(prog="dist_oneshot_probe.py setup")
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--samples", type=int, default=20)
    a = p.parse_args(argv)
    from tests.models import make_tiny_model
    from tests.ref_calib import text_rows, write_jsonl

    os.makedirs(a.folder, exist_ok=True)
    make_tiny_model("llama", os.path.join(a.folder, "model"), layers=a.layers)  # hidden 128, intermediate 256
    write_jsonl(os.path.join(a.folder, "calib.jsonl"), text_rows(a.samples))  # 20..79 words, some > seq-len
    print(f"{a.folder}/model ({a.layers} layers), {a.folder}/calib.jsonl ({a.samples} texts)")


# --------------------------------------------------------------------------------------------------- compare
def _int4(packed, shape):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    return unpack_from_int32(packed, 4, shape)


def _dequant(t: dict, base: str):
    import torch

    shape = torch.Size(t[base + ".weight_shape"].tolist())
    q = _int4(t[base + ".weight_packed"], shape).float()
    s = t[base + ".weight_scale"].float()
    group = shape[1] // s.shape[1]
    return q, q * s.repeat_interleave(group, dim=1)


def compare(a_dir: str, b_dir: str, *, quiet: bool = False) -> dict:
    """Tensor-by-tensor comparison of two saved outputs; prints what differs and returns a summary."""
    import torch

    from tests.models import load_tensors

    a, b = load_tensors(a_dir), load_tensors(b_dir)
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:8]
    differ = [k for k in sorted(a) if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or not torch.equal(a[k], b[k])]
    bases = sorted({k[: -len(".weight_packed")] for k in a if k.endswith(".weight_packed")})
    rows, total_q, total_dq = [], 0, 0
    for base in bases:
        qa, da = _dequant(a, base)
        qb, db = _dequant(b, base)
        nq = int((qa != qb).sum())
        total_q += nq
        total_dq += qa.numel()
        if nq or not torch.equal(a[base + ".weight_scale"], b[base + ".weight_scale"]):
            rows.append((base, nq, qa.numel(), float((da - db).abs().max()),
                         float((a[base + ".weight_scale"].float() - b[base + ".weight_scale"].float()).abs().max()),
                         float((qa - qb).abs().max())))
    if not quiet:
        print(f"{a_dir} vs {b_dir}: {len(differ)} of {len(a)} tensors differ")
        for k in differ:
            print(f"    {k}")
        for base, nq, n, dmax, smax, qmax in rows:
            print(f"    {base}: {nq}/{n} int4 values differ ({100 * nq / n:.2f}%, max |dq| {qmax:.0f} step), "
                  f"max |dequantized diff| {dmax:.4g}, max |scale diff| {smax:.3g}")
        if total_dq:
            print(f"    all packed weights: {total_q}/{total_dq} int4 values differ ({100 * total_q / total_dq:.3f}%)")
    return {"differ": differ, "n": len(a), "int4_differ": total_q, "int4_total": total_dq}


def cmd_compare(argv) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: compare OUT1 OUT2 [OUT3 ...]")
    for x, y in itertools.combinations(argv, 2):
        compare(x, y)


# --------------------------------------------------------------------------------------------------- analyze
def _load_trace(folder: str) -> list[dict]:
    recs = []
    for fn in sorted(os.listdir(folder)):
        if re.fullmatch(r"rank\d+\.jsonl", fn):
            with open(os.path.join(folder, fn)) as f:
                recs += [json.loads(line) for line in f]
    return sorted(recs, key=lambda r: r["t"])


def _layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name or "")
    return int(m.group(1)) if m else -1


def analyze_one(folder: str) -> dict:
    recs = _load_trace(folder)
    owners, final, before, write_end_t = {}, {}, {}, {}
    for r in recs:
        if r["ev"] == "assign":
            owners.update(r["owners"])
        elif r["ev"] == "write_start":
            for m, s in zip(r["modules"], r["before"]):
                before[m] = s
        elif r["ev"] == "write_end":
            for m, s in zip(r["modules"], r["after"]):
                final[m] = s
                write_end_t[m] = r["t"]
    kinds = {"final": 0, "pre-GPTQ": 0, "torn": 0}
    bad = []
    pending: dict = {}  # rank -> layers whose Hessians it has logged in the compress_modules call under way
    done: dict = {}  # rank -> layers this rank has finished compress_modules for (its later reads: propagation)
    for r in recs:
        rank = r["rank"]
        if r["ev"] == "local_hessian":
            pending.setdefault(rank, set()).add(_layer(r["module"]))
        elif r["ev"] == "compress_end":
            done.setdefault(rank, set()).update(pending.pop(rank, set()))
        if r["ev"] != "read" or r["module"] not in final:
            continue
        if _layer(r["module"]) not in done.get(rank, ()):  # a calibration read, before the layer's GPTQ
            continue
        kind = "final" if r["sha"] == final[r["module"]] else "pre-GPTQ" if r["sha"] == before[r["module"]] else "torn"
        kinds[kind] += 1
        if kind != "final":
            bad.append((r["rank"], r["module"], owners.get(r["module"]), kind, r["t"] - write_end_t[r["module"]]))
    save_bad = [(r["rank"], r["module"], owners.get(r["module"]))
                for r in recs if r["ev"] == "save_read" and r["module"] in final and r["sha"] not in ("meta",)
                and r["sha"] != final[r["module"]]]
    save_n = sum(1 for r in recs if r["ev"] == "save_read" and r["sha"] not in ("meta", "none"))
    print(f"{folder}: propagation reads of a quantized weight: {sum(kinds.values())} "
          f"(final {kinds['final']}, pre-GPTQ {kinds['pre-GPTQ']}, torn {kinds['torn']})")
    grouped: dict = {}
    for rank, mod, owner, kind, dt in bad:
        grouped.setdefault((rank, mod, owner, kind), []).append(-dt * 1e3)
    for (rank, mod, owner, kind), lags in sorted(grouped.items(), key=lambda kv: (_layer(kv[0][1]), kv[0])):
        print(f"    rank {rank} read {mod} (GPTQ owner: rank {owner}) {len(lags)}x {kind}, "
              f"{min(lags):.1f}-{max(lags):.1f} ms before the owner finished writing it")
    print(f"    save_pretrained compression reads: {save_n}, not the owner's final weight: {len(save_bad)} "
          f"{save_bad[:8]}")
    hess = {(r["ev"], r["rank"], r["module"]): r["sha"] for r in recs if r["ev"] in ("local_hessian", "reduced_hessian")}
    assign = {rank: [r["owners"] for r in recs if r["ev"] == "assign" and r["rank"] == rank]
              for rank in sorted({r["rank"] for r in recs})}  # per rank, per layer: module -> owner
    return {"stale": len(bad), "save_stale": len(save_bad), "hess": hess, "assign": assign}


def cmd_analyze(argv) -> None:
    results = [analyze_one(f) for f in argv]
    if len(results) < 2:
        return
    keys = sorted(set().union(*(r["hess"] for r in results)), key=lambda k: (_layer(k[2]), k[0], k[1], k[2]))
    same_assign = all(r["assign"] == results[0]["assign"] for r in results)
    ranks_agree = all(len({json.dumps(v, sort_keys=True) for v in r["assign"].values()}) == 1 for r in results)
    print(f"GPTQ module-to-rank assignment identical across the {len(results)} traces: {same_assign}; "
          f"identical on every rank within each trace: {ranks_agree}")
    by_layer: dict = {}
    for k in keys:
        vals = {r["hess"].get(k) for r in results}
        by_layer.setdefault((_layer(k[2]), k[0], k[1]), []).append(len(vals) == 1)
    print("Hessian digests identical across the traces (layer, which, rank: identical/modules):")
    for (layer, which, rank), flags in sorted(by_layer.items()):
        print(f"    layer {layer} {which:15s} rank {rank}: {sum(flags)}/{len(flags)}")


def main() -> None:
    cmds = {"setup": cmd_setup, "run": cmd_run, "compare": cmd_compare, "analyze": cmd_analyze}
    if len(sys.argv) < 2 or sys.argv[1] not in cmds:
        raise SystemExit(__doc__)
    cmds[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
