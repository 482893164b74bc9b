"""Calibrated exports on a group: W = 2 CPU workers (gloo ranks, one thread each) calibrate every layer together.

What is pinned: two runs with the same W write the same bytes; a rank SIGKILLed mid-layer, a rank stuck in a
collective and a SIGKILLed supervisor each end byte-identical to the uninterrupted W = 2 run, with no process left;
the quality against W = 1 (each module's GPTQ loss within 1%, the loaded model's logits on held-out samples no
further from the bf16 model than W = 1's plus 2%; docs/fidelity.md says why the bytes differ from W = 1 and from
llm-compressor's own distributed oneshot); a folder started with W = 2 is not resumed with W = 1.
Kills fire on events (a stage reached on a given rank: child/faults.py points, `worker` = the rank), never after
a sleep, and leave layers after them.
"""
import json
import os
import re
import shutil
import signal
import subprocess

import psutil
import pytest
import torch

from shared import layout
from tests.models import load_tensors
from tests.ref_calib import token_rows, write_jsonl
from tests.scenarios import cli, faultkit

LAYERS, N, SEQ = 4, 20, 40
HELD_OUT = torch.randint(4, 256, (8, 64), generator=torch.Generator().manual_seed(12))


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS, hidden=128, seed=3)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("calib") / "ids.jsonl", token_rows(N, seed=5))


def _job(tmp_path, model, dataset, out, scheme="W4A16", method="gptq", workers=2, name="job.toml", **resources):
    resources.setdefault("torch_threads", 1)
    return cli.write_job(tmp_path / name, model, out, scheme, method=method, workers=workers,
                         calibration={"dataset": dataset, "samples": N, "seq_len": SEQ}, **resources)


def _fault(marker, **spec):
    return {"SUPERVISOR_TEST_FAULT": json.dumps({**spec, "once": str(marker)})}


def _journal(out) -> list[dict]:
    with open(os.path.join(out, layout.STATE_DIR, layout.JOURNAL)) as f:
        return [json.loads(line) for line in f]


def _losses(out) -> dict[str, float]:
    return {k: v for r in _journal(out) if r.get("type") == "Shard" for k, v in r.get("losses", {}).items()}


@pytest.fixture(scope="module")
def w2(model, dataset, tmp_path_factory):
    """An uninterrupted W = 2 GPTQ export: its folder, bytes and events."""
    tmp = tmp_path_factory.mktemp("w2")
    proc = cli.run("run", _job(tmp, model, dataset, tmp / "out"), "--json")
    return tmp / "out", cli.output_bytes(tmp / "out"), cli.events(proc)


