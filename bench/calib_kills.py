"""Kill matrix of a calibrated export: every stage of every layer, SIGKILLed, then the same command run again; the
folder must end byte for byte an uninterrupted export's. Not part of the test suite (each cell is two CLI runs, ~10 s
on a tiny model); tests/scenarios/test_calibrated_resume.py holds the cases the suite keeps.

    python bench/calib_kills.py --kind gemma2 --method gptq                 # every child stage x every layer
    python bench/calib_kills.py --kind qwen3moe --method awq --points forward,calibrate,propagate
    python bench/calib_kills.py --kind llama --supervisor-only              # the supervisor killed at its events

Child cells: child/faults.py's points inside a part (read, device: GPUs only, forward, calibrate, solve: GPTQ only,
propagate, quantize, write_tmp, staged, boundary, boundary_sync) on each layer, the non-layer part where a worker
writes it (index -1: offset norms rewritten), and config; the run has one attempt, so it fails, and the re-run
resumes. Supervisor cells: `supervisor run --json` SIGKILLed (alone: its workers must notice and leave) at the
first, middle and last WorkerStarted, LayerStarted, LayerWritten and Progress event, then run again. Prints one
row per cell; exit status 1 if a re-run failed or any byte differs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("SUPERVISOR_KEEP_WARM", "0")  # each run its own warm parent, as the suite does

from tests.scenarios import cli, faultkit  # noqa: E402

CHILD_POINTS = ("read", "device", "forward", "calibrate", "solve", "propagate", "quantize", "write_tmp", "staged",
                "boundary", "boundary_sync", "config")
SUPERVISOR_EVENTS = ("WorkerStarted", "LayerStarted", "LayerWritten", "Progress")


def build(kind: str, path: str, layers: int) -> str:
    from tests.models import make_tiny_model
    from tests.ref_calib import DENSE, make_tiny_dense
    from tests.ref_moe import FAMILIES, make_family_model

    if kind in ("llama", "qwen3", "qwen3moe"):
        return make_tiny_model(kind, path, layers=layers, seed=3)
    if kind in DENSE:
        return make_tiny_dense(kind, path, layers=layers, seed=3)
    if kind in FAMILIES:
        return make_family_model(kind, path, layers=layers, seed=3)
    raise SystemExit(f"unknown --kind {kind!r}: llama, qwen3, qwen3moe, {', '.join(DENSE + FAMILIES)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="llama")
    ap.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    ap.add_argument("--scheme", default="W4A16", help="NVFP4 or FP8 with --method rtn (static activation scales)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--points", default=",".join(CHILD_POINTS), help="child fault points, comma-separated")
    ap.add_argument("--supervisor-only", action="store_true", help="only the supervisor cells")
    ap.add_argument("--no-supervisor", action="store_true", help="only the child cells")
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    args = ap.parse_args()

    from tests.ref_calib import token_rows, write_jsonl

    root = Path(args.dir or tempfile.mkdtemp(prefix="calib-kills-"))
    root.mkdir(parents=True, exist_ok=True)
    src = build(args.kind, str(root / "src"), args.layers)
    data = write_jsonl(root / "ids.jsonl", token_rows(20, seed=5))

    def job(d: Path, **resources) -> str:
        return cli.write_job(d / "job.toml", src, d / "out", args.scheme, method=args.method, torch_threads=1,
                             calibration={"dataset": data, "samples": 20, "seq_len": 40}, **resources)

    ref = root / "reference"
    ref.mkdir()
    t = time.perf_counter()
    events = cli.events(cli.run("run", job(ref), "--json"))
    expected = cli.output_bytes(ref / "out")
    print(f"{args.kind} {args.method} {args.scheme}, {args.layers} layers: uninterrupted export in "
          f"{time.perf_counter() - t:.1f} s, {len(expected)} files\n")
    print("| cell | fired | first rc | re-run rc | identical |")
    print("| --- | --- | --- | --- | --- |")
    bad = 0

    def report(name: str, fired, first, d: Path) -> None:
        nonlocal bad
        second = cli.run("run", job(d), "--json", check=False)
        same = second.returncode == 0 and cli.output_bytes(d / "out") == expected
        bad += not same
        why = "" if same else " " + (second.stderr.strip().splitlines() or [""])[-1][:120]
        print(f"| {name} | {fired} | {first} | {second.returncode} | {'yes' if same else 'NO' + why} |", flush=True)

    if not args.supervisor_only:
        for point in args.points.split(","):
            indices = [None] if point == "config" else list(range(args.layers)) + \
                ([-1] if point in ("read", "quantize", "write_tmp", "staged") else [])
            for index in indices:
                if point == "boundary_sync" and index == 0:
                    continue  # layer 0's inputs are computed, never written
                d = root / f"{point}-{index}"
                d.mkdir()
                spec = {"point": point, "action": "sigkill", "once": str(d / "fired")}
                if index is not None:
                    spec["index"] = index
                first = cli.run("run", job(d, max_attempts=1), "--json", check=False,
                                env={faultkit.FAULT_ENV: json.dumps(spec)})
                report(f"child {point} {'' if index is None else index}", "yes" if (d / "fired").exists() else
                       "no (not on this path)", first.returncode, d)
    if not args.no_supervisor:
        types = [e["type"] for e in events]
        for kind in SUPERVISOR_EVENTS:
            n = types.count(kind)
            for k in sorted({0, n // 2, n - 1}) if n else []:
                d = root / f"supervisor-{kind}-{k}"
                d.mkdir()
                with faultkit.LiveRun("run", job(d), "--json") as run:
                    count = [0]

                    def nth(e, count=count, k=k):
                        count[0] += 1
                        return count[0] - 1 == k

                    seen = run.wait_for(kind, timeout=300, where=nth)
                    os.kill(run.pid, signal.SIGKILL)  # the supervisor alone: its workers must notice and leave
                    run.wait(60)
                    t0 = time.monotonic()
                    while cli.group_left(run.proc) and time.monotonic() - t0 < 30:
                        time.sleep(0.1)
                    left = cli.group_left(run.proc)
                name = f"supervisor at {kind} #{k}" + (f" ({len(left)} processes left after 30 s)" if left else "")
                bad += bool(left)
                report(name, "yes" if seen else "no", -signal.SIGKILL, d)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{bad} cell(s) failed" if bad else "\nevery re-run ended identical to the uninterrupted export")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
