"""A run's workers on a Ray cluster (`[resources] cluster = "ray"`): joining it, one node agent per slot, the check
that every node sees the source and the output, and the agents' lives.

    Cluster.join(job, source, output)     ray.init(address): $RAY_ADDRESS, `ray_address`, or this node's cluster
      slots: device "cuda" ─▶ one per GPU in the cluster (`workers` caps it); "cpu" ─▶ `workers` (0: one per node)
      agents: one Ray actor per slot (num_gpus=1, or num_cpus=1), spread over the nodes (supervisor/node_agent.py)
      probe: a file with a nonce next to the output; every agent reads it, writes its answer, checks every source
             file's size ─▶ a node that cannot see them: InputError naming the node (exit 2), before anything is written
    Cluster.listener                       the run's TCP port (supervisor/remote.py), on the address Ray uses here
    Cluster.agent(slot)                    the slot's agent; a dead one (its node died) is replaced wherever Ray has
                                           room, or NoRoom: the slot is left out and the run goes on
    Cluster.close()                        agents killed, the port closed, ray.shutdown()

Ray places the agents and reports their deaths (a worker's `RemoteProc`); it never carries a tensor: workers read
the source and write shards on the shared file system. Ray is imported only here and in the modules it loads,
and only for a cluster job. Owns the Ray connection and the agents; the run's scheduler, journal and events are
the same as on one host.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
from dataclasses import dataclass

from supervisor.errors import ClusterError, DeviceError, NoRoom

AGENT_CONCURRENCY = 16  # wait_worker calls block in the actor while start_worker and signal_worker go on
PLACE_SECONDS = 60.0  # how long a replacement agent may wait for room on the cluster before its slot is left out


@dataclass
class Agent:
    """One slot's node agent: the actor handle and where it runs."""

    handle: object
    node_id: str
    ip: str
    host: str
    gpus: list[str]
    cpus: int = 1

    @property
    def where(self) -> str:
        gpu = f" GPU {','.join(self.gpus)}" if self.gpus else ""
        return f"{self.host} ({self.ip}, node {self.node_id[:8]}){gpu}"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError('[resources] cluster = "ray" needs Ray on this host and on every node: '
                           "pip install 'layerwise-supervisor[ray]' (or pip install ray)") from None
    return ray