@pytest.fixture(scope="module")
def w1(model, dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w1")
    cli.run("run", _job(tmp, model, dataset, tmp / "out", workers=1), "--json")
    return tmp / "out"


def test_two_ranks_calibrate_every_layer_and_a_second_run_writes_the_same_bytes(w2, model, dataset, tmp_path):
    """W = 2: every layer's record names two boundaries (one per rank, hashed), both ranks start, and a second run
    writes byte-identical files."""
    out, ref, events = w2
    started = [e for e in events if e["type"] == "WorkerStarted"]
    assert sorted(e["worker"] for e in started) == [0, 1], started
    assert next(e for e in events if e["type"] == "Started")["world"] == 2
    shards = {r["index"]: r for r in _journal(out) if r.get("type") == "Shard"}
    for i in range(LAYERS - 1):
        bs = shards[i]["boundaries"]
        assert [b["feeds"] for b in bs] == [i + 1, i + 1]
        fence = bs[0]["file"].split(".")[-2]  # the layer's attempt, the same for every rank
        assert [b["file"] for b in bs] == [layout.boundary_name(i + 1, r, fence) for r in (0, 1)]
    assert all(shards[i]["losses"] for i in range(LAYERS))  # every module's GPTQ loss, from the rank that solved it
    again = tmp_path / "again"
    cli.run("run", _job(tmp_path, model, dataset, again), "--json")
    assert cli.output_bytes(again) == ref


def test_quality_matches_one_rank(w2, w1, model):
    """Against the W = 1 export (equal to oneshot): layer 0, whose inputs both compute alike, has every module's GPTQ
    loss within 1%; every layer's total loss is within 1% (later layers' inputs differ: GPTQ's solution cascades from
    one value rounded the other way, docs/fidelity.md); the loaded model's logits on held-out ids are no further
    from the bf16 model's than W = 1's plus 2%."""
    out = w2[0]
    one, two = _losses(w1), _losses(out)
    assert one and sorted(one) == sorted(two)
    for name in (n for n in one if ".layers.0." in n):
        assert abs(two[name] - one[name]) <= 0.01 * abs(one[name]), (name, one[name], two[name])
    for i in range(LAYERS):
        a, b = (sum(v for k, v in d.items() if f".layers.{i}." in k) for d in (one, two))
        assert abs(b - a) <= 0.01 * a, (i, a, b)
    from tests.models import loaded_logits

    bf16 = loaded_logits(model, HELD_OUT).float()
    d1 = (loaded_logits(str(w1), HELD_OUT).float() - bf16).norm()
    d2 = (loaded_logits(str(out), HELD_OUT).float() - bf16).norm()
    assert d2 <= 1.02 * d1, (float(d1), float(d2))
    assert load_tensors(str(out)).keys() == load_tensors(str(w1)).keys()


def test_rank_killed_mid_forward_redoes_the_layer_on_a_fresh_group(w2, model, dataset, tmp_path):
    """SIGKILL rank 1 during layer 1's statistics forward: the layer fails for the group, a fresh group redoes it
    from the journaled boundaries, and the export ends byte-identical to the uninterrupted W = 2 run."""
    out, marker = tmp_path / "out", tmp_path / "fired"
    proc = cli.run("run", _job(tmp_path, model, dataset, out), "--json",
                   env=_fault(marker, point="forward", action="sigkill", index=1, worker=1))
    events = cli.events(proc)
    assert marker.exists()
    retry = [e for e in events if e["type"] == "Retrying"]
    assert len(retry) == 1 and retry[0]["index"] == 1 and "rank 1" in retry[0]["reason"], retry
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [0, 1, 1, 2, 3]  # non-layer: copied
    assert cli.output_bytes(out) == w2[1]


def test_rank_stuck_in_a_collective_times_out_and_the_layer_is_redone(w2, model, dataset, tmp_path):
    """Rank 1 stalls as it starts layer 2's calibration (heartbeats still coming) and rank 0 enters the Hessians'
    reduce only after that: rank 0's collective times out, the retry comes no sooner than collective_timeout after
    the stall began, its reason says a collective timed out and names rank 1 as the one that had not finished, and a
    fresh group redoes the layer to the uninterrupted run's bytes."""
    out, stalled, waited = tmp_path / "out", tmp_path / "stalled", tmp_path / "waited"
    timeout = 8
    faults = [{"point": "calibrate", "action": "stall", "index": 2, "worker": 1, "once": str(stalled)},
              {"point": "reduce", "action": "await", "index": 2, "worker": 0, "path": str(stalled),
               "once": str(waited)}]
    proc = cli.run("run", _job(tmp_path, model, dataset, out, collective_timeout=timeout), "--json",
                   env={faultkit.FAULT_ENV: json.dumps(faults)})
    events = cli.events(proc)
    retry = [e for e in events if e["type"] == "Retrying"]
    assert stalled.exists() and waited.exists() and len(retry) == 1 and retry[0]["index"] == 2, retry
    reason = retry[0]["reason"]
    assert reason.startswith("CollectiveTimeout: rank 0: ") and f"collective_timeout = {timeout} s" in reason, reason
    assert "rank 1 had not finished layer 2: stuck" in reason, reason
    # the run's clock (events' t) in epoch seconds, no later than it was: the journal's header is written (its
    # `created`) before Started is emitted
    started = next(e for e in events if e["type"] == "Started")["t"]
    retried = _journal(out)[0]["created"] + retry[0]["t"] - started
    assert retried - faultkit.read_marker(stalled)["time"] >= timeout, (retried, faultkit.read_marker(stalled))
    assert cli.output_bytes(out) == w2[1]


def test_supervisor_killed_during_propagation_leaves_nothing_and_resumes(w2, model, dataset, tmp_path):
    """SIGKILL the supervisor while rank 0 propagates layer 2 (a stalled fault holds it there): every rank and the
    warm parent's forks exit, the rendezvous port is closed, and the re-run resumes at layer 2, identical."""
    out, marker = tmp_path / "out", tmp_path / "fired"
    fault = _fault(marker, point="propagate", action="stall", index=2, worker=0)
    with faultkit.LiveRun("run", _job(tmp_path, model, dataset, out, keep_warm=0), "--json", env=fault) as live:
        held = live.wait_for("Progress", where=lambda e: e["index"] == 2 and e["stage"] == "propagate")
        assert held is not None and faultkit.wait_marker(marker), live.stderr
        children = psutil.Process(live.pid).children(recursive=True)
        ports = {c.laddr.port for p in children for c in _listening(p)}
        assert ports, "rank 0 hosts the rendezvous: a listening port"
        os.kill(live.pid, signal.SIGKILL)
        live.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, f"orphaned processes still running: {alive}"
        assert not {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN"} & ports
    second = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json"))
    assert second[0]["resumed"] == 3  # layers 0 and 1, and the non-layer part (the supervisor's copy)
    assert cli.output_bytes(out) == w2[1]


def _listening(p: psutil.Process):
    try:
        return [c for c in p.net_connections("tcp") if c.status == "LISTEN"]
    except psutil.NoSuchProcess:
        return []


LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
# the CLI in a network namespace of its own, where only loopback exists (as tests/cluster/rayhost.py does it)
OWN_NETWORK = ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "own-network"]


# where it cannot run here (not root, a tool missing) it is skipped, except under CI, where it must run
_NO_OWN_NETWORK = not os.environ.get("CI") and (os.geteuid() != 0 or not all(
    shutil.which(t) for t in ("unshare", "nsenter", "ip", "ss")))


@pytest.mark.skipif(_NO_OWN_NETWORK, reason="a network namespace of its own needs root, unshare, nsenter, ip and ss")
def test_nothing_listens_beyond_loopback_during_a_group_export(w2, model, dataset, tmp_path):
    """In a network namespace of its own, while rank 1 is held in layer 1's forward, every listening socket there
    (rank 0's store, both ranks' gloo pairs) is on loopback, none on a wildcard address; the run then ends
    byte-identical."""
    out, marker, go = tmp_path / "out", tmp_path / "held", tmp_path / "go"
    fault = _fault(marker, point="forward", action="await", index=1, worker=1, path=str(go))
    with faultkit.LiveRun("run", _job(tmp_path, model, dataset, out), "--json", env=fault, prefix=OWN_NETWORK) as r:
        assert faultkit.wait_marker(marker, 180), r.stderr
        ss = subprocess.run(["nsenter", f"--net=/proc/{r.pid}/ns/net", "--", "ss", "-Hltn"], capture_output=True,
                            text=True, check=True).stdout
        listening = [line.split()[3] for line in ss.splitlines() if line.strip()]
        go.touch()
        r.wait()
    assert len(listening) >= 3 and all(a.startswith(LOOPBACK) for a in listening), listening
    assert r.rc == 0, r.stderr
    assert cli.output_bytes(out) == w2[1]


def test_spawned_ranks_inherit_the_store_socket(w2, model, dataset, tmp_path):
    """A warm parent that cannot fork (test fault "unforkable", as where its imports touched CUDA): the ranks are
    spawned as fresh interpreters, rank 0 inherits the store's bound socket under the same fd number, and the bytes
    are the W = 2 run's."""
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, tmp_path / "out"), "--json",
                                env=faultkit.fault_env({"point": "zygote", "action": "unforkable"})))
    assert [e["forking"] for e in events if e["type"] == "PoolStarted"] == [False]
    assert sorted(e["worker"] for e in events if e["type"] == "WorkerStarted") == [0, 1]
    assert cli.output_bytes(tmp_path / "out") == w2[1]


