"""`supervisor run | plan | status | verify | report | warm | demo`: a thin shell over the Python API.

Prints progress (rich) or, with --json, one JSON event per line on stdout. Exit codes: 0 done, 1 failed,
2 bad input (nothing written), 3 output locked by another supervisor, 130 interrupted (resumable), 143 stopped by
SIGTERM (resumable, as Ctrl-C).
Errors are one line on stderr; a Python traceback only with --debug, which also echoes the libraries' own
output (kept in the logs under OUT/.export/logs otherwise). Before any command it checks that the `supervisor`,
`child` and `shared` packages Python imports are ours (supervisor.provenance). Nothing else lives here.
"""
from __future__ import annotations

import argparse
import json
import sys

from supervisor.errors import SupervisorError

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended

# `supervisor run --help` shows this; the README shows the same file, and a test parses it.
JOB_EXAMPLE = """\
[source]
path = "models/my-llama"          # a local Hugging Face checkpoint folder with *.safetensors
[export]
scheme = "FP8_DYNAMIC"            # compressed-tensors preset name
output = "exports/my-llama-fp8"   # relative paths are relative to the job file
ignore = ["lm_head"]              # optional; default: lm_head and MoE routers
[resources]
device = "auto"                   # every visible GPU (a worker each), else the CPU
"""


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def cmd_run(args) -> int:
    from supervisor.api import Supervisor

    run = Supervisor(args.job, warm_now=True)  # first: its warm parent imports while the job is checked
    from shared import layout
    from supervisor.commands.liblog import Echo
    from supervisor.commands.progress import Display

    display = Display(json_lines=args.json, total_hint=run.plan.source.num_layers + 1)
    with Echo([layout.state_path(run.plan.output, layout.LOGS)], enabled=args.debug), run, display:
        try:
            for e in run.events():
                display.show(e)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run winds down; its last events (Cancelled) still show
            run.cancel()
            for e in run.events():
                display.show(e)
            raise
    try:
        done = run.wait()  # bounded: the run ends on its own deadlines (docs/reliability.md)
    except SupervisorError as exc:
        if args.debug and getattr(exc, "traceback", ""):
            print(exc.traceback, file=sys.stderr)
        raise
    if not args.json:
        what = "already complete" if done.already_complete else f"{done.parts} shards, {done.nbytes / 1e6:.1f} MB"
        print(f"exported {done.output} ({what}) in {done.seconds:.1f}s")
    return 0


def cmd_status(args) -> int:
    from supervisor.commands.status import status

    report = status(args.output)
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            if k == "left" and isinstance(v, list) and len(v) > 12:
                v = f"{v[:12]} … ({len(v)} in all)"
            print(f"{k:>12}: {v}")
    return 0


def cmd_verify(args) -> int:
    from supervisor.commands.status import LOADER, read_state, verify

    python = None
    if args.vllm is not None:
        from supervisor.commands import vllm_check

        python = vllm_check.vllm_python(args.vllm or None)  # a missing venv is refused before the re-hash
    quality_check = None
    if args.quality is not None:
        from supervisor.run import quality

        quality_check = quality.check(args.output, args.quality, args.samples, args.seq_len)  # bad input: first
    problems = verify(args.output)
    vllm = None
    if python is not None and not problems:
        if read_state(args.output).finalized is None:
            problems[VLLM] = "the export is not finished: run the job to the end, then verify --vllm"
        else:
            vllm = vllm_check.generate(args.output, python)
            if "error" in vllm:
                problems[VLLM] = f"vLLM refused or failed: {vllm['error']}"
    measured = None
    if quality_check is not None and not problems:
        measured = quality.measure(args.output, args.quality, args.samples, args.seq_len,
                                   on_event=(lambda e: None) if args.json else _quality_progress)
    if args.json:
        print(json.dumps({"output": args.output, "ok": not problems, "problems": problems,
                          **({"vllm": vllm} if vllm is not None else {}),
                          **({"quality": measured} if measured is not None else {})}))
    elif problems:
        for fn, why in problems.items():
            print(f"BAD  {fn}: {why}")
        fix = ("see docs/fidelity.md" if list(problems) == [LOADER] else "see README, Checked with vLLM"
               if list(problems) == [VLLM] else "run the job again to redo those shards")
        print(f"{len(problems)} problem(s); {fix}")
    else:
        print(f"ok: every journaled file in {args.output} matches its digest")
        if vllm is not None:
            print(f"ok: vLLM ({python}) loaded it and generated {vllm['ids']} from the token ids "
                  f"{vllm_check.prompt_for(args.output)}")
        if measured is not None:
            from supervisor.commands.report import quality_lines

            print("\n".join(quality_lines(measured)))
    return 1 if problems else 0


