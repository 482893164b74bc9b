"""Soak test: N exports of a small model, each with one random fault, every one compared byte for byte with an
uninterrupted export. Not part of the test suite (it takes ~20 s per run); anyone can run it:

    python bench/soak.py --runs 20                 # random faults, seed printed (rerun one with --seed)
    python bench/soak.py --runs 40 --jobs 2 --seed 7 --markdown

A fault is a (point, action) of the child (see child/faults.py: start, read, quantize, write_tmp,
staged, config x sigkill, sigsegv, exit, raise, memoryerror, hang, garbage, truncated, oversized) firing
once on a random part, or the supervisor itself SIGKILLed at a random moment after its worker started (then
the same command is run again). Prints one row per run: the fault, whether it fired, whether the export
recovered, seconds from the fault to the supervisor's Retrying (detect) and to the part being written again
(recover; includes the fresh child's ~11 s import), and how many bytes of the final folder differ from the
uninterrupted export (must be 0). Exit status 1 if any run did not recover or any byte differed.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.scenarios import faultkit  # noqa: E402
from tests.scenarios.faultkit import ACTIONS, LAYER_POINTS, POINTS  # noqa: E402

SUPERVISOR_KILL = "supervisor"


def main() -> int:
    args = parse_args()
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    rng = random.Random(seed)
    root = args.dir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(root, exist_ok=True)
    model = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        from supervisor.demo import make_model
        make_model(model, layers=args.layers, hidden=256)
    parts = list(range(args.layers)) + [-1]
    print(f"soak: {args.runs} runs, seed {seed}, model {args.layers} layers in {root}, {args.jobs} at a time",
          file=sys.stderr)
    ref = faultkit.reference(model, os.path.join(root, "reference"))
    faults = [pick(rng, parts) for _ in range(args.runs)]
    started = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda i: one_run(i, faults[i], model, root, ref, rng_for(seed, i)),
                             range(args.runs)))
    report(rows, args.markdown, time.monotonic() - started, seed)
    if not args.keep:
        shutil.rmtree(os.path.join(root, "runs"), ignore_errors=True)
    bad = [r for r in rows if not r["recovered"] or r["bytes_differed"]]
    return 1 if bad else 0


def rng_for(seed: int, i: int) -> random.Random:
    return random.Random(seed * 1000 + i)


def pick(rng: random.Random, parts: list[int]) -> dict:
    point = rng.choice(POINTS + (SUPERVISOR_KILL,))
    if point == SUPERVISOR_KILL:
        return {"point": point, "action": "sigkill", "part": None}
    part = rng.choice(parts) if point in LAYER_POINTS else None
    return {"point": point, "action": rng.choice(ACTIONS), "part": part}


def one_run(i: int, fault: dict, model: str, root: str, ref: dict, rng: random.Random) -> dict:
    folder = os.path.join(root, "runs", f"{i:03d}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out, max_attempts=3)
    row = {"run": i, **fault, "injected": False, "recovered": False, "detect_s": None, "recover_s": None}
    if fault["point"] == SUPERVISOR_KILL:
        row.update(kill_supervisor(job, rng))
    else:
        row.update(child_fault(job, fault, folder))
    row["bytes_differed"] = faultkit.bytes_differing(ref["out"], out) if os.path.isdir(out) else -1
    print(f"run {i:3d} {fault['point']:>12} {fault['action']:<11} done: recovered={row['recovered']} "
          f"bytes_differed={row['bytes_differed']}", file=sys.stderr)
    return row


def child_fault(job: str, fault: dict, folder: str) -> dict:
    marker = os.path.join(folder, "fired")
    spec = {"point": fault["point"], "action": fault["action"], "once": marker}
    if fault["part"] is not None:
        spec["index"] = fault["part"]
    r = faultkit.run("run", job, "--json", env=faultkit.fault_env(spec))
    fired = faultkit.read_marker(marker)
    res = {"injected": fired is not None, "recovered": r.rc == 0, "rc": r.rc}
    if fired is None:
        return res
    retry = next((e for e in r.of("Retrying") if e["arrived"] >= fired["time"]), None)
    if retry is not None:
        res["detect_s"] = retry["arrived"] - fired["time"]
        part = retry["index"]
        # recovered = the part that failed is written again (config.json: the export finished)
        done = next((e for e in r.events if e["arrived"] >= retry["arrived"] and (
            (e["type"] == "LayerWritten" and e["index"] == part) or (part is None and e["type"] == "Finished"))),
            None)
        if done is not None:
            res["recover_s"] = done["arrived"] - fired["time"]
    return res


def kill_supervisor(job: str, rng: random.Random) -> dict:
    r = faultkit.LiveRun("run", job, "--json")
    if r.wait_for("WorkerStarted") is None:
        r.wait()
        return {"injected": False, "recovered": r.rc == 0, "rc": r.rc}
    time.sleep(rng.uniform(0.0, 2.0))
    injected = r.proc.poll() is None
    os.kill(r.pid, signal.SIGKILL)
    r.wait()
    killed = time.time()
    again = faultkit.run("run", job, "--json")
    res = {"injected": injected, "recovered": again.rc == 0, "rc": again.rc}
    if again.rc == 0:
        res["recover_s"] = again.ended - killed
    return res


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def report(rows: list[dict], markdown: bool, seconds: float, seed: int) -> None:
    head = ["run", "point", "action", "part", "injected", "recovered", "detect s", "recover s", "bytes differed"]
    lines = []
    for r in rows:
        part = "-" if r["part"] is None else ("non-layer" if r["part"] == -1 else str(r["part"]))
        lines.append([str(r["run"]), r["point"], r["action"], part, "yes" if r["injected"] else "NO",
                      "yes" if r["recovered"] else f"NO (exit {r.get('rc')})", _s(r["detect_s"]),
                      _s(r["recover_s"]), str(r["bytes_differed"])])
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for line in lines:
            print("  ".join(x.ljust(w) for x, w in zip(line, widths)))
    injected = [r for r in rows if r["injected"]]
    detect = [r["detect_s"] for r in rows if r["detect_s"] is not None]
    recover = [r["recover_s"] for r in rows if r["recover_s"] is not None]
    print(f"\n{len(rows)} runs (seed {seed}) in {seconds:.0f} s: {len(injected)} faults injected, "
          f"{sum(r['recovered'] for r in injected)} recovered, "
          f"{sum(max(r['bytes_differed'], 0) for r in rows)} bytes differed"
          + (f"; detect median {statistics.median(detect):.2f} s, max {max(detect):.2f} s" if detect else "")
          + (f"; recover median {statistics.median(recover):.1f} s, max {max(recover):.1f} s" if recover else ""))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    ap.add_argument("--jobs", type=int, default=2, help="exports at a time (default 2)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the soak model (default 4)")
    ap.add_argument("--dir", help="working folder (default: a new temp folder); the model is reused if present")
    ap.add_argument("--keep", action="store_true", help="keep every run's output folder")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return ap.parse_args()


if __name__ == "__main__":
    sys.exit(main())
