"""The warm parent kept between runs (resources.keep_warm): a re-run forks its workers instead of importing again.

Every run here is the real CLI on a tiny Llama, in a runtime folder of the test's own (XDG_RUNTIME_DIR), so no
kept parent crosses tests; each test stops what it kept. The reference bytes come from a run whose warm parent
ended with it (keep_warm = 0), the way every run worked before the knob existed.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import psutil
import pytest

from supervisor.workers import zygote
from tests.scenarios import cli, faultkit

SCHEME = "W4A16"
LAYERS = 4


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keep-warm-ref")
    job = cli.write_job(tmp / "job.toml", model, tmp / "out", SCHEME, workers=1, keep_warm=0)
    ev = faultkit.run("run", job, "--json", env={"XDG_RUNTIME_DIR": str(tmp)})
    assert ev.rc == 0, ev.stderr
    pool = ev.of("PoolStarted")[0]
    assert (pool["reused"], pool["kept"]) == (False, 0)
    assert not _alive(pool["pid"])  # ended with its run
    return cli.output_bytes(tmp / "out")


@pytest.fixture
def runtime(monkeypatch):
    """A runtime folder of this test's own (short: a Unix socket's path has at most 108 bytes); every warm parent
    kept in it is killed afterwards."""
    rt = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", rt)
    yield {"XDG_RUNTIME_DIR": rt}
    for p in zygote.kept_parents():
        try:
            os.kill(p["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(rt, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Running code: a zombie (exited, not yet reaped) does not count."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _job(tmp_path, model, name: str, **resources) -> str:
    return cli.write_job(tmp_path / f"{name}.toml", model, tmp_path / name, SCHEME, workers=1, **resources)


def test_the_next_run_forks_from_the_kept_parent_and_writes_the_same_bytes(model, reference, runtime, tmp_path):
    first = faultkit.run("run", _job(tmp_path, model, "a", keep_warm=120), "--json", env=runtime)
    assert first.rc == 0, first.stderr
    pool_a = first.of("PoolStarted")[0]
    assert (pool_a["reused"], pool_a["kept"]) == (False, 120)
    assert _alive(pool_a["pid"])  # outlives the run that started it

    second = faultkit.run("run", _job(tmp_path, model, "b", keep_warm=120), "--json", env=runtime)
    assert second.rc == 0, second.stderr
    pool_b = second.of("PoolStarted")[0]
    assert pool_b["reused"] is True and pool_b["pid"] == pool_a["pid"]
    assert pool_b["seconds"] < pool_a["seconds"]  # a connection, not the imports
    worker = second.of("WorkerStarted")[0]["pid"]
    assert not _alive(worker)  # the run's workers end with it; the parent stays
    assert cli.output_bytes(tmp_path / "a") == reference
    assert cli.output_bytes(tmp_path / "b") == reference

    listed = cli.run("warm", "--json", env=runtime)
    assert '"pid": %d' % pool_a["pid"] in listed.stdout
    stopped = cli.run("warm", "--stop", env=runtime)
    assert f"stopped warm parent pid {pool_a['pid']}" in stopped.stdout
    assert _gone_within(pool_a["pid"], 30)
    assert not [n for n in os.listdir(os.path.join(runtime["XDG_RUNTIME_DIR"], f"supervisor-{os.getuid()}"))
                if n.endswith((".sock", ".json"))]


def test_a_killed_supervisor_takes_its_worker_along_and_the_rerun_resumes_warm(model, reference, runtime, tmp_path):
    """SIGKILL the supervisor while its worker is inside layer 2: the kept parent kills that worker (none outlives
    its run), stays warm, and serves the re-run, which resumes and ends byte-identical to the reference."""
    job = _job(tmp_path, model, "k", keep_warm=120)
    hang = faultkit.fault_env({"point": "quantize", "action": "hang", "index": 2})
    live = faultkit.LiveRun("run", job, "--json", env={**runtime, **hang})
    try:
        live_started = None
        deadline = time.monotonic() + 300
        while live_started is None:
            live.wait_for("LayerStarted")
            live_started = next((e for e in live.of("LayerStarted") if e["index"] == 2), None)
            assert live.proc.poll() is None, live.stderr
            assert time.monotonic() < deadline, "layer 2 never started"
            time.sleep(0.05)
        pool = live.of("PoolStarted")[0]
        worker = live.of("WorkerStarted")[-1]["pid"]

        # meanwhile another run gets a warm parent of its own: the kept one is busy
        other = faultkit.run("run", _job(tmp_path, model, "o", keep_warm=120), "--json", env=runtime)
        assert other.rc == 0, other.stderr
        pool_o = other.of("PoolStarted")[0]
        assert pool_o["reused"] is False and pool_o["pid"] != pool["pid"] and pool_o["kept"] == 0
        assert cli.output_bytes(tmp_path / "o") == reference
        # `warm --stop` leaves a parent that a run is using alone, and says so
        busy = cli.run("warm", "--stop", env=runtime).stdout
        assert f"warm parent pid {pool['pid']}" in busy and "in use by a run: not stopped" in busy
        assert _alive(pool["pid"]) and _alive(worker)
    finally:
        live.proc.send_signal(signal.SIGKILL)
        live.wait()
    assert _gone_within(worker, 30)
    assert _alive(pool["pid"])

    again = faultkit.run("run", job, "--json", env=runtime)
    assert again.rc == 0, again.stderr
    pool_again = again.of("PoolStarted")[0]
    assert pool_again["reused"] is True and pool_again["pid"] == pool["pid"]
    started = again.of("Started")[0]
    assert started["resumed"] >= 1  # layers 0 and 1 were journaled before the kill
    assert cli.output_bytes(tmp_path / "k") == reference


def test_a_kept_parent_killed_mid_run_is_replaced_and_the_run_finishes(model, reference, runtime, tmp_path):
    """SIGKILL the kept warm parent while its worker is inside layer 1: the worker dies with it (parent-death
    signal), the run starts a new kept parent, retries layer 1 from it and ends byte-identical."""
    marker = tmp_path / "hung.json"
    hang = faultkit.fault_env({"point": "quantize", "action": "hang", "index": 1, "once": str(marker)})
    live = faultkit.LiveRun("run", _job(tmp_path, model, "z", keep_warm=120), "--json", env={**runtime, **hang})
    try:
        deadline = time.monotonic() + 300
        while faultkit.read_marker(str(marker)) is None:  # the worker is now hanging inside layer 1
            assert live.proc.poll() is None, live.stderr
            assert time.monotonic() < deadline, "layer 1 never hung"
            time.sleep(0.05)
        first = live.of("PoolStarted")[0]
        os.kill(first["pid"], signal.SIGKILL)
        live.wait(300)
    finally:
        if live.proc.poll() is None:
            live.proc.kill()
            live.wait()
    assert live.rc == 0, live.stderr
    pools = live.of("PoolStarted")
    assert len(pools) == 2 and pools[1]["pid"] != first["pid"] and pools[1]["kept"] == 120
    assert any(r["index"] == 1 for r in live.of("Retrying"))
    assert _alive(pools[1]["pid"])  # the replacement is kept for the next run
    assert cli.output_bytes(tmp_path / "z") == reference


def test_a_kept_parent_ends_after_its_idle_time(model, runtime, tmp_path):
    run = faultkit.run("run", _job(tmp_path, model, "i", keep_warm=1), "--json", env=runtime)
    assert run.rc == 0, run.stderr
    pid = run.of("PoolStarted")[0]["pid"]
    assert _gone_within(pid, 60)
    assert "no warm parent is kept" in cli.run("warm", env=runtime).stdout


def test_another_environment_gets_another_parent(model, runtime, tmp_path):
    """A run whose environment differs (here one variable a library could read at import) never reuses a parent
    imported under the other."""
    first = faultkit.run("run", _job(tmp_path, model, "e1", keep_warm=120), "--json", env=runtime)
    second = faultkit.run("run", _job(tmp_path, model, "e2", keep_warm=120), "--json",
                          env={**runtime, "TRANSFORMERS_VERBOSITY": "error"})
    assert first.rc == 0 and second.rc == 0, first.stderr + second.stderr
    a, b = first.of("PoolStarted")[0], second.of("PoolStarted")[0]
    assert b["reused"] is False and b["pid"] != a["pid"]
    assert {p["pid"] for p in zygote.kept_parents()} == {a["pid"], b["pid"]}


def test_a_calibrated_run_forks_from_a_data_free_runs_kept_parent(model, runtime, tmp_path):
    """Data-free and calibrated exports import the same libraries (neither loads `datasets`: child/imports.py), so a
    calibrated export forks its worker from the parent a data-free run kept, and its output equals the same
    calibrated export run from a parent of its own (keep_warm = 0)."""
    from tests.ref_calib import token_rows, write_jsonl

    free = faultkit.run("run", _job(tmp_path, model, "f", keep_warm=120), "--json", env=runtime)
    assert free.rc == 0, free.stderr
    calib = dict(dataset=write_jsonl(tmp_path / "calib.jsonl", token_rows(8)), samples=8, seq_len=16)
    outputs = {}
    for name, keep in (("c", 120), ("alone", 0)):
        job = cli.write_job(tmp_path / f"{name}.toml", model, tmp_path / name, SCHEME, method="gptq", workers=1,
                            keep_warm=keep, calibration=calib)
        run = faultkit.run("run", job, "--json", env=runtime)
        assert run.rc == 0, run.stderr
        outputs[name] = (run.of("PoolStarted")[0], cli.output_bytes(tmp_path / name))
    a, c = free.of("PoolStarted")[0], outputs["c"][0]
    assert c["reused"] is True and c["pid"] == a["pid"], (a, c)
    assert outputs["alone"][0]["reused"] is False and outputs["alone"][0]["pid"] != a["pid"]
    assert outputs["c"][1] == outputs["alone"][1]
    assert {(p["pid"], p["format"]) for p in zygote.kept_parents()} == {(a["pid"], "compressed-tensors")}


def test_keep_warm_must_not_be_negative(model, tmp_path):
    job = _job(tmp_path, model, "neg", keep_warm=-1)
    cli.assert_refused(job, "keep_warm", tmp_path)
