"""Crash and resume: after a killed child or a killed supervisor, re-running gives byte-identical output."""
import json
import os
import signal
import statistics
import subprocess
import time

import psutil
import pytest

from shared.layout import JOURNAL, STATE_DIR
from tests.scenarios import cli, faultkit

SCHEME = "W4A16"
LAYERS = 8


@pytest.fixture(scope="module")
def big_model(tiny_models):
    # hidden 1024: ~18 MB of bf16 weights per layer, so a per-layer leak would show in the child's RSS
    return tiny_models("llama", layers=LAYERS, hidden=1024)


@pytest.fixture(scope="module")
def reference(big_model, tmp_path_factory):
    """An uninterrupted export on one worker (its per-layer peaks are one process's): its files' bytes and its events.
    The runs below use the default workers (two on a CPU) and must end with these bytes."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = cli.write_job(tmp / "job.toml", big_model, tmp / "out", SCHEME, workers=1)
    proc = cli.run("run", job, "--json")
    return cli.output_bytes(tmp / "out"), cli.events(proc)


def _fault(tmp_path, **spec):
    spec.setdefault("once", str(tmp_path / "fault-fired"))
    return {"SUPERVISOR_TEST_FAULT": json.dumps(spec)}


# Each layer's own peak (the child resets VmHWM per layer) varies with read-ahead timing and the machine's load:
# measured on 2 busy cores (2026-12-02), MiB per layer, [387, 366, 382, 399, 397, 369, 384, 391] and [387, 366, 382,
# 399, 397, 397, 400, 413] without a leak, [410, 419, 435, 448, 489, 501, 524, 537] with the 20 MiB a layer of the
# counter-test. So the first half's median is compared with the second half's (1.04 and 1.20 there): one layer's
# timing moves neither, a leak moves the second by half the export's layers times the leak.
RSS_TOLERANCE = 1.08


def _peaks(events):
    written = sorted((e for e in events if e["type"] == "LayerWritten" and e["index"] >= 0), key=lambda e: e["index"])
    assert len(written) == LAYERS
    peaks = [e["peak_rss"] for e in written]
    return statistics.median(peaks[:LAYERS // 2]), statistics.median(peaks[LAYERS // 2:])


def test_child_peak_rss_does_not_grow_per_layer(reference):
    """The child's peak RSS per layer does not grow: the median over the last four layers is within 8% of the median
    over the first four (8 layers on one worker, no leak)."""
    first, last = _peaks(reference[1])
    assert first > 100 * 2**20
    assert last <= first * RSS_TOLERANCE, (first, last)


def test_rss_check_catches_a_leaking_layer_function(big_model, tmp_path):
    """The same check fails on a child that leaks 20 MiB per layer (test-only fault), so it can catch a leak (one
    worker: with two, each leaks over half the layers only)."""
    job = cli.write_job(tmp_path / "job.toml", big_model, tmp_path / "out", SCHEME, workers=1)
    env = {"SUPERVISOR_TEST_FAULT": json.dumps({"point": "quantize", "action": "leak", "bytes": 20 * 2**20})}
    first, last = _peaks(cli.events(cli.run("run", job, "--json", env=env)))
    assert last > first * RSS_TOLERANCE, (first, last)


def test_child_sigkilled_then_rerun_is_byte_identical(big_model, reference, tmp_path):
    """A child SIGKILLed mid-export with no retries left fails the run; `run` again finishes identically."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME, max_attempts=1, workers=1)  # parts in order
    first = cli.run("run", job, "--json", env=_fault(tmp_path, point="quantize", action="sigkill", index=3),
                    check=False)
    assert first.returncode == 1, first.stderr
    assert "layer 3" in first.stderr and "SIGKILL" in first.stderr
    status = json.loads(cli.run("status", out, "--json").stdout)
    # the non-layer part is not left: the supervisor copied it itself, journaled once the plan was judged
    assert status["left"] == [3, 4, 5, 6, 7]
    second = cli.run("run", job, "--json")
    started = cli.events(second)[0]
    assert started["type"] == "Started" and started["resumed"] == 4
    assert cli.output_bytes(out) == reference[0]


