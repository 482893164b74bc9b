"""A run's workers on a Ray cluster (`[resources] cluster = "ray"`): joining it, a seat per worker slot and a host
per node, the check that every node sees the source and the output, and their lives.

    Cluster.join(job, files, output, ...)  ray.init(address): `ray_address`, $RAY_ADDRESS, or this node's cluster
      slots: device "cuda" ─▶ one per GPU in the cluster (`workers` caps it); "cpu" ─▶ `workers` (0: one per node)
      seats: one Ray actor per slot holding its GPU (or CPU), spread over the nodes (supervisor/node_agent.Seat);
             with `workers` unset, a node keeps only the seats its free memory holds (one at least)
      hosts: one NodeHost per node with seats, pinned there: the node's warm parent and workers
      probe: a file with a nonce next to the output; every host reads it, writes its answer, checks every source
             file's size ─▶ a node that cannot: ClusterError naming it (exit 2), before anything is written
    Cluster.listener                        the run's TCP port (supervisor/cluster/remote.py), on the address Ray uses here;
                                            TLS with Ray's certificates where Ray runs with TLS (every node checked)
    Cluster.agent(slot, wait)               the slot's seat and its node's host; a seat whose node died is replaced
                                            wherever Ray has room; none within `wait`: NoRoom (the pending seat
                                            stays asked for, so a node that comes back takes it)
    Cluster.close()                         hosts (their workers) and seats ended, the port closed, ray.shutdown()

Ray places the actors and reports their deaths (a worker's `RemoteProc`); it never carries a tensor: workers read
the source and write shards on the shared file system. Ray is imported only here and in the modules it loads, and
only for a cluster job. Owns the Ray connection and the actors; the run's scheduler, journal and events are the
same as on one host.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from dataclasses import dataclass

from supervisor.errors import ClusterError, DeviceError, NoRoom, one_line

PROBE_SECONDS = 120.0  # every node host's answer to the file-system probe; past it the join fails
SHUTDOWN_SECONDS = 30.0  # ray.shutdown() at the run's end, on a thread: past it the run ends without waiting
PLACE_SECONDS = 60.0  # how long a replacement seat waits for room before its slot is left out (and waits on)


@dataclass
class Agent:
    """One slot's seat, the host of its node, and where that is."""

    seat: object
    host_actor: object
    node_id: str
    ip: str
    host: str
    gpus: list[str]
    cpus: int = 1
    ram: int = 0
    interface: str = ""  # the node's network interface that holds `ip`

    @property
    def where(self) -> str:
        gpu = f" GPU {','.join(self.gpus)}" if self.gpus else ""
        return f"{self.host} ({self.ip}, node {self.node_id[:8]}){gpu}"

    @property
    def env(self) -> dict[str, str]:
        """What this slot's worker adds to its node's environment: the seat's GPUs, and the interface a calibrated
        group's gloo and NCCL sockets bind (the one holding the node's Ray IP, supervisor.workers.group.data_plane_env)."""
        from supervisor.workers.group import data_plane_env

        gpus = {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)} if self.gpus else {}
        return {**gpus, **data_plane_env(self.interface)}


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError('[resources] cluster = "ray" needs Ray on this host and on every node: '
                           "pip install 'layerwise-supervisor[ray]' (or pip install ray)") from None
    return ray