def test_resume_with_another_group_size_is_refused(model, dataset, tmp_path):
    """A folder a W = 2 export left half done is not resumed with W = 1: exit 2, one line naming the W it was
    started with, nothing written."""
    out = tmp_path / "out"
    first = cli.run("run", _job(tmp_path, model, dataset, out, max_attempts=1), "--json", check=False,
                    env=_fault(tmp_path / "fired", point="calibrate", action="sigkill", index=1, worker=0))
    assert first.returncode == 1, first.stderr
    before = {p: os.stat(p).st_mtime_ns for p in (out / layout.STATE_DIR).rglob("*")}
    refused = cli.run("run", _job(tmp_path, model, dataset, out, workers=1, name="w1.toml"), check=False)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(r"2 ranks", lines[0]) and "workers" in lines[0], lines
    assert {p: os.stat(p).st_mtime_ns for p in (out / layout.STATE_DIR).rglob("*")} == before
    resumed = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json"))
    assert resumed[0]["resumed"] == 2  # layer 0 and the non-layer part (the supervisor's copy)


def test_resume_under_another_thread_count_is_refused_and_the_same_count_resumes(w2, model, dataset, tmp_path):
    """A W = 2 folder started with torch_threads unset (each rank's share of the cores) and left half done: resumed
    with another thread count it is refused (exit 2, one line naming the count it was computed with, nothing
    changed on disk); resumed with that count set explicitly it goes on where it stopped."""
    out = tmp_path / "out"
    derived = max(1, (os.cpu_count() or 1) // 2)
    first = cli.run("run", _job(tmp_path, model, dataset, out, max_attempts=1, torch_threads=0), "--json",
                    check=False, env=_fault(tmp_path / "fired", point="calibrate", action="sigkill", index=2, worker=0))
    assert first.returncode == 1, first.stderr
    recorded = [r for r in _journal(out) if r.get("type") == "Arithmetic"]
    assert [r["threads"] for r in recorded] == [[derived, derived]], recorded
    before = {p: os.stat(p).st_mtime_ns for p in out.rglob("*")}
    refused = cli.run("run", _job(tmp_path, model, dataset, out, torch_threads=derived + 1, name="more.toml"),
                      check=False)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"torch_threads = {derived} as before" in lines[0] \
        and f"{derived + 1} torch threads" in lines[0], lines
    assert {p: os.stat(p).st_mtime_ns for p in out.rglob("*")} == before
    resumed = cli.events(cli.run("run", _job(tmp_path, model, dataset, out, torch_threads=derived, name="same.toml"),
                                 "--json"))
    assert resumed[0]["resumed"] >= 2, resumed[0]
    if derived == 1:  # w2's own arithmetic (one thread per rank)
        assert cli.output_bytes(out) == w2[1]


@pytest.fixture(scope="module")
def w3(model, dataset, tmp_path_factory):
    """An uninterrupted W = 3 GPTQ export (three gloo ranks on this host's cores, one thread each): its bytes."""
    tmp = tmp_path_factory.mktemp("w3")
    cli.run("run", _job(tmp, model, dataset, tmp / "out", workers=3), "--json")
    return cli.output_bytes(tmp / "out")


def test_three_ranks_write_the_same_bytes_twice(w3, model, dataset, tmp_path):
    """W = 3 (each Hessian a sum of three ranks' parts, so the reduction's order could show): a second run writes
    byte-identical files, each layer's record naming three boundaries."""
    out = tmp_path / "out"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out, workers=3), "--json"))
    assert events[0]["world"] == 3
    assert all(len(r["boundaries"]) == 3 for r in _journal(out) if r.get("type") == "Shard" and 0 <= r["index"] < 3)
    assert cli.output_bytes(out) == w3


