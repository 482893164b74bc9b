"""Exports on a Ray cluster (`[resources] cluster = "ray"`): a local cluster of a head and two worker nodes
(ray.cluster_utils, one for the whole module) in a network namespace of its own, where only 127.0.0.1 exists.

What is pinned: a data-free and a calibrated W = 2 export on the cluster are byte-identical to this host's export
of the same job; a worker SIGKILLed mid-layer, a node removed mid-export (or inside a calibrated group's layer)
and a SIGKILLed supervisor each end byte-identical, with no worker or agent left; connections to the run's port
that do not prove the secret are refused, logged, and the run goes on; a flood of idle connections beyond the
supervisor's file limit holds about a hundred of its files and a replacement worker still connects; a node host's
control calls never wait behind its waits, and stopping a worker its host cannot reach returns within its
deadline; a node that cannot see the output folder is refused (exit 2) before anything is written. Kills fire on
events (a fault's marker: the worker reached layer i), never after a sleep.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from shared import layout
from supervisor.cluster.node_agent import BLIND_ENV, DEAF_ENV
from tests.ref_calib import token_rows, write_jsonl
from tests.scenarios import cli, faultkit

LAYERS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLY = "RAYHOST "

try:
    import ray  # noqa: F401
except ImportError:  # CI installs it (.ci/setup.sh); elsewhere: say how
    if os.environ.get("CI"):
        raise
    pytest.skip("Ray is not installed: bash .ci/setup.sh (or pip install '.[ray]')", allow_module_level=True)
if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
    _WHY = "the cluster tests need root, unshare and nsenter (a network namespace of their own)"
    if os.environ.get("CI"):  # CI has them (.ci/setup.sh): a runner without them must say so, not pass green
        raise RuntimeError(f"{_WHY}; this CI runner has root={os.geteuid() == 0}, "
                           f"unshare={bool(shutil.which('unshare'))}, nsenter={bool(shutil.which('nsenter'))}")
    pytest.skip(_WHY, allow_module_level=True)


class RayHost:
    """tests/cluster/rayhost.py in `unshare -n`: the cluster, and commands to add and remove its nodes."""

    def __init__(self):
        self.proc = subprocess.Popen(["unshare", "-n", "--", sys.executable, "-m", "tests.cluster.rayhost"],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        first = self._read()
        self.address, self.pid = first["address"], first["pid"]
        self.prefix = ["nsenter", f"--net=/proc/{self.pid}/ns/net", "--"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the Ray cluster host exited ({self.proc.wait()})")

    def ask(self, cmd: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture(scope="module")
def host():
    h = RayHost()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def no_actor_left(host):
    """After every test: no seat or node host of any run is left (a run's end, or its supervisor's death, ends
    them with their workers)."""
    yield
    assert _gone(_agents(), 60) == [], "seats or node hosts outlived their run"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS, hidden=128, seed=4)


def _job(folder, model, out, cluster=True, **resources):
    resources.setdefault("workers", 2)
    resources.setdefault("torch_threads", 1)
    resources.setdefault("heartbeat_timeout", 20)
    resources.setdefault("startup_timeout", 120)
    if cluster:
        resources["cluster"] = "ray"
    return cli.write_job(os.path.join(folder, "cluster.toml" if cluster else "local.toml"), model, out,
                         faultkit.SCHEME, **resources)


def _run(host, job, env=None) -> faultkit.LiveRun:
    return faultkit.LiveRun("run", job, "--json", env={"RAY_ADDRESS": host.address, **(env or {})},
                            prefix=host.prefix)


@pytest.fixture(scope="module")
def local_ref(model, tmp_path_factory):
    """This host's export of the job (two workers, one thread each): the bytes every cluster run must write."""
    tmp = tmp_path_factory.mktemp("local")
    r = faultkit.run("run", _job(tmp, model, tmp / "out", cluster=False), "--json")
    assert r.rc == 0, r.stderr
    return cli.output_bytes(tmp / "out")


def _shards(out) -> list[dict]:
    with open(os.path.join(out, layout.STATE_DIR, layout.JOURNAL)) as f:
        return [r for r in map(json.loads, f) if r.get("type") == "Shard"]


