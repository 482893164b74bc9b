"""Several workers on one queue of parts, the warm parent they are forked from, and what a re-run trusts.

Every export here runs the real CLI on a tiny Llama with enough parts that two workers interleave; the bytes are
compared with a one-worker export's.
"""
from __future__ import annotations

import fcntl
import json
import os

import pytest

from shared import layout
from supervisor import Supervisor, events as ev
from supervisor.workers import devices
from tests.scenarios import cli, faultkit

SCHEME = "W4A16"
LAYERS = 6


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def one_worker(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-worker")
    job = cli.write_job(tmp / "job.toml", model, tmp / "out", SCHEME, workers=1)
    return {"events": cli.events(cli.run("run", job, "--json")), "bytes": cli.output_bytes(tmp / "out"),
            "out": tmp / "out", "job": job}


@pytest.fixture(scope="module")
def two_workers_one_killed(model, tmp_path_factory):
    """Two workers; the one that takes layer 3 is SIGKILLed while quantizing it (once)."""
    tmp = tmp_path_factory.mktemp("two-workers")
    marker = tmp / "killed.json"
    job = cli.write_job(tmp / "job.toml", model, tmp / "out", SCHEME, workers=2)
    env = faultkit.fault_env({"point": "quantize", "action": "sigkill", "index": 3, "once": str(marker)})
    proc = cli.run("run", job, "--json", env=env)
    return {"events": cli.events(proc), "bytes": cli.output_bytes(tmp / "out"), "marker": marker,
            "out": tmp / "out"}


def _of(events, kind):
    return [e for e in events if e["type"] == kind]


def test_two_workers_share_the_parts_and_write_one_workers_bytes(one_worker, two_workers_one_killed):
    """Two workers both export parts, each part once, and the folder is byte-identical to one worker's."""
    ev = two_workers_one_killed["events"]
    workers = {e["worker"] for e in _of(ev, "WorkerStarted")}
    assert workers == {0, 1}
    by_worker = {w: [e["index"] for e in _of(ev, "LayerStarted") if e["worker"] == w] for w in workers}
    assert all(by_worker.values()), by_worker  # both did work
    written = sorted(e["index"] for e in _of(ev, "LayerWritten"))
    assert written == sorted(list(range(LAYERS)) + [-1])  # every part exactly once
    assert two_workers_one_killed["bytes"] == one_worker["bytes"]
    assert {e["worker"] for e in _of(one_worker["events"], "LayerStarted")} == {0}


def test_killing_one_of_two_workers_costs_only_its_layer(two_workers_one_killed):
    """The SIGKILL costs one retry of layer 3 and one fresh worker; no other part is redone."""
    ev = two_workers_one_killed["events"]
    fired = faultkit.read_marker(str(two_workers_one_killed["marker"]))
    assert fired is not None and fired["index"] == 3
    retries = _of(ev, "Retrying")
    assert [(r["index"], r["attempt"]) for r in retries] == [(3, 2)], retries
    assert "SIGKILL" in retries[0]["reason"]
    assert [e["index"] for e in _of(ev, "LayerStarted") if e["attempt"] > 1] == [3]
    assert len(_of(ev, "WorkerStarted")) == 3  # two, plus one replacement


def test_replacement_worker_reports_its_restart_latency(two_workers_one_killed):
    """The replacement's WorkerStarted says how long after the loss it was ready (a fork, not a re-import)."""
    ev = two_workers_one_killed["events"]
    pool = _of(ev, "PoolStarted")
    assert len(pool) == 1 and pool[0]["imports"] > 0
    again = [e for e in _of(ev, "WorkerStarted") if e["since_death"] is not None]
    assert len(again) == 1
    # backoff (0.5 s) plus a fork: well under a re-import, which this same run measured in PoolStarted
    assert again[0]["since_death"] < pool[0]["imports"], (again[0], pool[0])
    assert again[0]["seconds"] < pool[0]["seconds"]


def test_rerun_trusts_unchanged_shards_and_verify_rehashes_them(model, one_worker, tmp_path):
    """A re-run trusts a journaled shard whose inode, mtime and size are unchanged (it does not read it: a
    same-size edit that keeps the mtime goes unnoticed there), while `verify` re-hashes every byte."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(one_worker["out"], out)  # new inodes: the first run must re-hash, then journal them anew
    job = cli.write_job(tmp_path / "job.toml", model, out, SCHEME)
    first = cli.events(cli.run("run", job, "--json"))
    assert first[-1]["type"] == "Finished" and first[-1]["already_complete"]
    assert first[0]["resumed"] == LAYERS + 1 and not first[0]["redo"]
    shard = out / "model-layer-00002.safetensors"
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = cli.events(cli.run("run", job, "--json"))
    assert second[-1]["already_complete"] and not second[0]["redo"]  # trusted by its stat
    verify = cli.run("verify", out, "--json", check=False)
    assert verify.returncode == 1
    assert list(json.loads(verify.stdout)["problems"]) == ["model-layer-00002.safetensors"]
    os.utime(shard)  # a changed mtime: the next run re-hashes it, finds the damage and redoes that shard
    third = cli.events(cli.run("run", job, "--json"))
    assert third[0]["redo"] == [2]
    assert cli.output_bytes(out) == one_worker["bytes"]


def test_shard_digest_is_the_files_xxh3(one_worker):
    """Each journaled digest (computed from memory while writing) equals xxh3-128 of the file's bytes."""
    import xxhash

    with open(os.path.join(one_worker["out"], ".export", "journal.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    shards = [r for r in recs if r.get("type") == "Shard"]
    assert len(shards) == LAYERS + 1
    for r in shards:
        with open(os.path.join(one_worker["out"], r["file"]), "rb") as f:
            assert r["digest"] == "xxh3-128:" + xxhash.xxh3_128(f.read()).hexdigest(), r["file"]


def test_workers_are_spawned_when_the_warm_parent_cannot_fork_them(model, one_worker, tmp_path):
    """A warm parent whose imports touched CUDA (test fault "unforkable") says so; the workers are then spawned
    as fresh interpreters, a SIGKILLed one is replaced the same way, and the bytes are one worker's."""
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=1)
    env = faultkit.fault_env([{"point": "zygote", "action": "unforkable"},
                              {"point": "quantize", "action": "sigkill", "index": 2, "once": str(tmp_path / "k")}])
    ev = cli.events(cli.run("run", job, "--json", env=env))
    assert [e["forking"] for e in _of(ev, "PoolStarted")] == [False]
    assert len(_of(ev, "WorkerStarted")) == 2 and [r["index"] for r in _of(ev, "Retrying")] == [2]
    assert cli.output_bytes(tmp_path / "out") == one_worker["bytes"]


def test_outputs_through_the_workers_reused_buffer_write_one_workers_bytes(model, one_worker, tmp_path):
    """Every output copied through the worker's one reused host buffer (as on a GPU; forced on CPU here), by two
    workers, one SIGKILLed mid-layer: the bytes are an unbuffered worker's, so no shard is written from views a
    later part overwrote, and the non-layer part (bigger than a layer here) grows the buffer and gives it back."""
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=2)
    env = faultkit.fault_env({"point": "quantize", "action": "sigkill", "index": 2, "once": str(tmp_path / "k")})
    env["SUPERVISOR_TEST_STAGE_HOST"] = "1"
    ev = cli.events(cli.run("run", job, "--json", env=env))
    assert [r["index"] for r in _of(ev, "Retrying")] == [2]
    assert cli.output_bytes(tmp_path / "out") == one_worker["bytes"]


def test_workers_sharing_a_device_take_turns_on_it(model, one_worker, tmp_path, monkeypatch):
    """Layers too big for two workers on one GPU at once (forced here on CPU): each worker holds the device lock
    for its device stage. While this test holds it, both workers wait (their heartbeats say "wait-device") and no
    part is written; once it lets go they finish, the bytes are one worker's, and the waits are reported."""
    lock = tmp_path / "device.lock"
    monkeypatch.setattr(devices, "device_stage_shared", lambda device, sharing, layer_bytes: sharing > 1)
    monkeypatch.setattr(layout, "device_lock", lambda output, device: str(lock))
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=2)
    sup = Supervisor(job)
    sup.start()
    waiting, written, copied = set(), [], []
    try:
        for e in sup.events():
            if isinstance(e, ev.LayerWritten) and "copy" in e.stages:
                copied.append(e.index)  # the non-layer part the supervisor copied itself: no device stage
            elif isinstance(e, ev.LayerWritten):
                assert fd < 0, "a part was written while the device lock was held elsewhere"
                written.append(e)
            if isinstance(e, ev.Progress) and e.stage == "wait-device" and fd >= 0:
                waiting.add(e.index)
                if len(waiting) == 2:  # both workers are blocked on the lock: let them go
                    os.close(fd)
                    fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
    assert sup.wait().parts == LAYERS + 1
    assert cli.output_bytes(tmp_path / "out") == one_worker["bytes"]
    assert sorted(e.index for e in written) == list(range(LAYERS)) and copied == [-1]
    assert all("wait" in e.stages for e in written) and all(e.stages["wait"] > 0 for e in written if e.index in waiting)