def test_three_ranks_with_one_killed_mid_layer_end_byte_identical(w3, model, dataset, tmp_path):
    """W = 3, rank 2 SIGKILLed while calibrating layer 1: a fresh group of three redoes the layer from the journaled
    boundaries and the export is byte-identical to the uninterrupted W = 3 run."""
    out, marker = tmp_path / "out", tmp_path / "fired"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out, workers=3), "--json",
                                env=_fault(marker, point="calibrate", action="sigkill", index=1, worker=2)))
    retry = [e for e in events if e["type"] == "Retrying"]
    assert marker.exists() and len(retry) == 1 and retry[0]["index"] == 1 and "rank 2" in retry[0]["reason"], retry
    assert cli.output_bytes(out) == w3


def test_static_nvfp4_on_two_ranks_is_deterministic_and_as_good_as_one(model, dataset, tmp_path):
    """NVFP4 (static activation scales: observers' statistics all-reduced across ranks): two W = 2 runs write the
    same bytes, and the loaded model is as close to bf16 as the W = 1 export (plus 2%)."""
    a, b, one = tmp_path / "a", tmp_path / "b", tmp_path / "one"
    for out, workers in ((a, 2), (b, 2), (one, 1)):
        cli.run("run", _job(tmp_path, model, dataset, out, scheme="NVFP4", method="rtn", workers=workers,
                            name=f"{out.name}.toml"), "--json")
    assert cli.output_bytes(a) == cli.output_bytes(b)
    from tests.models import loaded_logits

    bf16 = loaded_logits(model, HELD_OUT).float()
    d1 = (loaded_logits(str(one), HELD_OUT).float() - bf16).norm()
    d2 = (loaded_logits(str(a), HELD_OUT).float() - bf16).norm()
    assert d2 <= 1.02 * d1, (float(d1), float(d2))


