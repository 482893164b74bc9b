"""llm-compressor's distributed oneshot, exactly as documented: the W > 1 reference (tests/ref_calib.py is W = 1).

    timeout 600 torchrun --nproc-per-node W tests/ref_dist.py --model DIR --dataset JSONL --samples N \\
        --seq-len L --scheme W4A16 --method gptq --out OUT [--threads 1] [--upstream-fixes]

Each rank: `init_dist()` (on a machine without an accelerator, the same process group on gloo: compressed_tensors'
`init_dist` needs an accelerator, it reads `torch.accelerator.current_accelerator().type`), the model loaded inside
`load_offloaded_model()` with `device_map="auto_offload"` (rank 0 reads the checkpoint, the others build it on meta;
the weights then live in CPU shared memory that all ranks map; `--extra-cpu-mem`, default 1e8: the
context's default reserve of 5e9 bytes is subtracted from a CPU budget that it caps at max_map_count x the average
tensor size, about 2 GB for a tiny model, so with the default every weight of a tiny model is offloaded to disk and
the load fails for want of an `offload_folder`), the SAME dataset on every rank (llm-compressor
detects that and gives each rank a contiguous slice: llmcompressor/datasets/utils.py `_get_partition_start_end`),
`oneshot(..., pipeline="sequential")`, and then every rank calls `model.save_pretrained(OUT, save_compressed=True)`
(compression is split over the ranks; rank 0 writes the files).

The data and the recipe are prepared as tests/ref_calib.py `oneshot_calibrated` prepares them, so the two references
differ only in W: the first `--samples` lines of the JSONL ({"text"} or {"input_ids"} per line, read by
shared/calibdata.py `read_rows`, the exporter's own reader), texts handed to oneshot to tokenize, token rows with an
all-ones attention mask; GPTQModifier | [AWQModifier, QuantizationModifier] | QuantizationModifier on targets Linear
with the exporter's default ignore (lm_head and MoE routers); the model in bf16; torch's thread count pinned
(`--threads`, default 1: GPTQ's arithmetic depends on it).

What it reproduces, as upstream does it (measured; bench/dist_oneshot_probe.py has the evidence):
- on the CPU it is not deterministic: GPTQ's owner rank writes each quantized weight into the shared memory with
  no synchronisation after it (`broadcast_qparams_and_cleanup` skips CPU modules), so the other rank propagates
  through some modules' pre-GPTQ weights and every layer after the first varies from run to run;
- every rank calibrates on the FIRST 1/W of the samples (llmcompressor's `_make_sampler` partitions a local copy
  but the DataLoader indexes the full dataset with the slice's indices), so W = 2 on N samples equals W = 1 on the
  first N/2 (bitwise, when the race is removed), not W = 1 on N.

`--upstream-fixes` (off by default) fixes exactly those two bugs, as two monkeypatches in this process (see
`apply_upstream_fixes`), and nothing else: the broadcast with `skip_cpu=False` (its wait synchronises) and each
rank's DataLoader reading its own slice. With them the W = 2 reference is deterministic and calibrates every
sample once; tests/scenarios/test_group_reference.py compares a group's export with it tensor for tensor.

It never imports `supervisor` or `child`: the reference must come from the upstream tools alone.
bench/dist_oneshot_probe.py runs this same `main` with instrumentation and candidate fixes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

if __package__ in (None, ""):  # run as a script by torchrun: make `tests` and `shared` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local checkpoint folder (with its tokenizer)")
    p.add_argument("--dataset", required=True, help='JSONL, one {"text": ...} or {"input_ids": [...]} per line')
    p.add_argument("--samples", type=int, required=True, help="the first N lines are the calibration set")
    p.add_argument("--seq-len", type=int, required=True, help="oneshot's max_seq_length")
    p.add_argument("--scheme", default="W4A16")
    p.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on every rank")
    p.add_argument("--extra-cpu-mem", type=float, default=1e8,
                   help="load_offloaded_model's reserve in bytes (its default 5e9 sends a tiny model to disk: see "
                        "the module docstring)")
    p.add_argument("--upstream-fixes", action="store_true",
                   help="fix llm-compressor 0.14.0.1's two distributed-oneshot bugs (the CPU broadcast race, the "
                        "sampler's slice read from the whole dataset): apply_upstream_fixes; off: upstream as is")
    return p.parse_args(argv)


def init_distributed() -> None:
    """compressed_tensors.distributed.init_dist, or on a machine without an accelerator its gloo equivalent."""
    from compressed_tensors.distributed import init_dist

    if torch.accelerator.is_available():
        init_dist()
        return
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise SystemExit("run this under `torchrun --nproc-per-node W tests/ref_dist.py ...`")
    dist.init_process_group(backend="gloo", init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    dist.barrier()


def apply_upstream_fixes() -> None:
    """llm-compressor 0.14.0.1's two distributed-oneshot bugs on the CPU fixed, and nothing else changed (these are
    bench/dist_oneshot_probe.py's `--fix broadcast` and `--fix-partition`). Call after init, before oneshot."""
    import functools

    from llmcompressor.modifiers.gptq import base as gptq
    from llmcompressor.modifiers.quantization.quantization import base as quantization
    from llmcompressor.utils.dist import broadcast_qparams_and_cleanup

    # Bug 1, the race: `broadcast_qparams_and_cleanup(skip_cpu=True)` skips modules that execute on the CPU (the
    # weights are one shared-memory copy), and with the broadcast goes the only synchronisation after the owner rank
    # writes its result there: the other rank may propagate (and at save compress) through stale weights. With
    # skip_cpu=False every owner broadcasts and the wait synchronises. Both callers: GPTQ, QuantizationModifier.
    every_module = functools.partial(broadcast_qparams_and_cleanup, skip_cpu=False)
    gptq.broadcast_qparams_and_cleanup = quantization.broadcast_qparams_and_cleanup = every_module
    fix_partition()