def _quality_progress(e) -> None:
    from supervisor import events as ev

    if isinstance(e, ev.QualityLayer):
        print(f"quality: layer {e.index + 1}/{e.total}: rel. error {e.rel_error:.4g}, cosine {e.cosine:.6f}",
              file=sys.stderr)


VLLM = "vLLM"  # verify's problem key for `--vllm`


def cmd_plan(args) -> int:
    import msgspec

    from shared.job import to_dict
    from supervisor.api import describe, load_job
    from supervisor.commands.planview import render
    from supervisor.commands.status import arithmetic

    job = load_job(args.job)
    described = describe(job)
    if args.json:
        print(msgspec.json.encode(described).decode())
    else:
        print("\n".join(render(described, job.source.path, job.export.scheme, job.export.consumer,
                               arithmetic(to_dict(job)))))
    return 0


def cmd_report(args) -> int:
    from rich.console import Console

    from supervisor.commands import report

    rep = report.load(args.output)
    if args.html:
        report.check_html_path(args.html, rep.output)  # bad input fails before the plots are drawn
    if args.json:
        print(json.dumps(report.to_dict(rep)))
    else:
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)  # into a file or pipe: whole rows, not the 80-column default
        console.print(report.summary(rep), soft_wrap=True, highlight=False)
        console.print(report.table(rep))
        if rep.quality is not None:
            console.print("\n".join(report.quality_lines(rep.quality)), soft_wrap=True, highlight=False)
            console.print(report.quality_table(rep.quality))
        if args.modules:
            console.print(report.modules_table(rep))
    if args.html:
        plots = report.write_html(rep, args.html)
        print(f"wrote {args.html} ({len(plots)} plots)", file=sys.stderr)
    return 0


def cmd_warm(args) -> int:
    import time

    from supervisor.workers import zygote

    if args.stop:
        stopped, busy = zygote.stop_kept()
        if args.json:
            print(json.dumps({"stopped": stopped, "in_use": busy}))
            return 0
        for p in stopped:
            print(f"stopped warm parent pid {p['pid']} ({p['format']})")
        for p in busy:
            print(f"warm parent pid {p['pid']} ({p['format']}) is in use by a run: not stopped; it ends "
                  f"{p['idle']:.0f}s after that run, or run this again then")
        if not stopped and not busy:
            print("no warm parent to stop")
        return 0
    parents = zygote.kept_parents()
    if args.json:
        print(json.dumps({"kept": parents}))
        return 0
    if not parents:
        print("no warm parent is kept (resources.keep_warm)")
    for p in parents:
        age = time.time() - (p["started"] or time.time())
        state = "in use by a run" if p["in_use"] else f"idle; ends after {p['idle']:.0f}s without a run"
        print(f"pid {p['pid']}: {p['format']}, started {age:.0f}s ago, {state}")
    return 0


def cmd_demo(args) -> int:
    from supervisor.commands.demo import run_demo

    return run_demo(args.dir, scheme=args.scheme, json_lines=args.json, debug=args.debug)