def test_moe_experts_spread_over_both_ranks(tiny_models, dataset, tmp_path):
    """Qwen3-MoE (4 experts a layer), GPTQ on W = 2: the library's bin packing gives each rank experts to solve
    (each rank's log names expert modules it quantized), and two runs write the same bytes."""
    moe = tiny_models("qwen3moe", layers=2, hidden=128)
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        cli.run("run", _job(tmp_path, moe, dataset, out, name=f"{out.name}.toml"), "--json")
    assert cli.output_bytes(a) == cli.output_bytes(b)
    for rank in (0, 1):
        log = (a / layout.STATE_DIR / layout.LOGS / f"rank-{rank}.log").read_text()
        solved = re.findall(r"Quantizing \d+ module\(s\): \[(.*)\]", log)
        assert any("experts" in line for line in solved), (rank, solved[:4])


def test_awq_on_the_cpu_calibrates_on_one_rank_and_says_so(model, dataset, tmp_path):
    """AWQ has no CPU path for its distributed reductions (llm-compressor 0.14.0.1 all-reduces through an
    accelerator): with two workers asked, `supervisor plan` and the run's Started event say it calibrates on one
    rank, and why; the run starts one worker."""
    job = _job(tmp_path, model, dataset, tmp_path / "out", scheme="W4A16", method="awq")
    plan = cli.run("plan", job).stdout
    line = next(x for x in plan.splitlines() if x.startswith("group"))
    assert "1 rank calibrate" in line and "AWQ" in line and "accelerator" in line, line
    events = cli.events(cli.run("run", job, "--json"))
    started = events[0]
    assert started["world"] == 1 and "AWQ" in started["world_note"], started
    assert [e["worker"] for e in events if e["type"] == "WorkerStarted"] == [0]