def test_child_sigkilled_is_restarted_within_the_same_run(big_model, reference, tmp_path):
    """With attempts left, a SIGKILLed child is restarted and the layer redone; output is identical."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME)
    proc = cli.run("run", job, "--json", env=_fault(tmp_path, point="staged", action="sigkill", index=5))
    retries = [e for e in cli.events(proc) if e["type"] == "Retrying"]
    assert [r["index"] for r in retries] == [5] and "SIGKILL" in retries[0]["reason"]
    assert cli.output_bytes(out) == reference[0]


def _hold(tmp_path) -> dict:
    """A test fault that holds the child at layer 6 (heartbeats going on) until it is killed."""
    return _fault(tmp_path, point="quantize", action="stall", index=6)


def _start_run(job, env=None, **popen):
    """`supervisor run job` started as a terminal starts it (cli.start); leaving the `with` SIGKILLs whatever is
    left of its process group, so a failed test leaves no supervisor, warm parent or worker behind."""
    return cli.job([cli.SUPERVISOR, "run", job], env=cli.run_env(env), **popen)


def _wait_for_shards(out, n, proc, timeout=300):
    path = os.path.join(out, STATE_DIR, JOURNAL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                if sum('"type":"Shard"' in line for line in f) >= n:
                    return
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    raise AssertionError(f"no {n} shards within {timeout}s")


def test_supervisor_sigkilled_then_rerun_is_byte_identical(big_model, reference, tmp_path):
    """SIGKILL the supervisor mid-export: its child exits by itself, no lock blocks, re-run is identical."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME)
    with _start_run(job, env=_hold(tmp_path)) as proc:  # the export cannot end before the kill, however fast
        _wait_for_shards(str(out), 4, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "no child worker found"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"orphaned children still running: {alive}"
    second = cli.run("run", job, "--json")
    assert cli.events(second)[0]["resumed"] >= 4
    assert cli.output_bytes(out) == reference[0]


def test_completed_export_rerun_is_a_no_op(big_model, reference, tmp_path):
    """Running a finished job again starts no worker, says it is complete, and changes nothing."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME)
    cli.run("run", job, "--json")
    again = cli.events(cli.run("run", job, "--json"))
    assert [e["type"] for e in again] == ["Started", "Finished"] and again[-1]["already_complete"]
    assert cli.output_bytes(out) == reference[0]
    assert cli.run("verify", out).returncode == 0


def test_ctrl_c_stops_cleanly_and_resumes(big_model, reference, tmp_path):
    """Ctrl-C (SIGINT to the whole process group) exits 130, leaves no child, and a re-run resumes identically."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME)
    # started as a terminal starts a job (its own process group, SIGINT at its default whatever pytest inherited:
    # a suite started with `&` from a script inherits SIGINT ignored), text on stderr as without --json
    with _start_run(job, env=_hold(tmp_path), stderr=subprocess.PIPE, text=True) as proc:  # held at layer 6
        _wait_for_shards(str(out), 3, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "resum" in err.splitlines()[-1] and "Traceback" not in err
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
        assert not cli.group_left(proc)
    second = cli.run("run", job, "--json")
    assert cli.events(second)[0]["resumed"] >= 3
    assert cli.output_bytes(out) == reference[0]


# A shell reports a job killed by SIGTERM as 143 (128 + 15): the supervisor either dies of it (Popen: -15) or,
# should it ever handle it like Ctrl-C, exits 143 itself; the README says 143.
SIGTERM_STATUS = (128 + signal.SIGTERM,)  # supervisor run stops as on Ctrl-C and exits 143


@pytest.mark.parametrize("to", ["pid", "group"])
def test_sigterm_stops_promptly_and_resumes_like_ctrl_c(big_model, reference, tmp_path, to):
    """SIGTERM once the first layer is journaled (a LayerWritten event), to the supervisor alone (`kill PID`: how a
    job started with `&` or nohup, SIGINT ignored, is stopped) or to its whole group (a service manager, `kill --
    -PGID`): it ends within seconds with status 143, nothing of its group is left, and a re-run resumes what was
    journaled and ends byte-identical to an uninterrupted run."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME)
    with faultkit.LiveRun("run", job, "--json", env=_hold(tmp_path)) as live:  # held at layer 6: cannot end first
        first = live.wait_for("LayerWritten", where=lambda e: e["index"] >= 0)  # a worker's layer, journaled
        assert first is not None and live.proc.poll() is None, live.stderr
        group = cli.group_left(live.proc)
        assert len(group) >= 3, group  # the supervisor, its warm parent, its workers
        if to == "pid":
            os.kill(live.pid, signal.SIGTERM)
        else:
            os.killpg(live.pid, signal.SIGTERM)
        live.wait(timeout=30)  # a Ctrl-C-like stop: the held worker's grace at most
        assert live.rc in SIGTERM_STATUS, (live.rc, live.stderr)
        assert "Traceback" not in live.stderr, live.stderr
        assert live.stderr.strip().splitlines() == [
            "error: interrupted; the export is resumable: run the same command again"], live.stderr
        assert live.of("Cancelled"), "the run ends with its Cancelled event, as on Ctrl-C"
        _, alive = psutil.wait_procs(group, timeout=10)  # the warm parent and workers die with it
        assert not alive, f"left running after SIGTERM: {alive}"
        assert not cli.group_left(live.proc)
    written = {e["index"] for e in live.of("LayerWritten")}
    second = cli.run("run", job, "--json")
    started = cli.events(second)[0]
    assert started["type"] == "Started" and started["resumed"] >= len(written), (started, written)
    assert cli.output_bytes(out) == reference[0]
    assert os.listdir(out / ".export" / "tmp") == []


def test_stalled_part_with_live_heartbeats_is_bounded_by_part_timeout(big_model, reference, tmp_path):
    """A main thread stuck while heartbeats go on is killed after part_timeout, retried, and output is identical."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", big_model, out, SCHEME, part_timeout=4)
    proc = cli.run("run", job, "--json", env=_fault(tmp_path, point="quantize", action="stall", index=2))
    retries = [e for e in cli.events(proc) if e["type"] == "Retrying"]
    assert [r["index"] for r in retries] == [2] and "part_timeout" in retries[0]["reason"]
    assert cli.output_bytes(out) == reference[0]