class _Version(argparse.Action):
    """--version: our version and where our packages are imported from (after the provenance check)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version, where its packages are imported from, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from supervisor import provenance

        try:
            print(provenance.version_line())
        except SupervisorError as exc:
            parser.exit(exc.exit_code, f"error: {exc}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="supervisor", description="Supervised, crash-safe, layerwise export of "
                                 "quantized LLM checkpoints (compressed-tensors).")
    ap.add_argument("--version", action=_Version)
    ap.add_argument("--debug", action="store_true", help="show Python tracebacks on errors, and the libraries' "
                    "own output (torch, transformers, llm-compressor) as it is written to the logs")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", parents=[common], help="export (or resume exporting) the job in job.toml",
                       description="Export (or resume exporting) the job described in job.toml.",
                       epilog="job.toml example (every key and its default: README, 'job.toml reference'):\n\n"
                       + JOB_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="path to job.toml")
    p.add_argument("--json", action="store_true", help="print one JSON event per line instead of a progress bar")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("plan", parents=[common], help="what `run` would write: parts, and per part the tensors "
                       "quantized and kept; whether transformers would load the result")
    p.add_argument("job", help="path to job.toml")
    p.add_argument("--json", action="store_true", help="the whole plan as one JSON object")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("status", parents=[common], help="what is done and what is left in an output folder")
    p.add_argument("output")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("verify", parents=[common], help="re-hash every journaled file and check that transformers "
                       "loads every weight (exit 1 if not)")
    p.add_argument("output")
    p.add_argument("--json", action="store_true")
    p.add_argument("--vllm", nargs="?", const="", metavar="PYTHON", help="also load the finished export in vLLM "
                   "and generate a few tokens, with PYTHON, a virtualenv's Python that has vLLM (default: "
                   "./.venv-vllm/bin/python, as .ci/setup.sh builds it)")
    p.add_argument("--quality", metavar="FILE", help="also measure how much the export lost against its source "
                   "over the held-out samples in FILE (JSONL, the calibration file's form): kl, top1, both "
                   "perplexities and per-layer hidden-state error, one layer at a time (docs/quality.md)")
    p.add_argument("--samples", type=int, default=64, help="--quality: the first N lines of FILE (default 64)")
    p.add_argument("--seq-len", type=int, default=2048, help="--quality: each sample truncated to this many "
                   "tokens (default 2048)")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("report", parents=[common], help="per layer: time, bytes, peak memory, retries and "
                       "quantization error, from the journal (finished or not)")
    p.add_argument("output")
    p.add_argument("--html", metavar="FILE", help="also write one self-contained HTML page with a plot per column")
    p.add_argument("--modules", action="store_true", help="also print every module's quantization error")
    p.add_argument("--json", action="store_true", help="print the journal's figures as one JSON object instead")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("warm", parents=[common], help="list the warm parents kept between runs "
                       "(resources.keep_warm), or stop them")
    p.add_argument("--stop", action="store_true", help="stop every kept warm parent that no run is using")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_warm)
    p = sub.add_parser("demo", parents=[common], help="build a small model locally, export it, load the result with transformers")
    p.add_argument("dir", nargs="?", default="demo", help="working folder (default: ./demo)")
    p.add_argument("--scheme", default="FP8_DYNAMIC")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)
    return ap


class _Terminated(KeyboardInterrupt):
    """SIGTERM (`kill PID`): stops a run as Ctrl-C does (the export is cancelled, its state kept, resumable)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import signal

    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a parent that set its own disposition keeps it
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from supervisor import provenance

        provenance.check()  # before anything imports `shared` or starts a child
        return args.func(args)
    except KeyboardInterrupt as exc:
        _err("interrupted; the export is resumable: run the same command again")
        return EXIT_TERMINATED if isinstance(exc, _Terminated) else EXIT_INTERRUPTED
    except SupervisorError as exc:
        if args.debug:
            import traceback
            traceback.print_exc()
        _err(str(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - an unexpected bug still gets one line without --debug
        if args.debug:
            raise
        _err(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