# The supervisor's variables a remote worker takes over its node's own environment: this package's switches
# (test faults among them) and the libraries' offline and cache settings; nothing host-specific (paths, devices).
_REMOTE_ENV_PREFIXES = ("SUPERVISOR_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def remote_env(job) -> dict[str, str]:
    """What the run sets in a remote worker's environment (the node's host adds it to its node's own)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_REMOTE_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if job.resources.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker must not create a CUDA context on its node's GPUs
    return env


class Cluster:
    def __init__(self, ray, device: str, options: dict, host_args: tuple):
        self.ray, self.device = ray, device
        self._options, self._host_args = options, host_args
        self.agents: list[Agent] = []
        self.hosts: dict[str, object] = {}  # node id -> its NodeHost
        self.listener = None
        self.left_out: list[str] = []  # seats given back at the join: their node's memory holds no more workers
        self.address = ray.get_runtime_context().gcs_address
        self.on_refused = None  # (peer, reason) of each connection closed for a wrong or missing secret (the run's)
        self._pending: dict[int, object] = {}  # slot -> a replacement seat Ray has not placed yet
        self._lock = threading.Lock()

    # ---- joining ---------------------------------------------------------------------------------------------
    @classmethod
    def join(cls, job, source_files: dict[str, int], output: str, fmt: str, env: dict[str, str],
             layer_bytes: int) -> "Cluster":
        """Connect, place a seat per slot and a host per node, probe the shared file system; raises ClusterError
        (bad input) or NoRoom."""
        ray = _import_ray()
        address = _reachable(job.resources.ray_address or os.environ.get("RAY_ADDRESS") or "auto")
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False,
                     configure_logging=False, namespace=f"supervisor-{secrets.token_hex(4)}")
        except Exception as exc:  # noqa: BLE001 - ConnectionError and Ray's own: one line to the user
            raise ClusterError(f"cannot join the Ray cluster at {address!r}: {one_line(exc)}; start it (ray start "
                               "--head) or set [resources] ray_address / $RAY_ADDRESS") from None
        cluster = None
        try:
            device, count = _slots(ray, job)
            options = {"num_gpus": 1} if device != "cpu" else {"num_cpus": 1}
            cluster = cls(ray, device, options, (fmt, job.resources.startup_timeout, env, output))
            seats = [cluster._new_seat() for _ in range(count)]
            infos = _wait_placed(ray, seats, job.resources.startup_timeout, count, options)
            if job.resources.workers <= 0:
                seats, infos = cluster._fit_memory(seats, infos, layer_bytes)
            cluster.agents = [cluster._agent(seat, info) for seat, info in zip(seats, infos)]
            tls = _tls()
            _probe(ray, cluster, source_files, output, tls is not None)
            from supervisor.cluster.remote import Listener

            cluster.listener = Listener(ray.util.get_node_ip_address(), cluster._refuse, tls[0] if tls else None)
            return cluster
        except BaseException:
            if cluster is not None:
                cluster.close()
            else:
                ray.shutdown()
            raise

    def _new_seat(self):
        from supervisor.cluster.node_agent import Seat

        return self.ray.remote(Seat).options(scheduling_strategy="SPREAD", max_restarts=0, **self._options).remote()

    def _fit_memory(self, seats: list, infos: list[dict], layer_bytes: int) -> tuple[list, list[dict]]:
        """Seats beyond what their node's free memory holds are given back (a worker wants devices.worker_bytes)."""
        from supervisor.workers.devices import worker_bytes

        kept, kept_info, per_node = [], [], {}
        for seat, info in zip(seats, infos):
            fits = max(1, info["ram"] // worker_bytes(layer_bytes))
            n = per_node.get(info["node_id"], 0)
            if n < fits:
                per_node[info["node_id"]] = n + 1
                kept.append(seat)
                kept_info.append(info)
            else:
                self.ray.kill(seat)
                self.left_out.append(f"{info['host']} (node {info['node_id'][:8]}): its free memory "
                                     f"({info['ram'] / 2**30:.0f} GiB) holds {fits} worker(s) of this model")
        return kept, kept_info

    def _host_for(self, node_id: str):
        """The node's NodeHost, started (pinned to the node) on first use."""
        host = self.hosts.get(node_id)
        if host is not None:
            try:
                self.ray.get(host.ping.remote(), timeout=10)
                return host
            except Exception:  # noqa: BLE001 - its node died and came back, or it was killed: a new one
                pass
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from shared import layout

        fmt, startup_timeout, env, output = self._host_args
        log = layout.state_path(output, layout.LOGS, f"zygote-{node_id[:8]}.log")
        host = host_actor_class(self.ray).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(fmt, startup_timeout, log, env)
        self.hosts[node_id] = host
        return host

    def _agent(self, seat, info: dict) -> Agent:
        return Agent(seat=seat, host_actor=self._host_for(info["node_id"]), node_id=info["node_id"], ip=info["ip"],
                     host=info["host"], gpus=info["gpus"], cpus=info["cpus"], ram=info["ram"],
                     interface=info.get("interface", ""))

    def _refuse(self, peer: str, reason: str) -> None:
        logging.getLogger("supervisor").warning("refused a connection to the run's port from %s: %s", peer, reason)
        if self.on_refused is not None:
            self.on_refused(peer, reason)

    # ---- a slot's agent ----------------------------------------------------------------------------------------
    def agent(self, slot: int, wait: float = PLACE_SECONDS) -> Agent:
        """The slot's seat and host, the seat replaced first when it died (its node left the cluster); NoRoom when
        Ray has not placed the replacement within `wait` s (it stays asked for: a later call takes it once placed)."""
        with self._lock:
            a = self.agents[slot]
            if slot not in self._pending:
                try:
                    self.ray.get([a.seat.info.remote(), a.host_actor.ping.remote()], timeout=10)
                    return a
                except Exception:  # noqa: BLE001 - dead actor or node: Ray's report
                    self._pending[slot] = self._new_seat()
            seat = self._pending[slot]
            ref = seat.info.remote()
            ready, _ = self.ray.wait([ref], timeout=wait)
            if not ready:
                raise NoRoom(f"worker {slot}'s node left the cluster and no node has room for it yet")
            del self._pending[slot]
            try:
                self.ray.kill(a.seat)
            except Exception:  # noqa: BLE001 - dead already
                pass
            self.agents[slot] = self._agent(seat, self.ray.get(ref))
            return self.agents[slot]

    def on_node(self, agent: Agent) -> int:
        """How many of the run's slots share `agent`'s node (CPU workers there split its cores)."""
        return sum(a.node_id == agent.node_id for a in self.agents)

    def rendezvous(self, slot: int):
        """(address, port) for a calibrated group whose rank 0 runs on `slot`'s node: its Ray IP, and a port whose
        socket that node's host binds and hands to rank 0 (NodeHost.free_port)."""
        a = self.agent(slot)
        return a.ip, self.ray.get(a.host_actor.free_port.remote(), timeout=30)

    def close(self) -> None:
        """End every worker (through its host), every actor, the port, and the Ray connection; idempotent."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        ray = self.ray
        closing = [h.close.remote() for h in self.hosts.values()]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=15)
        except Exception:  # noqa: BLE001 - dead hosts
            pass
        for actor in [*self.hosts.values(), *(a.seat for a in self.agents), *self._pending.values()]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        self.hosts, self._pending = {}, {}
        # a GCS that stopped answering must not hold the run's end: Ray ends a gone driver's actors itself
        done = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
        done.start()
        done.join(SHUTDOWN_SECONDS)
        if done.is_alive():
            logging.getLogger("supervisor").warning("ray.shutdown() did not return within %.0fs; not waiting "
                                                    "for it", SHUTDOWN_SECONDS)


def host_actor_class(ray, cls=None):
    """NodeHost (or a test's subclass) as a Ray actor class, its calls in their concurrency groups
    (node_agent.CONCURRENCY_GROUPS)."""
    from supervisor.cluster.node_agent import CONCURRENCY_GROUPS, NodeHost

    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls or NodeHost)


def _tls():
    """(server, client) SSL contexts from Ray's own TLS settings, None where Ray runs without TLS."""
    from supervisor.cluster.channel import tls_contexts

    try:
        return tls_contexts()
    except ValueError as exc:
        raise ClusterError(f"{exc}; the run's port uses Ray's certificates (docs/scale.md, Trust)") from None


REACH_SECONDS = 5.0


def _reachable(address: str) -> str:
    """The cluster's HOST:PORT, once something answers there: ray.init retries an address where no cluster runs
    (a stale /tmp/ray/ray_current_cluster, a typo) for minutes, so a dead address is refused here at once."""
    try:
        from ray._private.services import canonicalize_bootstrap_address  # Ray's own resolution of "auto"

        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as exc:
        raise ClusterError(f"no Ray cluster to join ({one_line(exc)}); start one (ray start --head) or set "
                           "[resources] ray_address / $RAY_ADDRESS") from None
    except Exception:  # noqa: BLE001 - a Ray without that helper: take the address as given
        resolved = address
    if not resolved or ":" not in resolved:
        return address
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_SECONDS).close()
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {resolved} ({exc.__class__.__name__}: "
                           f"{getattr(exc, 'strerror', None) or exc}); check that it runs there, or set [resources] "
                           "ray_address / $RAY_ADDRESS") from None
    return resolved


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


def _wait_placed(ray, seats, timeout: float, count: int, options: dict) -> list[dict]:
    refs = [s.info.remote() for s in seats]
    wait = min(timeout, PLACE_SECONDS)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
    if len(ready) < len(refs):
        for s in seats:
            ray.kill(s)
        what = "GPU" if "num_gpus" in options else "CPU"
        raise NoRoom(f"the Ray cluster has room for {len(ready)} of the {count} workers asked (one {what} each) "
                     f"within {wait:.0f}s; lower [resources] workers or add nodes")
    return ray.get(refs)


def _probe(ray, cluster: Cluster, source_files: dict[str, int], output: str, tls: bool) -> None:
    """Every node with a seat must see the source files at their sizes and the output's folder as this host does
    (and, with `tls`, hold Ray's TLS certificates)."""
    where = output
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    probe = os.path.join(where, f".supervisor-probe-{secrets.token_hex(8)}")
    nodes = {a.node_id: a for a in cluster.agents}
    replies = {node: f"{probe}.{i}" for i, node in enumerate(nodes)}
    nonce = secrets.token_hex(16)
    try:
        with open(probe, "w") as f:
            f.write(nonce)
        refs = [cluster.hosts[node].probe.remote(source_files, probe, nonce, replies[node]) for node in nodes]
        checks = [cluster.hosts[node].check_tls.remote() for node in nodes] if tls else []
        try:
            answers, tls_answers = ray.get(refs, timeout=PROBE_SECONDS), ray.get(checks, timeout=PROBE_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the node hosts did not answer the file-system probe within {PROBE_SECONDS:.0f}s; "
                               "check the nodes (ray status)") from None
        for a, answer in zip(nodes.values(), tls_answers):
            if answer:
                raise ClusterError(f"node {a.where} {answer}: every node must run Ray with the same TLS "
                                   "settings (RAY_USE_TLS and its certificates)")
        for (node, a), answer in zip(nodes.items(), answers):
            if not answer:
                try:
                    with open(replies[node]) as f:
                        ok = f.read() == nonce[::-1]
                except OSError:
                    ok = False
                answer = "" if ok else f"writes its files where this host cannot read them ({replies[node]!r})"
            if answer:
                raise ClusterError(f"node {a.where} {answer}: source and output must be on a file system every node "
                                   "of the cluster sees (the same paths)")
    finally:
        for path in [probe, *replies.values()]:
            try:
                os.unlink(path)
            except OSError:
                pass