class Cluster:
    def __init__(self, ray, device: str, agents: list[Agent], options: dict, init_args: tuple, listener):
        self.ray, self.device, self.agents = ray, device, agents
        self._options, self._init_args = options, init_args
        self.listener = listener
        self.address = ray.get_runtime_context().gcs_address
        self.on_refused = None  # (peer, reason) of each connection closed for a wrong or missing secret (the run's)
        self._lock = threading.Lock()

    # ---- joining ---------------------------------------------------------------------------------------------
    @classmethod
    def join(cls, job, source_files: dict[str, int], output: str, fmt: str, env: dict[str, str]) -> "Cluster":
        """Connect, start one agent per slot, probe the shared file system; raises ClusterError (bad input)."""
        ray = _import_ray()
        address = job.resources.ray_address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
                     configure_logging=False, namespace=f"supervisor-{secrets.token_hex(4)}")
        except Exception as exc:  # noqa: BLE001 - ConnectionError and Ray's own: one line to the user
            raise ClusterError(f"cannot join the Ray cluster at {address!r}: {_one_line(exc)}; start it (ray start "
                               "--head) or set [resources] ray_address / $RAY_ADDRESS") from None
        try:
            device, count = _slots(ray, job)
            options = {"num_gpus": 1} if device != "cpu" else {"num_cpus": 1}
            init_args = (fmt, job.resources.startup_timeout, env, output)
            agents = [_start_agent(ray, i, options, init_args) for i in range(count)]
            _wait_placed(ray, agents, job.resources.startup_timeout, count, options)
            placed = [_describe(ray, a) for a in agents]
            _probe(ray, placed, source_files, output)
            from supervisor.remote import Listener

            cluster = cls(ray, device, placed, options, init_args, None)
            cluster.listener = Listener(ray.util.get_node_ip_address(), cluster._refuse)
            return cluster
        except BaseException:
            ray.shutdown()
            raise

    def _refuse(self, peer: str, reason: str) -> None:
        logging.getLogger("supervisor").warning("refused a connection to the run's port from %s: %s", peer, reason)
        if self.on_refused is not None:
            self.on_refused(peer, reason)

    # ---- agents ----------------------------------------------------------------------------------------------
    def agent(self, slot: int) -> Agent:
        """The slot's agent, replaced first when it died (its node left the cluster); NoRoom when no node has room
        for it within PLACE_SECONDS."""
        with self._lock:
            a = self.agents[slot]
            try:
                self.ray.get(a.handle.info.remote(), timeout=10)
                return a
            except Exception:  # noqa: BLE001 - dead actor or node: Ray's report
                pass
            handle = _start_agent(self.ray, slot, self._options, self._init_args)
            ready, _ = self.ray.wait([handle.info.remote()], timeout=PLACE_SECONDS)
            if not ready:
                self.ray.kill(handle)
                raise NoRoom(f"worker {slot}'s node left the cluster and no other node had room for it within "
                             f"{PLACE_SECONDS:.0f}s")
            self.agents[slot] = _describe(self.ray, handle)
            return self.agents[slot]

    def on_node(self, agent: Agent) -> int:
        """How many of the run's agents share `agent`'s node (CPU workers there split its cores)."""
        return sum(a.node_id == agent.node_id for a in self.agents)

    def rendezvous(self, slot: int):
        """(address, port) for a calibrated group whose rank 0 runs on `slot`'s node."""
        a = self.agent(slot)
        return a.ip, self.ray.get(a.handle.free_port.remote(), timeout=30)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for a in self.agents:
            try:
                self.ray.get(a.handle.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - already dead
                pass
            try:
                self.ray.kill(a.handle)
            except Exception:  # noqa: BLE001
                pass
        self.ray.shutdown()


# The supervisor's variables a remote worker takes over its node's own environment: this package's switches
# (test faults among them) and the libraries' offline and cache settings; nothing host-specific (paths, devices).
_REMOTE_ENV_PREFIXES = ("SUPERVISOR_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def remote_env(job) -> dict[str, str]:
    """What the run sets in a remote worker's environment (the node agent adds it to its node's own)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_REMOTE_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if job.resources.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker must not create a CUDA context on its node's GPUs
    return env


def _slots(ray, job) -> tuple[str, int]:
    r = job.resources
    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if r.device == "cpu":
        return "cpu", r.workers if r.workers > 0 else len(nodes)
    gpus = int(total.get("GPU", 0))
    if gpus == 0:
        if r.device == "auto":
            return "cpu", r.workers if r.workers > 0 else len(nodes)
        raise DeviceError(f"[resources] device = {r.device!r} but the Ray cluster has no GPU "
                          f"({len(nodes)} node(s)); use device = \"cpu\" or add GPU nodes")
    if r.device.startswith("cuda:"):
        raise DeviceError(f'[resources] device = {r.device!r} names one GPU of this host; on a cluster use '
                          '"cuda" (every GPU) and [resources] workers to cap the count')
    return "cuda:0", min(gpus, r.workers) if r.workers > 0 else gpus


def _start_agent(ray, slot: int, options: dict, init_args: tuple):
    from supervisor.node_agent import NodeAgent

    fmt, startup_timeout, env, output = init_args
    from shared import layout

    log = layout.state_path(output, layout.LOGS, f"zygote-{slot}.log")
    remote = ray.remote(NodeAgent).options(max_concurrency=AGENT_CONCURRENCY, scheduling_strategy="SPREAD",
                                           max_restarts=0, **options)
    return remote.remote(fmt, startup_timeout, log, env)


def _wait_placed(ray, handles, timeout: float, count: int, options: dict) -> None:
    refs = [h.info.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(timeout, PLACE_SECONDS))
    if len(ready) < len(refs):
        for h in handles:
            ray.kill(h)
        what = "GPU" if "num_gpus" in options else "CPU"
        raise NoRoom(f"the Ray cluster has room for {len(ready)} of the {count} workers asked (one {what} each) "
                     f"within {min(timeout, PLACE_SECONDS):.0f}s; lower [resources] workers or add nodes")


def _describe(ray, handle) -> Agent:
    info = ray.get(handle.info.remote(), timeout=60)
    return Agent(handle=handle, node_id=info["node_id"], ip=info["ip"], host=info["host"], gpus=info["gpus"],
                 cpus=info["cpus"])


def _probe(ray, agents: list[Agent], source_files: dict[str, int], output: str) -> None:
    """Every agent's node must see the source files at their sizes and the output's folder as this host does."""
    where = output
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    token = secrets.token_hex(8)
    probe = os.path.join(where, f".supervisor-probe-{token}")
    replies = [f"{probe}.{i}" for i in range(len(agents))]
    nonce = secrets.token_hex(16)
    try:
        with open(probe, "w") as f:
            f.write(nonce)
        answers = ray.get([a.handle.probe.remote(source_files, probe, nonce, reply)
                           for a, reply in zip(agents, replies)], timeout=120)
        for a, answer, reply in zip(agents, answers, replies):
            if not answer:
                try:
                    with open(reply) as f:
                        ok = f.read() == nonce[::-1]
                except OSError:
                    ok = False
                answer = "" if ok else f"writes its files where this host cannot read them ({reply!r})"
            if answer:
                raise ClusterError(f"node {a.where} {answer}: source and output must be on a file system every node "
                                  "of the cluster sees (the same paths)")
    finally:
        for path in [probe, *replies]:
            try:
                os.unlink(path)
            except OSError:
                pass


def _one_line(exc: BaseException) -> str:
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return text[-1] if text else type(exc).__name__