def fix_partition() -> None:
    """Bug 2 of apply_upstream_fixes alone (bench/dist_oneshot_probe.py's `--fix-partition` calls it too)."""
    from llmcompressor.datasets import utils as ds_utils

    # Bug 2, the sampler: `_make_sampler` builds its sampler over a local `dataset.select(range(start, end))`, but
    # `format_calibration_data` gives the DataLoader the whole dataset, so rank r > 0 reads rows 0 .. end-start-1.
    # Adding `start` back to each index makes the DataLoader read the rank's own slice, in the sampler's order.
    make_sampler = ds_utils._make_sampler

    class OwnSlice(torch.utils.data.Sampler):
        def __init__(self, inner, start):
            self.inner, self.start = inner, start

        def __iter__(self):
            return (self.start + i for i in self.inner)

        def __len__(self):
            return len(self.inner)

    def own_slice_sampler(args, dataset):
        sampler = make_sampler(args, dataset)
        if ds_utils._is_dist_and_same_ds(dataset):  # a collective, as in _make_sampler: every rank calls it
            start, _ = ds_utils._get_partition_start_end(args.num_calibration_samples or len(dataset),
                                                         dist.get_rank(), dist.get_world_size())
            sampler = OwnSlice(sampler, start)
        return sampler

    ds_utils._make_sampler = own_slice_sampler


def recipe_for(method: str, scheme: str):
    """The recipe tests/ref_calib.py `oneshot_calibrated` builds for (method, scheme)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from shared.job import DEFAULT_IGNORE

    ignore = list(DEFAULT_IGNORE)
    if method == "gptq":
        return GPTQModifier(targets="Linear", scheme=scheme, ignore=ignore)
    if method == "awq":
        return [AWQModifier(), QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)]
    return QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)


def dataset_for(samples: list):
    """The Dataset tests/ref_calib.py `oneshot_calibrated` hands oneshot for these samples (all, in file order)."""
    from datasets import Dataset

    if all(isinstance(s, str) for s in samples):
        data = {"text": list(samples)}  # oneshot tokenizes them itself
    else:
        data = {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
    return Dataset.from_dict(data)


def log(msg: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[ref_dist rank {rank}] {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    init_distributed()
    if args.upstream_fixes:
        apply_upstream_fixes()
    t0 = time.monotonic()

    from compressed_tensors.offload import load_offloaded_model
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.calibdata import read_rows
    from tests.ref_calib import _cpu_awq

    samples = read_rows(args.dataset, args.samples).samples
    with load_offloaded_model(extra_cpu_mem=int(args.extra_cpu_mem)):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="auto_offload")
    caches = sorted({type(m._parameters).__name__ for m in model.modules() if len(m._parameters)})
    log(f"loaded {args.model}: parameters held by {', '.join(caches)}; {len(samples)} samples")
    with contextlib.ExitStack() as stack:
        if args.method == "awq":
            stack.enter_context(_cpu_awq())
        oneshot(model=model, processor=AutoTokenizer.from_pretrained(args.model), dataset=dataset_for(samples),
                recipe=recipe_for(args.method, args.scheme), num_calibration_samples=len(samples),
                max_seq_length=args.seq_len, shuffle_calibration_samples=False, pipeline="sequential")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        model.save_pretrained(args.out, save_compressed=True)  # every rank: the compression is split over them
    log(f"saved {args.out} in {time.monotonic() - t0:.1f} s (world size {dist.get_world_size()}, "
        f"{torch.get_num_threads()} thread(s){', upstream fixes' if args.upstream_fixes else ''})")
    dist.barrier()
    dist.destroy_process_group()
    return args.out


if __name__ == "__main__":
    main()
