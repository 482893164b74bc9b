"""Losing no work: a supervisor killed again and again, torn journals, corrupted shards, full disks, read-only
outputs, two supervisors on one folder, and worker recycling against a leaking layer function.

Every export of this module starts at once (two at a time) in the `runs` fixture; the tests then pin one
behaviour each on what those runs recorded. Outputs are compared with an uninterrupted export's bytes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from shared import layout
from shared.messages import NON_LAYER
from tests.scenarios import cli, faultkit

LAYERS = 3
PARTS = LAYERS + 1
PARALLEL = int(os.environ.get("SUPERVISOR_TEST_PARALLEL", "2"))
KILLS = 5
LEAK_MIB = 50


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS)


# ---- the runs ------------------------------------------------------------------------------------------------
def _gone(procs, timeout: float) -> tuple[float, list]:
    """Wait until every process has exited (a zombie counts: it runs no code); (seconds, the ones still alive)."""
    t0 = time.monotonic()
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, alive
        time.sleep(0.02)


def _tear(out: str) -> str:
    """Append the first half of the journal's last record, as a supervisor killed mid-write would leave it."""
    path = os.path.join(out, ".export", "journal.jsonl")
    with open(path, "rb") as f:
        last = f.read().splitlines(keepends=True)[-1]
    with open(path, "ab") as f:
        f.write(last[:len(last) // 2])
    return last[:len(last) // 2].decode()


def _second_supervisor(job: str) -> dict:
    t = time.monotonic()
    r = cli.run("run", job, "--json", check=False)
    return {"rc": r.returncode, "stderr": r.stderr, "stdout": r.stdout, "seconds": time.monotonic() - t}


def _wait_until(check, what: str, timeout: float = 300.0, run=None):
    """Poll `check()` until it returns something truthy (an event, not a clock: the bound only catches a hang)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if run is not None and run.proc.poll() is not None:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.02)
    return got


# Where each round's supervisor is killed: on an event it reached, never after a delay, so the moments are the
# same on a busy machine and on a fast worker. A "stall" fault holds the child at a point (heartbeats go on) and
# writes its marker; the test kills the supervisor once the marker exists. Every round leaves parts to do.
KILL_POINTS = [
    ("importing", None),  # the warm parent exists and is still importing: no worker yet
    ("stalled", {"point": "quantize", "action": "stall"}),  # a part quantized, nothing written
    ("stalled", {"point": "write_tmp", "action": "stall"}),  # the shard's temp file written, not synced
    ("stalled", {"point": "staged", "action": "stall"}),  # the shard staged (synced), not placed or journaled
    ("journaled", None),  # the first LayerWritten event: that shard is journaled
]
assert len(KILL_POINTS) == KILLS


def _kill_loop(model: str, folder: str) -> dict:
    """SIGKILL the supervisor KILLS times in a row, each at a different moment of a part's life, then let a last
    run finish."""
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out)
    rounds, second, torn = [], None, None
    for i, (moment, fault) in enumerate(KILL_POINTS):
        marker = os.path.join(folder, f"stall-{i}.json")
        env = faultkit.fault_env(dict(fault, once=marker)) if fault else None
        r = faultkit.LiveRun("run", job, "--json", env=env)
        entry = {"pid": r.pid, "moment": moment}
        if moment == "importing":
            reached = r.wait_for("Started") and _wait_until(
                lambda: psutil.Process(r.pid).children(), "the warm parent's start", run=r)
        elif moment == "stalled":
            reached = r.wait_for("Started") and _wait_until(lambda: os.path.exists(marker), "the stall", run=r)
        else:
            reached = r.wait_for("LayerWritten")
        if second is None and moment == "stalled" and reached:
            second = _second_supervisor(job) | {"first_pid": r.pid}
        if not reached or r.proc.poll() is not None:
            entry.update(finished=r.wait().rc, events=r.events)
            rounds.append(entry)
            break
        children = psutil.Process(r.pid).children(recursive=True)
        os.kill(r.pid, signal.SIGKILL)
        r.wait()
        died = faultkit.snapshot(out)
        entry["children"] = len(children)
        entry["children_exit_s"], alive = _gone(children, 10.0)
        entry["orphans"] = [p.pid for p in alive]
        for p in alive:
            p.kill()
        gone = faultkit.snapshot(out)
        # While its death signal travels (supervisor -> warm parent -> worker: milliseconds), a worker may still
        # finish writing its shard; which files that touched is checked below (never the journal).
        entry["changed_while_dying"] = sorted(k for k in died.keys() | gone.keys() if died.get(k) != gone.get(k))
        time.sleep(0.3)  # a survivor would write within this window; nothing may change (checked below)
        entry["wrote_after_death"] = faultkit.snapshot(out) != gone
        entry["events"] = r.events
        entry["journaled"] = faultkit.journal_shards(out)
        if torn is None and entry["journaled"]:
            torn = {"round": i, "text": _tear(out), "journaled": entry["journaled"]}
        rounds.append(entry)
    final = faultkit.run("run", job, "--json")
    return {"rounds": rounds, "second": second, "torn": torn, "final": final, "out": out}


def _corrupted(model: str, folder: str, ref: dict) -> dict:
    """A finished export whose shards were damaged after they were journaled: verify, then run again."""
    out = os.path.join(folder, "out")
    shutil.copytree(ref["out"], out)
    with open(os.path.join(out, "model-layer-00001.safetensors"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))  # same size: only the hash can tell
    with open(os.path.join(out, "model-layer-00002.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) - 100)
    with open(os.path.join(out, "config.json"), "ab") as f:
        f.write(b" ")
    job = faultkit.job_file(folder, model, out)
    verify_before = cli.run("verify", out, check=False)
    verify_json = cli.run("verify", out, "--json", check=False)
    rerun = faultkit.run("run", job, "--json")
    verify_after = cli.run("verify", out, check=False)
    return {"verify_before": verify_before, "verify_json": verify_json, "rerun": rerun,
            "verify_after": verify_after, "out": out}


def _enospc(model: str, folder: str) -> dict:
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out)
    env = faultkit.fault_env({"point": "write_tmp", "action": "enospc", "index": 1})
    full = faultkit.run("run", job, "--json", env=env)
    files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    again = faultkit.run("run", job, "--json")
    return {"full": full, "files": files, "again": again, "out": out}


MOUNT_NS = ("unshare", "-m")  # a private mount namespace: tmpfs and read-only binds without touching the host


def _in_mount_namespace(script: str, folder: str, **env) -> subprocess.CompletedProcess | None:
    """Run a bash script in a private mount namespace; None where namespaces or mounts are not allowed."""
    if shutil.which("unshare") is None:
        return None
    path = os.path.join(folder, "script.sh")
    with open(path, "w") as f:
        f.write(script)
    full_env = dict(os.environ, SUP=cli.SUPERVISOR, **env)
    full_env.pop(faultkit.FAULT_ENV, None)
    for cmd in (MOUNT_NS, ("unshare", "-Urm")):
        proc = subprocess.run([*cmd, "bash", path], capture_output=True, text=True, env=full_env, timeout=600)
        if proc.returncode != 99 and "Operation not permitted" not in proc.stderr[:300]:
            return proc
    return None


FULL_DISK = r"""
set -u
mkdir -p "$MNT"
mount -t tmpfs -o size=${SIZE_K}k tmpfs "$MNT" || exit 99
"$SUP" run "$JOB" --json > "$DIR/full.out" 2> "$DIR/full.err"; echo $? > "$DIR/full.rc"
(cd "$OUT" && find . -type f | sort) > "$DIR/full.files"
mount -o remount,size=16m "$MNT" || exit 98
"$SUP" run "$JOB" --json > "$DIR/again.out" 2> "$DIR/again.err"; echo $? > "$DIR/again.rc"
cp -a "$OUT" "$DIR/copy"
"""


def _real_full_disk(model: str, folder: str, ref: dict) -> dict | None:
    """A real tmpfs that fills up at layer 2 (sized from the reference's shards), then grows: run, run again."""
    shard = os.path.getsize(os.path.join(ref["out"], "model-layer-00000.safetensors"))
    pages = math.ceil(shard / 4096)
    size_k = 4 * (2 * pages + pages // 2 + 3)  # two layer shards, the journal, lock and log fit; a third does not
    mnt = os.path.join(folder, "disk")
    out = os.path.join(mnt, "out")
    job = faultkit.job_file(folder, model, out)
    proc = _in_mount_namespace(FULL_DISK, folder, MNT=mnt, SIZE_K=str(size_k), JOB=job, DIR=folder, OUT=out)
    if proc is None:
        return None
    assert os.path.exists(os.path.join(folder, "again.rc")), f"the script stopped early: {proc.stderr}"

    def read(name):
        with open(os.path.join(folder, name)) as f:
            return f.read()

    return {"rc": int(read("full.rc")), "stderr": read("full.err"), "events": _events(read("full.out")),
            "files": read("full.files").split(), "again_rc": int(read("again.rc")),
            "again_stderr": read("again.err"), "copy": os.path.join(folder, "copy")}


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


READ_ONLY = r"""
set -u
mkdir -p "$RO"
mount --bind "$RO" "$RO" && mount -o remount,bind,ro "$RO" || exit 99
"$SUP" run "$JOB_NEW" --json > "$DIR/new.out" 2> "$DIR/new.err"; echo $? > "$DIR/new.rc"
"$SUP" run "$JOB_EXISTING" --json > "$DIR/existing.out" 2> "$DIR/existing.err"; echo $? > "$DIR/existing.rc"
"""


def _read_only(model: str, folder: str) -> dict | None:
    ro = os.path.join(folder, "ro")
    jobs = {}
    for name, out in (("new", os.path.join(ro, "out")), ("existing", ro)):
        os.makedirs(os.path.join(folder, name))
        jobs[name] = faultkit.job_file(os.path.join(folder, name), model, out)
    t = time.monotonic()
    proc = _in_mount_namespace(READ_ONLY, folder, RO=ro, DIR=folder, JOB_NEW=jobs["new"],
                               JOB_EXISTING=jobs["existing"])
    if proc is None:
        return None
    res = {"seconds": time.monotonic() - t, "left_behind": os.listdir(ro)}
    for name in jobs:
        with open(os.path.join(folder, f"{name}.rc")) as f:
            res[name] = {"rc": int(f.read())}
        for ext in ("out", "err"):
            with open(os.path.join(folder, f"{name}.{ext}")) as f:
                res[name][ext] = f.read()
    return res


def _steady_rss(ref: dict) -> int:
    # the worker's RSS after each part of the uninterrupted run (Progress events that follow a LayerWritten)
    return max(e["worker_rss"] for e in ref["events"] if e["type"] == "Progress" and e["index"] is None)


def _recycle_by_rss(model: str, folder: str, ref: dict) -> dict:
    """Every part leaks LEAK_MIB in the child; the bound lets a worker hold one leak, not two."""
    bound_mb = math.ceil(_steady_rss(ref) / 2**20) + LEAK_MIB + LEAK_MIB // 2
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out, recycle_above_rss_mb=bound_mb)
    env = faultkit.fault_env({"point": "quantize", "action": "leak", "bytes": LEAK_MIB * 2**20})
    return {"run": faultkit.run("run", job, "--json", env=env), "bound_mb": bound_mb, "out": out}


def _recycle_by_count(model: str, folder: str) -> dict:
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out, recycle_after_layers=2)
    # every part by a worker (the supervisor's copy of the non-layer part switched off), so the four split 2 + 2;
    # the export plan, judged beside the parts, answers only once the last part (the non-layer one) is on disk, so
    # every part is written ahead of the verdict and journaled after it: recycling counts them when written
    env = faultkit.fault_env({"point": "plan", "action": "await", "timeout": 120,
                              "path": os.path.join(out, layout.shard_name(NON_LAYER))})
    env.update({faultkit.NO_COPY_AHEAD_ENV: "1", "SUPERVISOR_TEST_PLAN_BESIDE": "1"})
    return {"run": faultkit.run("run", job, "--json", env=env), "out": out}


NEEDS = {  # test -> the exports it reads
    "kills": ["test_second_supervisor_is_refused_at_once_naming_the_first",
              "test_child_of_a_killed_supervisor_exits_at_once_and_writes_nothing",
              "test_every_run_after_a_kill_resumes_all_that_was_journaled",
              "test_torn_last_journal_record_is_dropped_and_the_run_continues",
              "test_many_supervisor_kills_then_a_final_run_are_byte_identical"],
    "corrupt": ["test_verify_names_corrupted_and_truncated_files_with_exit_1",
                "test_rerun_redoes_only_the_damaged_layers_and_is_byte_identical"],
    "enospc": ["test_disk_full_fails_at_once_with_one_line_and_no_partial_shard",
               "test_disk_full_run_resumes_once_space_is_back"],
    "disk": ["test_real_full_tmpfs_fails_once_clearly_then_resumes_identically"],
    "ro": ["test_read_only_output_is_refused_before_any_work"],
    "rss": ["test_recycling_by_rss_contains_a_leaking_layer_function"],
    "count": ["test_recycling_after_n_layers_gives_each_worker_n_layers"],
}


@pytest.fixture(scope="module")
def runs(request, model, tmp_path_factory):
    """Every export the selected tests need, started at once, two at a time (faultkit.Background)."""
    root = tmp_path_factory.mktemp("reliability")

    def folder(name: str) -> str:
        os.makedirs(root / name)
        return str(root / name)

    jobs = {
        "reference": lambda: faultkit.reference(model, str(root / "reference")),
        "kills": lambda: _kill_loop(model, folder("kills")),
        "rss": lambda: _recycle_by_rss(model, folder("rss"), bg["reference"]),
        "count": lambda: _recycle_by_count(model, folder("count")),
        "enospc": lambda: _enospc(model, folder("enospc")),
        "corrupt": lambda: _corrupted(model, folder("corrupt"), bg["reference"]),
        "disk": lambda: _real_full_disk(model, folder("disk"), bg["reference"]),
        "ro": lambda: _read_only(model, folder("ro")),
    }
    bg = faultkit.Background(PARALLEL, jobs)
    bg.start(faultkit.needed(request, lambda item: [job for job, tests in NEEDS.items()
                                                    if item.originalname in tests]))
    yield bg
    bg.close()
    _write_report(bg)


def _write_report(bg) -> None:
    """SUPERVISOR_RELIABILITY_REPORT=path.json: what these runs measured (docs/reliability.md shows it)."""
    path = os.environ.get("SUPERVISOR_RELIABILITY_REPORT")
    if not path:
        return
    k, c = bg["kills"], bg["rss"]
    rounds = [{"moment": r.get("moment"), "children_exit_s": r.get("children_exit_s"), "finished": r.get("finished"),
               "journaled": sorted(r.get("journaled", [])),
               "last_event": next((e["type"] for e in reversed(r.get("events") or []) if e["type"] != "Progress"),
                                  None)} for r in k["rounds"]]
    ro = bg["ro"]
    report = {
        "kills": {"rounds": rounds, "second_rc": k["second"]["rc"], "second_s": k["second"]["seconds"],
                  "torn_round": k["torn"]["round"], "final_rc": k["final"].rc},
        "corrupt_redo": bg["corrupt"]["rerun"].of("Started")[0]["redo"],
        "enospc": bg["enospc"]["full"].stderr.strip(),
        "tmpfs": None if bg["disk"] is None else bg["disk"]["stderr"].strip(),
        "read_only": None if ro is None else {n: ro[n]["err"].strip() for n in ("new", "existing")},
        "rss": {"bound_mb": c["bound_mb"], "max_mb": max(_rss_seen(c["run"])) / 2**20,
                "workers": len(c["run"].of("WorkerStarted"))},
        "count_workers": len(bg["count"]["run"].of("WorkerStarted")),
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


# ---- supervisor killed, many times ---------------------------------------------------------------------------
def test_second_supervisor_is_refused_at_once_naming_the_first(runs):
    """A second `run` on a folder being exported exits 3 within seconds, one line naming the first's pid."""
    s = runs["kills"]["second"]
    assert s is not None, "no round reached a started worker"
    assert s["rc"] == 3, s["stderr"]
    lines = s["stderr"].strip().splitlines()
    assert len(lines) == 1 and f"pid {s['first_pid']}" in lines[0], s["stderr"]
    assert s["seconds"] < 5 and not s["stdout"].strip()


def test_child_of_a_killed_supervisor_exits_at_once_and_writes_nothing(runs):
    """After its supervisor is SIGKILLed, the child exits within 2 s, leaves no orphan and writes no file once gone;
    in the milliseconds it takes to die it touches at most a shard's temp file or the shard it renames into place
    (never the journal, which only the supervisor writes: a re-run redoes such a shard)."""
    killed = [r for r in runs["kills"]["rounds"] if "children" in r]
    assert killed
    for r in killed:
        assert r["children"] >= 1, r  # a worker was running when the supervisor died
        assert r["orphans"] == [] and r["children_exit_s"] < 2.0, r
        assert not r["wrote_after_death"], r
        tmp = os.path.join(".export", "tmp") + os.sep
        assert all(p.startswith(tmp) or (os.sep not in p and p.endswith(".safetensors"))
                   for p in r["changed_while_dying"]), r


def test_every_run_after_a_kill_resumes_all_that_was_journaled(runs):
    """Each re-run after a SIGKILL resumes exactly the shards journaled before it, and the lock never blocks it."""
    k = runs["kills"]
    rounds = k["rounds"]
    nexts = [r.get("events") for r in rounds[1:]] + [k["final"].events]
    for r, nxt in zip(rounds, nexts):
        if "journaled" not in r or not nxt:
            continue
        started = nxt[0]
        assert started["type"] == "Started" and started["resumed"] == len(r["journaled"]), (started, r["journaled"])
        assert started["todo"] == started["total"] - started["resumed"] and not started["redo"]


def test_torn_last_journal_record_is_dropped_and_the_run_continues(runs):
    """Half a record appended to the journal is ignored, cut off, and the next run resumes the rest."""
    k = runs["kills"]
    torn = k["torn"]
    assert torn is not None and torn["text"], "no journal to tear"
    after = k["rounds"][torn["round"] + 1]["events"] if torn["round"] + 1 < len(k["rounds"]) else k["final"].events
    assert after[0]["type"] == "Started" and after[0]["resumed"] == len(torn["journaled"]), after[0]
    with open(os.path.join(k["out"], ".export", "journal.jsonl"), "rb") as f:
        lines = f.read().split(b"\n")
    assert lines[-1] == b""  # ends with a complete record
    for line in lines[:-1]:
        json.loads(line)  # the torn half was cut off, not glued to the next record
    assert k["final"].rc == 0


def test_many_supervisor_kills_then_a_final_run_are_byte_identical(runs):
    """After KILLS SIGKILLs of the supervisor at as many moments of a part's life, a last run gives the
    uninterrupted bytes."""
    k = runs["kills"]
    assert [r["moment"] for r in k["rounds"] if "children" in r] == [m for m, _ in KILL_POINTS], k["rounds"]
    assert k["final"].rc == 0, k["final"].stderr
    assert cli.output_bytes(k["out"]) == runs["reference"]["bytes"]


# ---- damaged shards ------------------------------------------------------------------------------------------
def test_verify_names_corrupted_and_truncated_files_with_exit_1(runs):
    """`verify` after a shard was flipped, one truncated and config.json edited: exit 1, each file named."""
    c = runs["corrupt"]
    v = c["verify_before"]
    assert v.returncode == 1
    for name in ("model-layer-00001.safetensors", "model-layer-00002.safetensors", "config.json"):
        assert f"BAD  {name}" in v.stdout, v.stdout
    assert "model-layer-00000" not in v.stdout
    assert c["verify_json"].returncode == 1 and '"ok": false' in c["verify_json"].stdout


def test_rerun_redoes_only_the_damaged_layers_and_is_byte_identical(runs):
    """The next run redoes exactly the damaged shards, rewrites config.json, and verify passes again."""
    c = runs["corrupt"]
    r = c["rerun"]
    assert r.rc == 0, r.stderr
    started = r.of("Started")[0]
    assert started["redo"] == [1, 2] and started["resumed"] == PARTS - 2
    assert sorted(e["index"] for e in r.of("LayerWritten")) == [1, 2]
    assert cli.output_bytes(c["out"]) == runs["reference"]["bytes"]
    assert c["verify_after"].returncode == 0


# ---- full disk -----------------------------------------------------------------------------------------------
def test_disk_full_fails_at_once_with_one_line_and_no_partial_shard(runs):
    """ENOSPC while writing layer 1: exit 1, one line saying disk full, no retry, no shard or tmp file left."""
    e = runs["enospc"]
    r = e["full"]
    assert r.rc == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0] and "layer 1" in lines[0], r.stderr
    assert not r.of("Retrying") and len([x for x in r.of("LayerStarted") if x["index"] == 1]) == 1
    assert "model-layer-00001.safetensors" not in e["files"]
    assert not [f for f in e["files"] if f.endswith(".tmp") or f.startswith(os.path.join(".export", "tmp"))]


def test_disk_full_run_resumes_once_space_is_back(runs):
    """After the ENOSPC failure, the same job without the fault resumes and ends byte-identical."""
    e = runs["enospc"]
    again = e["again"]
    assert again.rc == 0, again.stderr
    # what was journaled before layer 1's failure, and only that: layer 0 always; the non-layer part the supervisor
    # copied itself when the export plan was judged before the failure (beside the parts it may come after)
    journaled = {x["index"] for x in e["full"].of("LayerWritten")}
    assert 0 in journaled and journaled <= {0, -1}, journaled
    assert again.of("Started")[0]["resumed"] == len(journaled)
    assert cli.output_bytes(e["out"]) == runs["reference"]["bytes"]


def test_real_full_tmpfs_fails_once_clearly_then_resumes_identically(runs):
    """On a tmpfs too small for layer 2: exit 1 at once saying disk full; grown, the re-run is byte-identical."""
    d = runs["disk"]
    if d is None:
        pytest.skip("no private mount namespace here (unshare -m / -Urm refused)")
    assert d["rc"] == 1, d["stderr"]
    lines = d["stderr"].strip().splitlines()
    assert len(lines) == 1 and "disk full" in lines[0], d["stderr"]
    assert not [e for e in d["events"] if e["type"] == "Retrying"]
    assert "./model-layer-00002.safetensors" not in d["files"]
    assert not [f for f in d["files"] if f.endswith(".tmp") or "/.export/tmp/" in f], d["files"]
    assert d["again_rc"] == 0, d["again_stderr"]
    assert cli.output_bytes(d["copy"]) == runs["reference"]["bytes"]


# ---- read-only output ----------------------------------------------------------------------------------------
def test_read_only_output_is_refused_before_any_work(runs):
    """An output on a read-only mount (new or existing folder): exit 2, one line, no event, nothing written."""
    ro = runs["ro"]
    if ro is None:
        pytest.skip("no private mount namespace here (unshare -m / -Urm refused)")
    for name in ("new", "existing"):
        r = ro[name]
        assert r["rc"] == 2, r
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and "not writable" in lines[0] and "Traceback" not in r["err"], r["err"]
        assert not r["out"].strip()
    assert ro["left_behind"] == [] and ro["seconds"] < 30


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 folder, so it is not read-only for root")
def test_output_in_an_unwritable_folder_is_refused_before_any_work(model, tmp_path):
    """An output whose parent folder is mode 0555 (non-root): exit 2, one line, nothing written."""
    parent = tmp_path / "locked"
    parent.mkdir()
    job = faultkit.job_file(str(tmp_path), model, str(parent / "out"))
    parent.chmod(0o555)
    try:
        r = cli.run("run", job, check=False)
    finally:
        parent.chmod(0o755)
    assert r.returncode == 2 and "not writable" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(parent) == []


# ---- worker recycling ----------------------------------------------------------------------------------------
def _rss_seen(r) -> list[int]:
    """The parts' workers' RSS (not the export plan's worker: it exports no part, is never recycled, and ends)."""
    return [e["worker_rss"] for e in r.of("Progress") if e["worker_rss"] and e["stage"] != "plan"] + \
        [e["peak_rss"] for e in r.of("LayerWritten")]


def test_recycling_by_rss_contains_a_leaking_layer_function(runs):
    """A child leaking 50 MiB per part is restarted when its RSS passes the bound: RSS stays under bound + 1 leak."""
    c = runs["rss"]
    r = c["run"]
    assert r.rc == 0, r.stderr
    assert len(r.of("WorkerStarted")) >= 2
    bound = c["bound_mb"] * 2**20
    assert max(_rss_seen(r)) <= bound + LEAK_MIB * 2**20, (max(_rss_seen(r)) / 2**20, c["bound_mb"])
    assert max(_rss_seen(r)) > bound - LEAK_MIB * 2**20  # the leak was real: it reached the bound
    assert cli.output_bytes(c["out"]) == runs["reference"]["bytes"]


def test_recycling_after_n_layers_gives_each_worker_n_layers(runs):
    """recycle_after_layers = 2: every worker exports exactly 2 parts, a fresh one writes config.json; identical.
    Every part is written before the export plan's verdict (held until then): counted all the same."""
    c = runs["count"]
    r = c["run"]
    assert r.rc == 0, r.stderr
    per_worker = []
    for e in r.events:  # both come as they happen (LayerWritten waits for the verdict)
        if e["type"] == "WorkerStarted":  # the one slot's workers (the export plan's announces none)
            per_worker.append(0)
        elif e["type"] == "LayerStarted":
            per_worker[-1] += 1
    assert len(r.of("LayerWritten")) == PARTS and not r.of("Retrying")
    assert per_worker == [2, 2, 0], per_worker
    assert cli.output_bytes(c["out"]) == runs["reference"]["bytes"]


# ---- clean-up when the disk is full --------------------------------------------------------------------------
def test_cleanup_restores_and_unlocks_even_when_closing_the_journal_fails(model, tmp_path, monkeypatch):
    """If closing the journal raises (full disk), clean-up still restores the live model and releases the lock."""
    from shared.job import parse_job
    from supervisor.api import Supervisor
    from supervisor.errors import LockedError
    from supervisor.output.lock import Lock, probe

    out = tmp_path / "out"
    run = Supervisor(parse_job({"source": {"path": model}, "export": {"scheme": "W4A16", "output": str(out)}}))._run
    os.makedirs(out / ".export")
    run._lock = Lock(str(out))  # the state start() leaves before its run thread: lock held, journal open
    run._lock.acquire()
    with pytest.raises(LockedError):
        probe(str(out))

    class FullDiskJournal:
        def close(self):
            raise OSError(28, "No space left on device")

    run._journal = FullDiskJournal()
    restored = []
    monkeypatch.setattr(run, "_restore_model", lambda: restored.append(True))
    with pytest.raises(OSError):
        run.cleanup()
    assert restored == [True]
    probe(str(out))  # raises LockedError if the lock were still held
