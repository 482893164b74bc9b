"""Where AWQ's grid search goes, measured: llm-compressor's `oneshot` with `AWQModifier` (the library as released,
the recipe bench/calib_bench.py gives oneshot) on a random Llama of the 8B shape (one decoder layer by default),
each mapping's search timed (the device synchronised around it), each parent's passes over the samples timed, and
one candidate's pass per parent under torch.profiler: the device's kernel time against the pass's wall (how busy
the GPU is), the products' TFLOP and rate, and the kernels that take the most time.

    python bench/awq_probe.py                                    # 1 layer of the 8B shape, 128 x 2048, cuda
    python bench/awq_probe.py --device cpu --hidden 256 --intermediate 512 --vocab 512 --samples 4 --seq-len 64

`--untimed-passes` leaves out the waits around each pass (but the profiled one); on a GPU each pass is then timed by
CUDA events, its span on the stream, so "rest" is the search's wall outside its passes: the weights' quantization,
the losses (with `--fused`, inside each candidate's pass: awq_search adds each sample into the loss as it goes) and
the GPU's idle time. Beside it, each pass's seconds to queue on the host: near the pass's own, the device waited on
the host's Python. `--host-profile` profiles the `--profile-pass` pass with cProfile instead of torch.profiler: where
that Python goes.

`--count-syncs` (a GPU): every wait for the device during AWQ's smoothing step (the unscaled passes and the grid
searches), counted by the Python line that made it (torch.cuda.set_sync_debug_mode("warn")).

`--fused`: with the product's eager attention installed (child/backends/eager_attention.py: the one-kernel softmax
or the fused prefix, and the rotary kernel, each call kind checked against the library's), and AWQ's search as the
product runs it (child/backends/awq_capture.py: the unscaled outputs from the forward, the activation sums on the
device; child/backends/awq_search.py: the grid's waits at its end, each candidate's pass and loss sample by
sample, replayed from a CUDA graph where child/backends/graphed_pass.py applies), as an AWQ worker on a GPU runs the
search. SUPERVISOR_TEST_KERNELS=nograph: the passes eager, for comparison.

`--overlap N`: could the searches of two mappings run side by side, bit for bit? N samples through one decoder
layer's eager attention (the q/k/v search's parent) R times and through its MLP (the gate/up search's parent) R
times, one after the other on one stream, then at once from two threads on two streams; the seconds of each and
whether every output is bit-equal (`--only-overlap`: without the oneshot run).

Nothing here changes what the library computes: the timers wrap `AWQModifier._compute_best_scale`, `_run_samples`
and `_compute_loss` (with `--fused`, awq_search's `_candidate_loss`) and call them unchanged.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from calib_bench import save_tokenizer, write_dataset  # noqa: E402
from export_bench import add_shape_args, build  # noqa: E402

GEMM_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "sm80_", "ampere_", "cublas")


def kernel_summary(prof, wall: float, top: int) -> list[str]:
    """The profiled pass's device kernels: their total time against the pass's wall, the products' share and rate."""
    import torch

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    flops = sum(getattr(e, "flops", 0) or 0 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
    if not kernels:  # a CPU run: the operators' own time instead
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        return [f"  products {flops / 1e12:.3f} TFLOP; no device kernels (CPU run)", table]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        entry = by_name[e.name[:90]]
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us() / 1e6
    total = sum(s for _, s in by_name.values())
    gemm = sum(s for n, (_, s) in by_name.items() if any(w in n.lower() for w in GEMM_WORDS))
    lines = [f"  wall {wall:.3f} s; kernels {total:.3f} s ({100 * total / wall:.0f}% of the wall), of which products "
             f"{gemm:.3f} s; products {flops / 1e12:.2f} TFLOP"
             + (f" at {flops / gemm / 1e12:.0f} TFLOP/s" if gemm else "")]
    for name, (count, secs) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"    {secs:7.3f} s  {count:6d}x  {name}")
    return lines


def prepare(args) -> tuple[str, str]:
    """The random model (with its tokenizer) and the samples in args.workdir, built where they are not there yet."""
    src, data = os.path.join(args.workdir, "model"), os.path.join(args.workdir, "data.jsonl")
    if not os.path.isdir(src):
        os.makedirs(args.workdir, exist_ok=True)
        t = time.perf_counter()
        build(args, src)
        save_tokenizer(src, args.vocab)
        print(f"built {args.layers} layer(s) of hidden {args.hidden} in {time.perf_counter() - t:.1f} s", flush=True)
    if not os.path.exists(data):
        write_dataset(data, args.samples, args.seq_len, args.vocab)
    return src, data