def _await_fault(tmp, index, point="quantize"):
    """A fault that holds the worker reaching `point` of layer `index` until a file exists: (env, marker, go)."""
    marker, go = os.path.join(tmp, f"held-{index}"), os.path.join(tmp, f"go-{index}")
    spec = {"point": point, "action": "await", "index": index, "path": go, "once": marker}
    return {faultkit.FAULT_ENV: json.dumps(spec)}, marker, go


def _gone(pids, timeout=60.0) -> list[int]:
    """The pids among `pids` still alive (zombies count as gone) after waiting up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _agents() -> list[int]:
    """Processes of our actors (Ray names an actor's process ray::CLASS...): seats and node hosts."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(("ray::Seat", "ray::NodeHost")):
            out.append(p.pid)
    return out


def test_data_free_export_on_two_nodes_equals_this_hosts(host, model, local_ref, tmp_path):
    """W4A16 on two worker nodes: byte-identical to this host's export; the journal, events and report name the
    node of every part, and parts come from both nodes."""
    r = _run(host, _job(tmp_path, model, tmp_path / "out")).wait()
    assert r.rc == 0, r.stderr
    assert cli.output_bytes(tmp_path / "out") == local_ref
    joined = r.of("ClusterJoined")[0]
    assert len(joined["agents"]) == 2 and joined["nodes"] == 2 and joined["host"] == "127.0.0.1", joined
    nodes = {w["where"] for w in r.of("WorkerStarted")}
    assert len({n.split("node ")[1][:8] for n in nodes}) == 2, nodes
    wheres = [s["where"] for s in _shards(tmp_path / "out") if s["index"] >= 0]
    assert len(wheres) == LAYERS and all("node " in w for w in wheres), wheres
    report = json.loads(cli.run("report", str(tmp_path / "out"), "--json").stdout)
    assert all(p["where"] for p in report["parts"] if p["index"] >= 0), report["parts"]


def test_worker_sigkilled_mid_layer_on_one_node_is_retried(host, model, local_ref, tmp_path):
    """A remote worker SIGKILLed while quantizing layer 2: the layer is retried, the run ends byte-identical."""
    marker = tmp_path / "killed"
    fault = {faultkit.FAULT_ENV: json.dumps({"point": "quantize", "action": "sigkill", "index": 2,
                                             "once": str(marker)})}
    r = _run(host, _job(tmp_path, model, tmp_path / "out"), fault).wait()
    assert r.rc == 0, r.stderr
    assert os.path.exists(marker) and any(e["index"] == 2 for e in r.of("Retrying")), r.of("Retrying")
    assert cli.output_bytes(tmp_path / "out") == local_ref


def test_node_removed_mid_export_and_nothing_listens_beyond_loopback(host, model, local_ref, tmp_path):
    """While a worker holds layer 2, every listening socket in the cluster's namespace (Ray's, the run's port) is on
    loopback; then that worker's node is removed: its part goes to a worker on the other node, the run ends
    byte-identical. A node is added back for the tests after it."""
    env, marker, go = _await_fault(tmp_path, 2)
    with _run(host, _job(tmp_path, model, tmp_path / "out"), env) as r:
        assert faultkit.wait_marker(marker, 180), r.stderr
        listening = host.ask("listening")["listening"]
        assert listening and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")) for a in listening), \
            listening
        held = faultkit.read_marker(marker)["pid"]
        where = next(e["where"] for e in r.of("WorkerStarted") if e["pid"] == held)
        node = next(n for n in host.ask("nodes")["nodes"] if n.startswith(where.split("node ")[1][:8]))
        host.ask("remove_node", node=node)
        open(go, "w").close()
        r.wait()
    host.ask("add_node", num_cpus=2)
    assert r.rc == 0, r.stderr
    assert any(e["index"] == 2 for e in r.of("Retrying")), r.of("Retrying")
    assert cli.output_bytes(tmp_path / "out") == local_ref
    assert _gone([held]) == []


def test_slots_whose_node_left_wait_for_room_and_use_a_node_that_joins(host, tiny_models, tmp_path):
    """Four workers fill both nodes, each held at its first layer (8 layers: one each and one reserved); one node is
    removed: its two slots find no room and are left out (WorkerLeftOut), then a new node joins and they start there
    again, take parts, and the run ends byte-identical to this host's export."""
    model = tiny_models("llama", layers=8, hidden=128, seed=4)
    ref = faultkit.run("run", _job(tmp_path, model, tmp_path / "ref", cluster=False), "--json")
    assert ref.rc == 0, ref.stderr
    go = tmp_path / "go"
    env = {faultkit.FAULT_ENV: json.dumps({"point": "quantize", "action": "await", "path": str(go)}),
           "SUPERVISOR_TEST_PLACE_SECONDS": "3"}
    with _run(host, _job(tmp_path, model, tmp_path / "out", workers=4), env) as r:
        r.wait_for("LayerStarted", 180, where=lambda e: len(r.of("LayerStarted")) >= 4)
        started = r.of("WorkerStarted")
        node = started[0]["where"].split("node ")[1][:8]
        gone = next(n for n in host.ask("nodes")["nodes"] if n.startswith(node))
        host.ask("remove_node", node=gone)
        left = lambda e: len(r.of("WorkerLeftOut")) >= 2  # noqa: E731
        assert r.wait_for("WorkerLeftOut", 180, where=left), r.stderr
        new = host.ask("add_node", num_cpus=2)["node"][:8]
        back = lambda e: sum(new in w["where"] for w in r.of("WorkerStarted")) >= 2  # noqa: E731
        assert r.wait_for("WorkerStarted", 180, where=back), r.stderr
        open(go, "w").close()
        r.wait()
    assert r.rc == 0, r.stderr
    assert sum(new in s["where"] for s in _shards(tmp_path / "out")) >= 1, _shards(tmp_path / "out")
    assert cli.output_bytes(tmp_path / "out") == cli.output_bytes(tmp_path / "ref")


def test_supervisor_sigkilled_leaves_no_worker_and_the_rerun_resumes(host, model, local_ref, tmp_path):
    """The supervisor SIGKILLed while a worker holds layer 2: every worker, seat and node host of the run exits (their
    connection drops; Ray ends a dead driver's actors), and the same command resumes to a byte-identical end."""
    env, marker, go = _await_fault(tmp_path, 2)
    job = _job(tmp_path, model, tmp_path / "out")
    r = _run(host, job, env)
    try:
        assert faultkit.wait_marker(marker, 180), r.stderr
        workers = [e["pid"] for e in r.of("WorkerStarted")]
        agents = _agents()
        assert agents, "no seat or node host process found while the run held a layer"
        os.kill(r.pid, 9)
        r.wait()
    finally:
        cli.end_group(r.proc)
    assert _gone(workers) == [] and _gone(agents) == [], "workers or actors outlived their supervisor"
    open(go, "w").close()
    again = _run(host, job).wait()
    assert again.rc == 0, again.stderr
    assert cli.output_bytes(tmp_path / "out") == local_ref


def test_connections_without_the_secret_are_refused_and_the_run_goes_on(host, model, local_ref, tmp_path):
    """A connection that sends nothing and one that answers the challenge with another secret's key are closed
    before any frame, each logged (event and .export/logs/cluster.log), and the wrong one is told so; the run ends
    byte-identical."""
    env, marker, go = _await_fault(tmp_path, 1)
    with _run(host, _job(tmp_path, model, tmp_path / "out"), env) as r:
        assert faultkit.wait_marker(marker, 180), r.stderr
        joined = r.of("ClusterJoined")[0]
        script = ("import os, socket, time\n"
                  "from supervisor.cluster import channel\n"
                  f"a = socket.create_connection(({joined['host']!r}, {joined['port']}))\n"
                  "a.shutdown(socket.SHUT_WR); a.recv(1); a.close()\n"
                  "token = os.urandom(channel.TOKEN_BYTES)\n"
                  "try:\n"
                  f"    channel.connect({joined['host']!r}, {joined['port']}, token,\n"
                  "                    channel.worker_key(os.urandom(32), token), None, time.monotonic() + 30)\n"
                  "    print('ACCEPTED')\n"
                  "except channel.HandshakeRefused as exc:\n"
                  "    print('REFUSED', exc)\n")
        told = subprocess.run([*host.prefix, sys.executable, "-c", script], check=True, timeout=60,
                              capture_output=True, text=True).stdout
        r.wait_for("ConnectionRefused", 30, where=lambda e: len(r.of("ConnectionRefused")) >= 2)
        open(go, "w").close()
        r.wait()
    assert r.rc == 0, r.stderr
    assert told.startswith("REFUSED") and "another" in told, told
    reasons = [e["reason"] for e in r.of("ConnectionRefused")]
    assert any("hello" in x for x in reasons) and any("wrong secret" in x for x in reasons), reasons
    with open(tmp_path / "out" / layout.STATE_DIR / layout.LOGS / "cluster.log") as f:
        assert f.read().count("refused a connection") == 2
    assert cli.output_bytes(tmp_path / "out") == local_ref


FLOOD = 1100  # idle connections, more than the supervisor's file limit below
FILE_LIMIT = 512
STRANGERS_MAX = 100 + 4  # remote.MAX_HANDSHAKES, plus the workers' own connections to the port


def _port_connections(pid: int, port: int) -> int:
    """File descriptors of process `pid` that are TCP connections on its local `port` (the listening socket aside),
    read from its own network namespace's view (/proc/PID/net/tcp*; psutil's reads the caller's namespace)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        held += link.startswith("socket:[") and link[8:-1] in inodes
    return held


def test_a_flooded_port_still_lets_a_replacement_worker_in(host, model, local_ref, tmp_path):
    """A supervisor limited to 512 files whose port gets 1100 idle connections, kept open and redialled when
    closed: it holds at most about a hundred of them at any time, a worker SIGSTOPped there is replaced after the
    heartbeat timeout by one that connects through the flood, and the export ends byte-identical."""
    go = tmp_path / "go"
    env = {faultkit.FAULT_ENV: json.dumps({"point": "quantize", "action": "await", "path": str(go)})}
    job = _job(tmp_path, model, tmp_path / "out", heartbeat_timeout=10)
    flood = None
    with faultkit.LiveRun("run", job, "--json", env={"RAY_ADDRESS": host.address, **env},
                          prefix=[*host.prefix, "prlimit", f"--nofile={FILE_LIMIT}:{FILE_LIMIT}", "--"]) as r:
        try:
            both = r.wait_for("LayerStarted", 240, where=lambda e: len(r.of("LayerStarted")) >= 2)
            assert both, r.stderr
            assert psutil.Process(r.pid).rlimit(psutil.RLIMIT_NOFILE) == (FILE_LIMIT, FILE_LIMIT)
            port = r.of("ClusterJoined")[0]["port"]
            before = psutil.Process(r.pid).num_fds()
            flood = subprocess.Popen([*host.prefix, sys.executable, "-m", "tests.cluster.flood",
                                      r.of("ClusterJoined")[0]["host"], str(port), str(FLOOD)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert json.loads(flood.stdout.readline())["dialled"] == FLOOD
            held, fds, sampling = [], [], True

            def sample():
                while sampling:
                    try:
                        held.append(_port_connections(r.pid, port))
                        fds.append(psutil.Process(r.pid).num_fds())
                    except (OSError, psutil.Error):
                        return
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            stopped = r.of("WorkerStarted")[0]["pid"]
            os.kill(stopped, signal.SIGSTOP)  # silent from now on: the heartbeat timeout replaces it
            replaced = r.wait_for("WorkerStarted", 240, where=lambda e: e.get("since_death") is not None)
            assert replaced, r.stderr
            assert flood.poll() is None  # the replacement connected through the flood
            open(go, "w").close()
            r.wait(300)
            sampling = False
            sampler.join(5)
        finally:
            if flood is not None:
                flood.stdin.close()
                flood.wait(30)
    assert r.rc == 0, r.stderr
    assert held and 50 < max(held) <= STRANGERS_MAX, (max(held), len(held))  # flooded, and bounded
    assert max(fds) - before <= STRANGERS_MAX + 16, (before, max(fds))
    assert any(e["index"] is not None for e in r.of("Retrying")) and \
        any("heartbeat" in e["reason"] for e in r.of("Retrying")), r.of("Retrying")
    assert len(r.of("ConnectionRefused")) < 200, len(r.of("ConnectionRefused"))  # counted, not one event each
    assert any("more connections refused" in e["reason"] for e in r.of("ConnectionRefused"))
    assert cli.output_bytes(tmp_path / "out") == local_ref
    assert _gone([stopped]) == []


def test_a_worker_back_from_a_partition_never_lands_its_part(host, model, local_ref, tmp_path):
    """A worker cut off inside layer 2 (its heartbeats stop and its node host cannot signal it, as in a network
    partition) is taken for lost and layer 2 is redone by a fresh worker; then the cut-off worker goes on, stages
    its layer 2 and tries to report it: the shard that was placed is untouched (same inode, same bytes), nothing the
    late worker wrote is placed, and the folder ends byte-identical to this host's export."""
    cut, heal, go = tmp_path / "cut", tmp_path / "heal", tmp_path / "go"
    faults = [{"point": "quantize", "action": "partitioned", "index": 2, "path": str(heal), "once": str(cut)},
              {"point": "quantize", "action": "await", "index": 3, "path": str(go)}]  # the run outlives the late write
    env = {faultkit.FAULT_ENV: json.dumps(faults), DEAF_ENV: str(cut)}
    out = tmp_path / "out"
    shard = out / layout.shard_name(2)
    with _run(host, _job(tmp_path, model, out, heartbeat_timeout=5), env) as r:
        assert faultkit.wait_marker(cut, 180), r.stderr
        late = faultkit.read_marker(cut)["pid"]
        redone = r.wait_for("LayerWritten", 240, where=lambda e: e["index"] == 2)
        assert redone is not None, r.stderr
        placed, placed_bytes = os.stat(shard), shard.read_bytes()
        open(heal, "w").close()  # the partition heals: the late worker finishes its part and tries to report it
        assert _gone([late], 120) == [], "the late worker did not end after its reply found no supervisor"
        staged = [fn for fn in os.listdir(out / layout.STATE_DIR / layout.TMP) if fn.startswith(shard.name + ".")]
        assert staged, "the late worker staged nothing: the test did not reach the late write"
        assert os.stat(shard).st_ino == placed.st_ino and shard.read_bytes() == placed_bytes
        open(go, "w").close()
        r.wait()
    assert r.rc == 0, r.stderr
    assert any(e["index"] == 2 and "heartbeat" in e["reason"] for e in r.of("Retrying")), r.of("Retrying")
    assert [s["ino"] for s in _shards(out) if s["index"] == 2] == [placed.st_ino]
    assert cli.output_bytes(out) == local_ref
    assert cli.run("verify", str(out)).returncode == 0


def test_a_hosts_control_calls_never_wait_behind_waits_and_stop_is_bounded(host):
    """On a NodeHost actor: with 100 wait_worker calls pending on a worker that never exits, ping and
    signal_worker still answer at once; and stop() on a remote worker whose host cannot signal it (a partition)
    returns within its deadline, the worker taken for lost."""
    out = subprocess.run([*host.prefix, sys.executable, "-m", "tests.cluster.hostcheck", host.address], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["control_seconds"] is not None and got["control_seconds"] < 10, got
    assert got["stop_seconds"] is not None and got["stop_seconds"] < 30, got
    assert "not confirmed dead" in got["lost"], got


def test_a_node_that_cannot_see_the_output_is_refused_before_anything_is_written(host, model, tmp_path):
    """A third node that sees the file system under another root: with five workers (two CPUs per node) one lands
    there, and the run exits 2 naming that node, with no output folder and no probe file left."""
    node = host.ask("add_node", num_cpus=2, env={BLIND_ENV: str(tmp_path / "elsewhere")})["node"]
    try:
        proc = subprocess.run(cli.as_a_terminal([*host.prefix, cli.SUPERVISOR, "run",
                                                 _job(tmp_path, model, tmp_path / "out", workers=5)]),
                              env=cli.run_env({"RAY_ADDRESS": host.address}), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=300)
    finally:
        host.ask("remove_node", node=node)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "node " in lines[0] and "cannot see" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out")
    assert not [fn for fn in os.listdir(tmp_path) if fn.startswith(".supervisor-probe")]


def test_a_cluster_that_does_not_answer_is_refused_at_once(host, model, tmp_path):
    """ray_address where no cluster runs: exit 2 within seconds (Ray itself would retry for minutes), one line,
    nothing written."""
    job = _job(tmp_path, model, tmp_path / "out", ray_address="127.0.0.1:1")
    t = time.monotonic()
    proc = subprocess.run(cli.as_a_terminal([*host.prefix, cli.SUPERVISOR, "run", job]), env=cli.run_env(),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - t < 60, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "cannot reach the Ray cluster at 127.0.0.1:1" in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "out")


N, SEQ = 16, 32


@pytest.fixture(scope="module")
def calib(model, tmp_path_factory):
    """A GPTQ W4A16 job with a group of W = 2 ranks (`job(folder, name, cluster)` writes it) and this host's
    export of it: the bytes every calibrated cluster run must write."""
    tmp = tmp_path_factory.mktemp("calib")
    calibration = {"dataset": write_jsonl(tmp / "ids.jsonl", token_rows(N, seed=7)), "samples": N, "seq_len": SEQ}

    def job(folder, name, cluster):
        extra = {"cluster": "ray"} if cluster else {}
        return cli.write_job(folder / f"{name}.toml", model, folder / name, "W4A16", method="gptq",
                             calibration=calibration, workers=2, torch_threads=1, startup_timeout=120, **extra)

    local = faultkit.run("run", job(tmp, "local", False), "--json")
    assert local.rc == 0, local.stderr
    return job, cli.output_bytes(tmp / "local")


def test_calibrated_group_across_nodes_equals_this_hosts(host, calib, tmp_path):
    """GPTQ W4A16 on a group of W = 2 ranks, one per node (rendezvous on rank 0's node), equals this host's W = 2
    group byte for byte, and while a rank is held in layer 1's forward nothing in the cluster's namespace listens
    beyond loopback (rank 0's store, the ranks' gloo pairs, Ray's and the run's ports); so does a run whose rank 1
    is SIGKILLed while calibrating layer 1 (the group is torn down and rebuilt from the journaled boundaries)."""
    job, local = calib
    env, marker, go = _await_fault(tmp_path, 1, point="forward")
    with _run(host, job(tmp_path, "ray", True), env) as r:
        assert faultkit.wait_marker(marker, 180), r.stderr
        listening = host.ask("listening")["listening"]
        open(go, "w").close()
        r.wait()
    assert listening and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")) for a in listening), \
        listening
    assert r.rc == 0, r.stderr
    assert r.of("Started")[0]["world"] == 2
    nodes = {w["where"].split("node ")[1][:8] for w in r.of("WorkerStarted")}
    assert len(nodes) == 2, r.of("WorkerStarted")
    assert cli.output_bytes(tmp_path / "ray") == local
    marker = tmp_path / "rank-killed"
    fault = {faultkit.FAULT_ENV: json.dumps({"point": "calibrate", "action": "sigkill", "index": 1, "worker": 1,
                                             "once": str(marker)})}
    killed = _run(host, job(tmp_path, "ray-killed", True), fault).wait()
    assert killed.rc == 0, killed.stderr
    assert os.path.exists(marker) and any(e["index"] == 1 for e in killed.of("Retrying")), killed.of("Retrying")
    assert cli.output_bytes(tmp_path / "ray-killed") == local


def test_a_node_removed_inside_a_calibrated_layer_ends_like_this_hosts(host, calib, tmp_path):
    """A W = 2 group, one rank per node, with rank 1 held inside layer 1's calibration (the `await` fault): rank
    1's node is removed; the group is rebuilt on the node left, layer 1 redone, and the export is byte-identical to
    this host's W = 2 export. A node is added back for the tests after it."""
    job, local = calib
    marker, go = tmp_path / "held", tmp_path / "go"
    fault = {faultkit.FAULT_ENV: json.dumps({"point": "calibrate", "action": "await", "index": 1, "worker": 1,
                                             "path": str(go), "once": str(marker)})}
    try:
        with _run(host, job(tmp_path, "ray", True), fault) as r:
            assert faultkit.wait_marker(marker, 240), r.stderr
            held = faultkit.read_marker(marker)["pid"]
            where = next(e["where"] for e in r.of("WorkerStarted") if e["pid"] == held)
            node = next(n for n in host.ask("nodes")["nodes"] if n.startswith(where.split("node ")[1][:8]))
            host.ask("remove_node", node=node)
            open(go, "w").close()
            r.wait()
    finally:
        host.ask("add_node", num_cpus=2)
    assert r.rc == 0, r.stderr
    assert any(e["index"] == 1 for e in r.of("Retrying")), r.of("Retrying")
    assert cli.output_bytes(tmp_path / "ray") == local
    assert _gone([held]) == []