def test_a_worker_killed_in_its_turn_on_the_device_does_not_stall_the_other(model, one_worker, tmp_path, monkeypatch):
    """Two workers taking turns on the device (forced on CPU): the one in its turn on layer 2 is SIGKILLed while it
    holds the lock. The lock goes with its process, the other worker carries on, layer 2 is retried, and the bytes
    are one worker's (a lock left held would stall the run until the test's timeout)."""
    monkeypatch.setattr(devices, "device_stage_shared", lambda device, sharing, layer_bytes: sharing > 1)
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", SCHEME, workers=2)
    marker = tmp_path / "killed.json"
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps({"point": "device", "action": "sigkill", "index": 2,
                                                            "once": str(marker)}))
    sup = Supervisor(job)
    sup.start()
    events = list(sup.events())
    assert isinstance(events[-1], ev.Finished), events[-1]
    assert marker.exists() and [e.index for e in events if isinstance(e, ev.Retrying)] == [2]
    assert cli.output_bytes(tmp_path / "out") == one_worker["bytes"]


@pytest.mark.parametrize("workers, point", [(1, "plan"), (2, "plan"), (1, "start"), (2, "start")])
def test_the_export_plan_is_judged_while_the_first_parts_run(one_worker, model, tmp_path, workers, point):
    """The plan's worker waits, inside Describe ("plan") or before it is even ready ("start": its slot is the one after
    the parts'), until layer 1's shard is in the output folder: the run finishes without a retry only because parts
    are exported while the plan is judged, their workers started while the plan's finishes starting (otherwise the
    wait runs out and the plan is retried). The parts written before the verdict are journaled after it: every part
    once, the bytes one worker's, verify passes. (That none is journaled before it: test_moe_cli's refusal with the
    plan beside the parts.)"""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", model, out, SCHEME, workers=workers)
    fault = {"point": point, "action": "await", "path": str(out / layout.shard_name(1)), "timeout": 120,
             "once": str(tmp_path / "plan.json")}
    env = faultkit.fault_env({**fault, "worker": workers} if point == "start" else fault)
    env["SUPERVISOR_TEST_PLAN_BESIDE"] = "1"  # whatever the host's free memory (devices.room_for_planner)
    events = cli.events(cli.run("run", job, "--json", env=env))
    assert (tmp_path / "plan.json").exists()  # the plan did wait
    assert not _of(events, "Retrying"), _of(events, "Retrying")
    written = sorted(e["index"] for e in _of(events, "LayerWritten"))
    assert written == sorted(list(range(LAYERS)) + [-1])
    assert cli.output_bytes(out) == one_worker["bytes"]
    assert cli.run("verify", out).returncode == 0


