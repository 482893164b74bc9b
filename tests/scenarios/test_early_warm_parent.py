"""The warm parent launched as the job is read (`Supervisor(job, warm_now=True)`, what `supervisor run` does), so
its imports overlap the supervisor's own checks (supervisor.workers.zygote.EarlyStart).

In-process runs on a tiny Llama: `prepare` is wrapped to wait until the warm parent's process exists before it
checks anything, which only an early start lets through; a refusal then must leave no process and no file of it.
The bytes are compared with a run whose warm parent started after the checks (warm_now off), the way every run
worked before.
"""
from __future__ import annotations

import os
import time

import psutil
import pytest

from supervisor import api
from supervisor import events as ev
from supervisor.errors import SourceError
from supervisor.workers import zygote
from tests.scenarios import cli

SCHEME = "W4A16"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=3)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("early-ref")
    job = cli.write_job(tmp / "job.toml", model, tmp / "out", SCHEME, workers=1)
    cli.run("run", job, "--json", env={"SUPERVISOR_KEEP_WARM": "0"})
    return cli.output_bytes(tmp / "out")


def _zygotes() -> list[psutil.Process]:
    """This process's warm parents (its children running child.zygote; a kept one is in a session of its own but
    still our child)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "child.zygote" in p.cmdline():
                found.append(p)
        except psutil.Error:
            pass
    return found


def _prepare_after_the_warm_parent(monkeypatch, seen: list, then=None):
    """api.prepare waits (up to 120 s) until a warm parent process of ours exists, records it, then checks the job
    (or runs `then`, which may refuse it)."""
    real = api.prepare

    def prepare(job, model=None, **kwargs):
        deadline = time.monotonic() + 120
        while not _zygotes():
            assert time.monotonic() < deadline, "no warm parent was started before the job was checked"
            time.sleep(0.01)
        seen.extend(p.pid for p in _zygotes())
        return then() if then is not None else real(job, model, **kwargs)

    monkeypatch.setattr(api, "prepare", prepare)


def _run(sup: api.Supervisor) -> list[ev.Event]:
    events = []
    with sup:
        events.extend(sup.events())
    sup.wait()
    return events


def test_the_warm_parent_imports_while_the_job_is_checked(model, reference, tmp_path, monkeypatch):
    """Its own warm parent (keep_warm = 0) exists before prepare checks anything; the run forks its worker from
    that one, its log file holds what it printed before the run named the file (the lines also came as LogLine
    events), and the bytes equal a run started the usual way."""
    monkeypatch.setenv("SUPERVISOR_KEEP_WARM", "0")
    seen = []
    _prepare_after_the_warm_parent(monkeypatch, seen)
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=1)
    events = _run(api.Supervisor(str(job), warm_now=True))
    assert isinstance(events[-1], ev.Finished), events[-1]
    pool = [e for e in events if isinstance(e, ev.PoolStarted)]
    assert len(pool) == 1 and pool[0].pid == seen[0] and not pool[0].reused
    assert cli.output_bytes(tmp_path / "out") == reference
    with open(tmp_path / "out" / ".export" / "logs" / "zygote.log") as f:
        logged = [ln.rstrip("\r") for ln in f.read().split("\n") if ln.strip()]
    handed = [e.text for e in events if isinstance(e, ev.LogLine) and e.pid == seen[0]]
    assert logged and logged == handed[: len(logged)], (logged[:3], handed[:3])
    assert not _zygotes()  # ended with its run


@pytest.mark.parametrize("keep_warm", [0, 60])
def test_a_job_refused_after_the_early_start_leaves_nothing_of_it(model, tmp_path, monkeypatch, keep_warm):
    """The warm parent was launched (seen running), then the job is refused: Supervisor raises the refusal, the
    warm parent is gone (a kept one too: the run that started it never used it), and neither the output nor the
    kept parents' folder holds anything of it."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("SUPERVISOR_KEEP_WARM", str(keep_warm))
    seen = []

    def refuse():
        raise SourceError("refused for the test")

    _prepare_after_the_warm_parent(monkeypatch, seen, then=refuse)
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=1)
    with pytest.raises(SourceError, match="refused for the test"):
        api.Supervisor(str(job), warm_now=True)
    assert seen
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in seen)
    assert not (tmp_path / "out").exists()
    assert zygote.kept_parents() == []
    left = [n for n in os.listdir(runtime / f"supervisor-{os.getuid()}")] if keep_warm else []
    assert all(n.endswith(".lock") for n in left), left  # the lock file alone (an flock on it, released)


def test_a_warm_parent_the_plan_does_not_want_is_discarded(model, reference, tmp_path, monkeypatch):
    """The plan asks for another environment than the job's first reading gave (here one variable more): the early
    warm parent ends unused, the run starts the one it needs, and the bytes are the usual run's."""
    monkeypatch.setenv("SUPERVISOR_KEEP_WARM", "0")
    seen = []
    _prepare_after_the_warm_parent(monkeypatch, seen)
    from supervisor.run import launch

    real_env = launch.run_env
    monkeypatch.setattr(launch, "run_env", lambda devices: {**real_env(devices), "SUPERVISOR_TEST_OTHER": "1"})
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=1)
    events = _run(api.Supervisor(str(job), warm_now=True))
    assert isinstance(events[-1], ev.Finished), events[-1]
    pool = [e for e in events if isinstance(e, ev.PoolStarted)]
    assert len(pool) == 1 and pool[0].pid not in seen
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in seen)
    assert cli.output_bytes(tmp_path / "out") == reference
