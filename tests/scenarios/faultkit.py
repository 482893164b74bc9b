"""Fault-injection helpers shared by the reliability suites and `bench/soak.py`.

- the fault matrix's vocabulary (points, actions, what the supervisor must say for each) and `plan_runs`, which
  packs many (point, action) cells into few exports: each cell fires once on its own part, a start fault chained
  after a layer fault fires on the restart that follows it, config faults fire on successive finalize attempts;
- `LiveRun`: the real `supervisor run --json` as a subprocess, each event stamped with its arrival time, so a
  test can kill it at a chosen moment and measure how long the supervisor took to notice a fault;
- `reference`: an uninterrupted export per model, made once per process and shared by every suite;
- snapshots and byte comparisons of output folders.
It never imports `supervisor` or `child`: tests see them only through the CLI and the files they write.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from tests.scenarios import cli

FAULT_ENV = "SUPERVISOR_TEST_FAULT"
LAYER_POINTS = ("read", "quantize", "write_tmp", "staged")
POINTS = ("start",) + LAYER_POINTS + ("config",)
ACTIONS = ("sigkill", "sigsegv", "exit", "raise", "memoryerror", "hang", "garbage", "truncated", "oversized")
# What the supervisor's Retrying.reason must contain for each action (the child's death, its report, or the
# protocol failure as the supervisor saw it).
REASON = {
    "sigkill": "SIGKILL", "sigsegv": "SIGSEGV", "exit": "exited with code 7", "raise": "injected fault",
    "memoryerror": "MemoryError", "hang": "no heartbeat", "garbage": "bad frame",
    "truncated": "stalled inside a frame", "oversized": "exceeds the cap",
}
STALLS = ("hang", "truncated")  # noticed when the heartbeat timeout runs out; every other action at once
SCHEME = "W4A16"
HEARTBEAT_TIMEOUT = 3.0
# Bounds on fault -> Retrying, with room for a 2-core machine running two exports at once (measured well
# below these: see docs/reliability.md).
NOTICE_AT_ONCE = 3.0
NOTICE_STALL = HEARTBEAT_TIMEOUT + 3.0


def notice_bound(action: str) -> float:
    return NOTICE_STALL if action in STALLS else NOTICE_AT_ONCE


@dataclass(frozen=True)
class Cell:
    point: str
    action: str

    @property
    def name(self) -> str:
        return f"{self.point}-{self.action}"


@dataclass
class RunPlan:
    """One export that exercises several cells: the fault list for SUPERVISOR_TEST_FAULT and what to expect."""

    faults: list[dict] = field(default_factory=list)
    expect: dict[Cell, object] = field(default_factory=dict)  # cell -> the part its Retrying names (None: config;
    # a tuple: any of them, see accepted())
    markers: dict[Cell, str] = field(default_factory=dict)
    max_attempts: int = 2


def plan_runs(cells: list[Cell], parts: list[int], folder: str, config_per_run: int = 2) -> list[RunPlan]:
    """Pack cells into as few exports as the parts allow; every cell fires exactly once, on its own attempt."""
    layer = [c for c in cells if c.point in LAYER_POINTS]
    start = [c for c in cells if c.point == "start"]
    config = [c for c in cells if c.point == "config"]
    n = max(1, math.ceil(len(layer) / len(parts)), math.ceil(len(config) / config_per_run),
            math.ceil(len(start) / (len(parts) + 1)))
    plans = []
    for r in range(n):
        p = RunPlan()
        for k, c in enumerate(layer[r::n]):  # one layer fault per part; each run starts on another part
            _add_layer(p, c, parts[(k + r) % len(parts)], folder)
        for c in start[r::n]:
            _add_start(p, c, parts, folder)
        for c in config[r::n]:
            _add_config(p, c, folder)
        p.max_attempts = 1 + max(_faults_on(p, part) for part in [*parts, None])
        plans.append(p)
    return plans


def _marker(folder: str, c: Cell) -> str:
    return os.path.join(folder, f"{c.name}.fired")


def _add_layer(p: RunPlan, c: Cell, part: int, folder: str) -> None:
    p.markers[c] = _marker(folder, c)
    p.faults.append({"point": c.point, "action": c.action, "index": part, "once": p.markers[c]})
    p.expect[c] = part


def _add_start(p: RunPlan, c: Cell, parts: list[int], folder: str) -> None:
    chained = {f.get("after") for f in p.faults if f["point"] == "start"}
    hosts = [k for k in p.expect if k.point in LAYER_POINTS and p.markers[k] not in chained]
    p.markers[c] = _marker(folder, c)
    spec = {"point": "start", "action": c.action, "once": p.markers[c]}
    if hosts:  # fires on the restart that follows the host's fault: "the restart fails too"
        spec["after"] = p.markers[hosts[0]]
        # in the parts' worker only (slot 0: job_file's one worker): the export plan's own worker (the slot after
        # it) starts beside the first parts, and on a loaded machine it can reach its start after part 0's fault
        spec["worker"] = 0
        p.expect[c] = p.expect[hosts[0]]
    elif None not in chained:  # fires on the run's very first child start: part 0's, or the export plan's worker
        # (index None), which starts beside it (Scheduler.judge_beside): whichever forks first, a race under load
        p.expect[c] = (parts[0], None)
    else:
        raise ValueError(f"no room for {c.name}: more start cells than layer cells + 1 in one run")
    p.faults.append(spec)


def _add_config(p: RunPlan, c: Cell, folder: str) -> None:
    p.markers[c] = _marker(folder, c)
    p.faults.append({"point": "config", "action": c.action, "once": p.markers[c]})
    p.expect[c] = None


def _faults_on(p: RunPlan, part) -> int:
    return sum(1 for v in p.expect.values() if part in accepted(v))


def accepted(expected) -> tuple:
    """The part indices a cell's Retrying may name: one, or (a fault on the run's first child start) either of two."""
    return expected if isinstance(expected, tuple) else (expected,)


def matches_expected(got: list, expected: list) -> bool:
    """The Retrying events' indices `got` are the cells' `expected` ones, one each (accepted() alternatives too)."""
    left = list(got)
    for e in sorted(expected, key=lambda e: isinstance(e, tuple)):  # the exact ones first
        hit = next((g for g in left if g in accepted(e)), "none")
        if hit == "none":
            return False
        left.remove(hit)
    return not left


# The supervisor writes the non-layer part itself when the export plan keeps it unchanged (supervisor/run/verbatim.py);
# a fault aimed at a worker's non-layer part needs a worker to write it, so such runs switch that copy off.
NO_COPY_AHEAD_ENV = "SUPERVISOR_TEST_NO_COPY_AHEAD"


def fault_env(faults) -> dict[str, str]:
    env = {FAULT_ENV: json.dumps(faults)}
    if any(f.get("index") == -1 for f in (faults if isinstance(faults, list) else [faults])):
        env[NO_COPY_AHEAD_ENV] = "1"
    return env


def wait_marker(path, timeout: float = 120) -> bool:
    """Whether the fault whose `once` marker is `path` fired within `timeout` s (it writes the marker as it fires)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def read_marker(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class LiveRun:
    """`supervisor run JOB --json` in the background; events are dicts with an extra 'arrived' (epoch seconds)."""

    def __init__(self, *args, env: dict | None = None, prefix: list[str] = ()):
        """prefix: argv the command runs under (tests/cluster: nsenter into the cluster's network namespace)."""
        full_env = cli.run_env(env)  # no test knob (FAULT_ENV, ...) but those passed
        self.args = [str(a) for a in args]
        self.started = time.time()
        # as a terminal starts it (signals at their defaults, stdin /dev/null, a process group of its own): a test
        # that fails before it is killed has its group ended (tests/conftest.py), or `with LiveRun(...)` ends it
        self.proc = cli.start([*prefix, cli.SUPERVISOR, *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=full_env)
        self.events: list[dict] = []
        self.stderr = ""
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._read_events, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._threads:
            t.start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:
            now = time.time()
            if line.startswith("{"):
                e = json.loads(line)
                e["arrived"] = now
                with self._cond:
                    self.events.append(e)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        self.stderr = self.proc.stderr.read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> "LiveRun":
        return self

    def __exit__(self, *exc) -> None:
        cli.end_group(self.proc)  # whatever is left of its process group, SIGKILLed

    def wait_for(self, type_: str, timeout: float = 300, where: Callable[[dict], bool] | None = None) -> dict | None:
        """The first event of this type (for which `where` holds), waiting for it; None if the run ended without."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if e["type"] == type_ and (where is None or where(e)):
                        return e
                if self.proc.poll() is not None and not self._threads[0].is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {type_} event within {timeout}s")
                self._cond.wait(min(left, 0.2))

    def wait(self, timeout: float = 600) -> "LiveRun":
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            cli.end_group(self.proc)
            raise
        for t in self._threads:
            t.join()
        self.ended = time.time()
        return self

    @property
    def rc(self) -> int | None:
        return self.proc.returncode

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]


def run(*args, env: dict | None = None, timeout: float = 600, prefix: list[str] = ()) -> LiveRun:
    return LiveRun(*args, env=env, prefix=prefix).wait(timeout)


class Background:
    """Named exports run in a thread pool (a CLI export is mostly one child's imports: two overlap well on
    two cores). `start` submits the ones the selected tests need, reference first, so `-k` runs only those;
    `[name]` submits on first use and waits."""

    def __init__(self, workers: int, jobs: dict[str, Callable[[], object]]):
        self.jobs = jobs
        self._pool = ThreadPoolExecutor(workers)
        self._futs: dict[str, Future] = {}
        self._lock = threading.Lock()

    def start(self, names) -> None:
        for name in dict.fromkeys(["reference", *names]):  # first: dependants wait on it, never it on them
            self._submit(name)

    def _submit(self, name: str) -> Future:
        with self._lock:
            if name not in self._futs:
                self._futs[name] = self._pool.submit(self.jobs[name])
            return self._futs[name]

    def __getitem__(self, name: str):
        return self._submit(name).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def needed(request, needs: Callable[[object], list[str]]) -> list[str]:
    """The jobs the selected tests of the requesting module need, plus the reference."""
    names = ["reference"]
    for item in request.session.items:
        if item.module is request.module:
            names += needs(item)
    return names


_refs: dict[str, dict] = {}
_refs_lock = threading.Lock()


def reference(model: str, folder: str) -> dict:
    """An uninterrupted export of `model` (W4A16), once per process: {'bytes', 'events', 'out'}."""
    with _refs_lock:
        if model not in _refs:
            os.makedirs(folder, exist_ok=True)
            job = cli.write_job(os.path.join(folder, "job.toml"), model, os.path.join(folder, "out"), SCHEME)
            r = run("run", job, "--json")
            assert r.rc == 0, r.stderr
            _refs[model] = {"bytes": cli.output_bytes(os.path.join(folder, "out")), "events": r.events,
                            "out": os.path.join(folder, "out")}
        return _refs[model]


def job_file(folder: str, model: str, out: str, **resources) -> str:
    """A job for one fault scenario: one worker unless asked (a fault and its retry then meet one worker's parts in
    order; several workers under faults are tests/scenarios/test_workers.py's)."""
    resources.setdefault("workers", 1)
    resources.setdefault("heartbeat_timeout", HEARTBEAT_TIMEOUT)
    resources.setdefault("startup_timeout", 120)
    return cli.write_job(os.path.join(folder, "job.toml"), model, out, SCHEME, **resources)


def snapshot(folder: str) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file under folder."""
    out = {}
    for d, _, files in os.walk(folder):
        for fn in files:
            p = os.path.join(d, fn)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, folder)] = (st.st_size, st.st_mtime_ns)
    return out


def bytes_differing(expected: str, got: str) -> int:
    """How many bytes of the export in `got` differ from `expected` (files outside .export; a missing or extra
    file counts whole)."""
    names = {n for f in (expected, got) for n in os.listdir(f) if n != ".export"
             and os.path.isfile(os.path.join(f, n))}
    total = 0
    for n in sorted(names):
        a, b = _read(os.path.join(expected, n)), _read(os.path.join(got, n))
        if a is None or b is None:
            total += len(a or b or b"")
            continue
        total += abs(len(a) - len(b)) + sum(x != y for x, y in zip(a, b))
    return total


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def journal_shards(out: str) -> set[int]:
    """Indices with a complete Shard line in the journal (read independently of supervisor.output.journal)."""
    done = set()
    try:
        with open(os.path.join(out, ".export", "journal.jsonl"), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return done
    for line in data.split(b"\n")[:-1]:  # the part after the last newline is torn, if anything
        try:
            rec = json.loads(line)
        except ValueError:
            break
        if rec.get("type") == "Shard":
            done.add(rec["index"])
    return done