def add_probe_args(ap: argparse.ArgumentParser) -> None:
    """The options both AWQ probes take: the model's shape (one layer by default), the samples, scheme, device."""
    add_shape_args(ap)
    ap.set_defaults(layers=1)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--scheme", default="W4A16")
    ap.add_argument("--device", default="cuda", help="cuda (oneshot onloads each layer to the first GPU) or cpu")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "awq-probe"))


def run_oneshot(args, src: str, data: str, loaded=lambda model: None) -> float:
    """oneshot with `[AWQModifier(), QuantizationModifier(scheme)]` (the recipe bench/calib_bench.py gives it) on
    the model in `src` over the samples in `data`, the library's pinning skipped on the CPU (it raises without an
    accelerator; child/backends/calibrate.py does the same); `loaded(model)` once the model is loaded. Its seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    if not args.device.startswith("cuda"):
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache._pin_intermediate = classmethod(lambda c, value: None)
    rows = [json.loads(line)["input_ids"] for line in open(data)]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    loaded(model)
    recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])]
    t = time.perf_counter()
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(src),
            dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}),
            recipe=recipe, num_calibration_samples=len(rows), max_seq_length=args.seq_len,
            shuffle_calibration_samples=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap)
    ap.add_argument("--profile-pass", type=int, default=2,
                    help="which pass of each parent to profile (0 is the unscaled one; -1: none)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per profiled pass")
    ap.add_argument("--overlap", type=int, default=0, metavar="N", help="samples for the side-by-side test (0: none)")
    ap.add_argument("--rounds", type=int, default=4, help="passes of each parent in the side-by-side test")
    ap.add_argument("--only-overlap", action="store_true")
    ap.add_argument("--untimed-passes", action="store_true",
                    help="no wait around each pass (but the profiled one): each search's seconds as it runs")
    ap.add_argument("--fused", action="store_true", help="the product's fused attention and AWQ search installed")
    ap.add_argument("--host-profile", action="store_true",
                    help="profile the --profile-pass pass of each parent on the host (cProfile: where its Python "
                         "goes) instead of the device's kernels")
    ap.add_argument("--count-syncs", action="store_true",
                    help="on a GPU: every wait for the device during AWQ's smoothing (the searches), by the line that "
                         "made it (torch.cuda.set_sync_debug_mode)")
    args = ap.parse_args()
    args.torch_device = "cpu"
    if args.only_overlap:
        return overlap(args)

    src, data = prepare(args)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmcompressor.modifiers.transform.awq import base as awq_base

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names: dict[int, str] = {}
    passes: dict[str, list[float]] = defaultdict(list)
    hosts: dict[str, list[float]] = defaultdict(list)  # --untimed-passes on a GPU: each pass's seconds to queue
    searches: list[tuple[str, str, float]] = []
    losses: list[float] = []
    profiles: list[str] = []
    cls = awq_base.AWQModifier
    product = contextlib.ExitStack()  # the product's search, installed first: the timers below wrap it
    if args.fused:
        sys.path.insert(0, os.path.dirname(HERE))
        from child.backends import awq_search
        from child.backends.awq_capture import AWQCapture

        from child import faults

        # its losses no longer go through _compute_loss; its passes replayed from CUDA graphs as the product's are
        # (SUPERVISOR_TEST_KERNELS=nograph: eager)
        product.enter_context(awq_search.installed(graphs=faults.switched("graph", True)))
        product.enter_context(AWQCapture().installed())  # a served unscaled pass is timed at about 0 s
    run_samples, best_scale, compute_loss = cls._run_samples, cls._compute_best_scale, cls._compute_loss

    def timed(call):
        """`call(self, module, ...)`, a pass of `module` over the cached samples, timed as one of its parent's
        passes (or profiled)."""
        def timed_pass(self, module, *a, **k):
            name = names.get(id(module), type(module).__name__)
            index = len(passes[name])
            if args.untimed_passes and index != args.profile_pass:
                if not cuda:
                    passes[name].append(float("nan"))
                    hosts[name].append(float("nan"))
                    return call(self, module, *a, **k)
                # timed on the device by events (no wait): the pass's span on the stream, read after the search
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t = time.perf_counter()
                out = call(self, module, *a, **k)
                hosts[name].append(time.perf_counter() - t)
                end.record()
                passes[name].append((start, end))
                return out
            hosts[name].append(float("nan"))  # a pass with waits around it: its host time is not its own
            sync()
            t = time.perf_counter()
            if index == args.profile_pass and args.host_profile:
                import cProfile
                import io
                import pstats

                host = cProfile.Profile()
                host.enable()
                out = call(self, module, *a, **k)
                host.disable()
                sync()
                wall = time.perf_counter() - t
                text = io.StringIO()
                pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
                profiles.append(f"{name}, pass {index} (on the host under cProfile, which slows it; wall {wall:.3f} s)"
                                ":")
                profiles.extend(line for line in text.getvalue().splitlines() if line.strip()
                                and "Ordered by" not in line and "List reduced" not in line)
            elif index == args.profile_pass:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=activities, with_flops=True) as prof:
                    out = call(self, module, *a, **k)
                    sync()
                wall = time.perf_counter() - t
                profiles.append(f"{name}, pass {index} (profiled; its wall includes the profiler):")
                profiles.extend(kernel_summary(prof, wall, args.top))
            else:
                out = call(self, module, *a, **k)
                sync()
            passes[name].append(time.perf_counter() - t)
            return out
        return timed_pass

    def timed_best_scale(self, mapping, *a, **k):
        sync()
        t = time.perf_counter()
        out = best_scale(self, mapping, *a, **k)
        sync()
        for key, values in passes.items():  # the events recorded in this search are complete: their seconds
            passes[key] = [v[0].elapsed_time(v[1]) / 1e3 if isinstance(v, tuple) else v for v in values]
        balance = ",".join(n.rsplit(".", 1)[-1] for n in mapping.balance_names)
        searches.append((f"{mapping.smooth_name.rsplit('.', 1)[-1]} -> {balance}", mapping.parent_name,
                         time.perf_counter() - t))
        return out

    def timed_loss(self, *a, **k):
        t = time.perf_counter()
        out = compute_loss(self, *a, **k)  # ends in .item(): synchronised
        losses.append(time.perf_counter() - t)
        return out

    cls._run_samples, cls._compute_best_scale, cls._compute_loss = timed(run_samples), timed_best_scale, timed_loss
    if args.fused:  # awq_search runs each candidate's pass and its loss together, sample by sample
        awq_search._candidate_loss = timed(awq_search._candidate_loss)

    syncs: dict[str, int] = defaultdict(int)  # --count-syncs: "file:line" -> waits for the device made there
    if args.count_syncs and cuda:
        import warnings

        smoothing = cls._apply_smoothing

        def counted_smoothing(self, *a, **k):
            sync()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return smoothing(self, *a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    for w in caught:  # the probe's own waits (its timers) left out
                        if "synchroniz" in str(w.message) and os.path.abspath(w.filename) != os.path.abspath(__file__):
                            where = w.filename.split("site-packages/")[-1].replace(os.path.dirname(HERE) + "/", "")
                            syncs[f"{where}:{w.lineno}"] += 1

        cls._apply_smoothing = counted_smoothing

    def loaded(model):
        names.update({id(m): n for n, m in model.named_modules()})
        print(f"attention: {model.config._attn_implementation}; torch {torch.__version__}; device "
              f"{torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)

    fused = contextlib.ExitStack()
    if args.fused:
        sys.path.insert(0, os.path.dirname(HERE))
        from child.backends import eager_attention, rotary, warp_softmax

        def loaded(model, named=loaded):  # noqa: F811
            named(model)
            fused.enter_context(eager_attention.installed(model))
            print(f"fused attention installed; the one-kernel softmax: {warp_softmax.available() or 'available'}",
                  flush=True)
    with product, fused:
        total = run_oneshot(args, src, data, loaded)
    if args.fused:
        print(f"after the run, the one-kernel softmax: {warp_softmax.available() or 'on'} (packed halves "
              f"{warp_softmax.PACK}, shared memory {warp_softmax.SMEM}); the rotary kernel: "
              f"{(rotary.available() or 'on') if rotary.ENABLED else 'not enabled'}", flush=True)

    print(f"\noneshot AWQ {args.scheme}, {args.layers} layer(s), {args.samples} x {args.seq_len}: {total:.1f} s; "
          f"grid searches {sum(s for *_, s in searches):.1f} s"
          # the library's _compute_loss; with --fused awq_search adds each loss inside the candidates' passes
          + (f"; losses {sum(losses):.2f} s over {len(losses)} calls" if losses else ""))
    print("| mapping | parent | search s | passes | mean pass s | first (unscaled) s | rest of the search s "
          "| mean s to queue a pass |")
    print("|---|---|---|---|---|---|---|---|")
    used: dict[str, int] = defaultdict(int)
    for mapping, parent, secs in searches:
        # each search's passes are the next 1 + grid of its parent's (the unscaled pass runs just before it)
        mine = passes.get(parent, [])
        n = (len(mine) // max(1, sum(1 for _, p, _ in searches if p == parent)))
        chunk = mine[used[parent]:used[parent] + n]
        used[parent] += n
        grid = chunk[1:]
        skipped = [s for i, s in enumerate(grid, 1) if used[parent] - n + i != args.profile_pass]
        mean = sum(skipped) / len(skipped) if skipped else float("nan")
        queued = [q for q in hosts.get(parent, [])[used[parent] - n + 1:used[parent]] if q == q]  # untimed ones
        queue = sum(queued) / len(queued) if queued else float("nan")
        print(f"| {mapping} | {parent} | {secs:.2f} | {len(chunk)} | {mean:.3f} | "
              f"{chunk[0] if chunk else float('nan'):.3f} | {secs - sum(grid):.2f} | {queue:.3f} |")
    print("\n(mean pass: the candidates' passes without the profiled one; rest: the search's time outside its passes)")
    if args.fused:
        print("(with --fused each candidate's pass includes its loss: awq_search adds each sample into it as it goes)")
    if args.untimed_passes and cuda:
        print("passes timed on the device by events (no waits); to queue: the host's seconds from a pass's start to "
              "its last launch (close to the pass's: the device waited on the host)")
    if args.count_syncs and cuda:
        print(f"\nwaits for the device during the smoothing (the searches): {sum(syncs.values())}, by where:")
        for where, count in sorted(syncs.items(), key=lambda kv: -kv[1]):
            print(f"  {count:6d}  {where}")
    if profiles:
        print("\n" + "\n".join(profiles))
    if cuda:
        print(f"\npeak GPU allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if args.overlap:  # the oneshot model is gone with run_oneshot's return
        overlap(args)


def overlap(args) -> None:
    """The q/k/v search's parent (eager attention) and the gate/up search's (the MLP) over the same N samples, R
    passes each: serially on one stream, then from two threads on two streams; seconds and bit-equality."""
    import threading

    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    cuda = device.type == "cuda"
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_attention_heads=32 if args.hidden >= 4096 else 8, num_key_value_heads=8)
    cfg._attn_implementation = "eager"  # as llm-compressor's calibration forces
    torch.manual_seed(0)
    with torch.device(device):
        layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).eval()
        for prm in layer.parameters():
            prm.data.normal_(0, 0.02)
        rotary = LlamaRotaryEmbedding(cfg)
        xs = [torch.randn(1, args.seq_len, args.hidden, dtype=torch.bfloat16) for _ in range(args.overlap)]
        pos = torch.arange(args.seq_len).unsqueeze(0)
        mask = torch.full((1, 1, args.seq_len, args.seq_len), torch.finfo(torch.bfloat16).min,
                          dtype=torch.bfloat16).triu(1)
    emb = rotary(xs[0], pos)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def attention(out):
        for _ in range(args.rounds):
            out[:] = [layer.self_attn(x, position_embeddings=emb, attention_mask=mask)[0] for x in xs]

    def mlp(out):
        for _ in range(args.rounds):
            out[:] = [layer.mlp(x) for x in xs]

    def on_stream(fn, out, stream):
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            fn(out)

    with torch.no_grad():
        a0, m0 = [], []
        attention(a0), mlp(m0)  # first use: kernels loaded, memory cached
        sync()
        times = {}
        for name, fn, out in (("attention", attention, a0), ("mlp", mlp, m0)):
            t = time.perf_counter()
            fn(out)
            sync()
            times[name] = time.perf_counter() - t
        a1, m1 = [], []
        streams = [torch.cuda.Stream(device) if cuda else None for _ in range(2)]
        sync()
        t = time.perf_counter()
        threads = [threading.Thread(target=on_stream, args=(attention, a1, streams[0])),
                   threading.Thread(target=on_stream, args=(mlp, m1, streams[1]))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        sync()
        both = time.perf_counter() - t
    equal = all(torch.equal(x, y) for x, y in zip(a0 + m0, a1 + m1)) and len(a1) == len(a0) and len(m1) == len(m0)
    serial = times["attention"] + times["mlp"]
    print(f"\nside by side, {args.overlap} x {args.seq_len}, {args.rounds} passes each: attention {times['attention']:.2f} s, "
          f"MLP {times['mlp']:.2f} s, one after the other {serial:.2f} s; at once on two streams {both:.2f} s "
          f"({100 * (1 - both / serial):.0f}% less); every output bit-equal: {equal}")


if __name__ == "__main__":
    main()