@pytest.mark.parametrize("room, first", [(False, True), (True, False)])
def test_a_cpu_host_without_memory_for_one_more_worker_judges_the_plan_first(one_worker, model, tmp_path, monkeypatch,
                                                                              room, first):
    """Without the free memory for the planner beside two CPU workers (devices.room_for_planner), the export plan is
    judged before any part: its one failed attempt is retried before the first LayerStarted. With the room, it is
    judged beside the parts: held until layer 1's shard is on disk, it is retried only if no part ran meanwhile."""
    monkeypatch.delenv("SUPERVISOR_TEST_PLAN_BESIDE", raising=False)
    monkeypatch.setattr(devices, "room_for_planner", lambda slots, layer_bytes: room)
    out = tmp_path / "out"
    fault = {"point": "plan", "action": "raise", "once": str(tmp_path / "fired.json")}
    if not first:  # the plan waits for a part; judged first it would wait out the timeout and be retried
        fault = {"point": "plan", "action": "await", "path": str(out / layout.shard_name(1)), "timeout": 60,
                 "once": str(tmp_path / "fired.json")}
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps(fault))
    sup = Supervisor(cli.write_job(tmp_path / "job.toml", model, out, SCHEME, workers=2))
    sup.start()
    events = list(sup.events())
    assert isinstance(events[-1], ev.Finished), events[-1]
    retried = [i for i, e in enumerate(events) if isinstance(e, ev.Retrying)]
    started = [i for i, e in enumerate(events) if isinstance(e, ev.LayerStarted)]
    if first:
        assert len(retried) == 1 and events[retried[0]].index is None and retried[0] < started[0]
    else:
        assert not retried
    assert cli.output_bytes(out) == one_worker["bytes"]
