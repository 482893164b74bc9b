"""What runs on a worker's node: a Seat per worker slot (it holds the slot's GPU, or CPU) and one NodeHost per node
(its warm parent, and the workers it forks).

    supervisor/cluster/seats.py ──▶ Seat (Ray actor, num_gpus=1 or num_cpus=1, spread over the nodes)
                                info(): node id, address (and the interface holding it), host name, the GPUs
                                        Ray gave it, the node's cores and RAM
                           ──▶ NodeHost (Ray actor pinned to that node, no resources; one per node and run)
      probe(...)        can this node see the source and the output folder as the supervisor does?
      start_worker(…)   connect to the run's port (supervisor/cluster/remote.py) and prove this worker's key there, the
                        supervisor proving it back (supervisor/cluster/channel.py; inside TLS where Ray runs with TLS),
                        then fork `python -m child` from the node's warm parent (supervisor/workers/zygote.py's Zygote, as
                        on one host) with that socket (with TLS: its relay's plain end) as the worker's read and
                        write fds, its log file (shared file system) as stdout/stderr and the seat's GPUs in
                        CUDA_VISIBLE_DEVICES; returns the pid
      wait_worker(pid, timeout)  the exit code once the worker exits, None if it has not within `timeout`
                        (the supervisor's RemoteProc asks again: no thread waits a worker's whole life)
      signal_worker     SIGTERM / SIGKILL, as Worker.stop asks
    Calls run in concurrency groups of their own (CONCURRENCY_GROUPS): starts and probes ("start"), the quick
    control calls ("control": signal_worker, ping, free_port, close) and the waits ("wait"), so no number of
    pending waits or slow starts delays a signal.

One warm parent per node, as on one host one per run: the libraries are imported once per node, and every worker
there is forked from it. The worker is the same `python -m child` with the same parent-death rules: it dies with
the warm parent, which dies with the NodeHost's spawner thread; the actors die with their node or with the
supervisor that owns them (Ray kills an owner's actors). A worker whose supervisor vanished without closing the
connection (its host lost) gets an error on its next heartbeat write within the heartbeat timeout
(TCP_USER_TIMEOUT) and exits. Owns the processes on its node only; it never reads frames (the connection is the
worker's) and never decides anything about the export.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from shared.messages import LISTEN_PORT_ENV
from supervisor.cluster import channel

# Read by nothing on one host: a test can make one node of a local cluster see the shared file system under
# another root, as a node without the mount would (tests/cluster).
BLIND_ENV = "SUPERVISOR_TEST_NODE_BLIND"
# Test-only, in the run's environment (a node host reads it from the variables the run hands it): the path of a
# fault's marker (child/faults.py); signals to the worker the marker names never reach it, as when the supervisor
# cannot reach that worker's node (a network partition). tests/cluster: a late writer's part never lands.
DEAF_ENV = "SUPERVISOR_TEST_HOST_DEAF_TO"

# Threads per concurrency group of a NodeHost (ray.remote(concurrency_groups=...), supervisor/cluster/seats.py): a
# signal never queues behind a wait or a start. Waits answer within their timeout (remote.WAIT_SLICE), so more
# workers on a node than "wait" threads delays a wait's answer by a slice, never a signal or a start.
CONCURRENCY_GROUPS = {"start": 16, "control": 4, "wait": 32}
ZYGOTE_MARGIN = 30.0  # seconds beyond startup_timeout a warm parent's start may take before the host gives up


def _group(name: str):
    """@ray.method(concurrency_group=name): Ray is installed wherever a NodeHost runs; a module that imports this
    one without Ray (a test of the connect path) gets the plain method."""
    try:
        import ray
    except ImportError:
        return lambda f: f
    return ray.method(concurrency_group=name)


class Seat:
    """A worker slot's place on the cluster: Ray gives it its GPU (or CPU); it reports where that is."""

    def info(self) -> dict:
        import psutil
        import ray

        ctx = ray.get_runtime_context()
        from supervisor.workers.group import interface_holding

        ip = ray.util.get_node_ip_address()
        return {"node_id": ctx.get_node_id(), "ip": ip, "host": socket.gethostname(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "cpus": os.cpu_count() or 1,
                "ram": psutil.virtual_memory().available, "interface": interface_holding(ip)}


class NodeHost:
    def __init__(self, fmt: str, startup_timeout: float, zygote_log: str, env: dict[str, str]):
        self.fmt, self.startup_timeout, self.zygote_log = fmt, startup_timeout, zygote_log
        self.env = self._worker_env(env)
        self._zygote = None
        self._children: dict[int, object] = {}
        self._relays: dict[int, channel.TlsRelay] = {}
        self._listening: dict[int, socket.socket] = {}  # port -> the rendezvous socket free_port bound (rank 0's)
        self._lock = threading.Lock()
        # a warm parent's parent-death signal fires when the thread that spawned it ends: one thread for the actor's life
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-spawner")

    @staticmethod
    def _worker_env(overrides: dict[str, str]) -> dict[str, str]:
        """This node's environment (its paths) with the run's own variables."""
        # the run's SUPERVISOR_* variables, never ones the node was started with (a test's fault, a stale knob)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
        if "OMP_NUM_THREADS" not in overrides:
            env.pop("OMP_NUM_THREADS", None)  # Ray's default for an actor (1): not the run's choice
        # Ray hides the GPUs from this actor (it holds none); the warm parent never touches CUDA, and each worker
        # gets its seat's GPUs (start_worker)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(overrides)
        return env

    @_group("control")
    def ping(self) -> bool:
        return True

    @_group("start")
    def probe(self, source_files: dict[str, int], probe_path: str, nonce: str, reply_path: str) -> str:
        """'' when this node sees every source file at its size and the supervisor's probe file with its nonce,
        and can write `reply_path` (the supervisor reads it back); else what it cannot see."""
        root = os.environ.get(BLIND_ENV, "")

        def here(path: str) -> str:
            return os.path.join(root, path.lstrip(os.sep)) if root else path

        for path, size in sorted(source_files.items()):
            try:
                if os.path.getsize(here(path)) != size:
                    return f"sees the source file {path!r} with another size"
            except OSError:
                return f"cannot see the source file {path!r}"
        try:
            with open(here(probe_path)) as f:
                if f.read() != nonce:
                    return f"sees another file at {probe_path!r} (not the same folder as the supervisor's)"
        except OSError:
            return f"cannot see the output folder (no {probe_path!r})"
        try:
            with open(here(reply_path), "w") as f:
                f.write(nonce[::-1])
        except OSError as exc:
            return f"cannot write into the output folder ({exc.strerror})"
        return ""

    @_group("start")
    def check_tls(self) -> str:
        """'' when this node has Ray's TLS certificates for the run's port (the supervisor runs with TLS); else why
        not."""
        try:
            self._tls()
        except RuntimeError as exc:
            return str(exc)
        return ""

    @staticmethod
    def _tls():
        """This node's client context from Ray's TLS variables (the supervisor runs with TLS)."""
        try:
            contexts = channel.tls_contexts(os.environ)
        except ValueError as exc:
            raise RuntimeError(f"has unusable Ray TLS settings: {exc}") from None
        if contexts is None:
            raise RuntimeError("runs Ray without TLS (no RAY_USE_TLS) while the supervisor's host runs it with TLS")
        return contexts[1]

    @_group("control")
    def free_port(self) -> int:
        """A port on this node's Ray IP for a calibrated group's rendezvous, hosted by its rank 0 here: its socket is
        bound now and held until start_worker hands it to rank 0 (so no other process can take the port meanwhile,
        and the store listens on that address alone); one held for an earlier start of the group is closed."""
        import ray

        from shared.sockets import bound_socket

        s = bound_socket(ray.util.get_node_ip_address())
        port = s.getsockname()[1]
        earlier, self._listening = self._listening, {port: s}  # one swap: start_worker pops from either, never both
        for held in earlier.values():
            held.close()
        return port

    @_group("start")
    def start_worker(self, host: str, port: int, token: bytes, key: bytes, tls: bool, env: dict[str, str],
                     log_path: str, cwd: str, heartbeat_timeout: float, startup_timeout: float) -> int:
        deadline = time.monotonic() + startup_timeout
        zygote = self._warm_parent()
        conn = dial(host, port, token, key, self._tls() if tls else None, heartbeat_timeout, deadline)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        held = None
        try:
            with self._lock:
                if os.getcwd() != cwd and os.path.isdir(cwd):
                    os.chdir(cwd)  # relative paths mean what they mean to the supervisor (the fork takes this cwd)
                # a group's rank 0: the store socket free_port bound for its port (LISTEN_PORT_ENV), handed over
                held = self._listening.pop(int(env.get(LISTEN_PORT_ENV) or 0), None)
                child = zygote.fork([], {**self.env, **env}, (conn.fd, conn.fd), (log, log),
                                    held.fileno() if held is not None else None)
        except BaseException:
            conn.close(relay_too=True)
            raise
        finally:
            os.close(log)
            if held is not None:
                held.close()  # the worker holds its own copy
        conn.close()  # the worker holds its own copy; a TLS relay goes on for it
        self._children[child.pid] = child
        if conn.relay is not None:
            self._relays[child.pid] = conn.relay
        return child.pid

    def _warm_parent(self):
        from supervisor.workers.zygote import Zygote, ZygoteLost

        with self._lock:
            if self._zygote is None or not self._zygote.alive:
                if self._zygote is not None:
                    self._zygote.close()  # a dead or wedged one: its workers end with it
                z = Zygote(self.env, self.zygote_log, self.fmt, self.startup_timeout, keep_warm=0.0)
                try:
                    # its own deadline is startup_timeout (Zygote._wait_ready); this one only guards a stuck thread
                    self._spawner.submit(z.start, lambda: False).result(self.startup_timeout + ZYGOTE_MARGIN)
                except ZygoteLost as exc:
                    raise RuntimeError(f"the warm parent on this node failed: {exc.reason}: "
                                       f"{exc.log_tail[-2000:]}") from None
                except FutureTimeout:
                    raise RuntimeError(f"the warm parent on this node did not start within "
                                       f"{self.startup_timeout + ZYGOTE_MARGIN:.0f}s") from None
                self._zygote = z
            return self._zygote

    @_group("wait")
    def wait_worker(self, pid: int, timeout: float = 10.0) -> int | None:
        """The worker's exit code, or None if it has not exited within `timeout` s (ask again)."""
        child = self._children.get(pid)
        if child is None:
            return -9  # never started here (this host was replaced): nothing of it runs under this host
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        relay = self._relays.pop(pid, None)
        if relay is not None:
            relay.close()
        return code

    @_group("control")
    def signal_worker(self, pid: int, sig: int) -> None:
        child = self._children.get(pid)
        if child is not None and not self._cut_off(pid):
            child.send_signal(signal.Signals(sig))

    def _cut_off(self, pid: int) -> bool:
        """DEAF_ENV (tests only): whether `pid` is the worker a fault cut off from its supervisor."""
        marker = self.env.get(DEAF_ENV)
        if not marker:
            return False
        try:
            with open(marker) as f:
                return json.load(f).get("pid") == pid
        except (OSError, ValueError):
            return False

    @_group("control")
    def close(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.close()  # kills this node's workers of the run, then the warm parent exits
                self._zygote = None
        for relay in self._relays.values():
            relay.close()
        self._relays = {}


class Dialed:
    """A connection to the run's port with the handshake done: `fd` is what the worker reads and writes (the
    socket itself, or with TLS the plain end of the relay that carries its bytes through TLS)."""

    def __init__(self, sock: socket.socket, relay: channel.TlsRelay | None = None):
        self.sock, self.relay, self.fd = sock, relay, sock.fileno()

    def close(self, relay_too: bool = False) -> None:
        """Close our copy of the worker's end (`relay_too`: the relay as well: no worker was started)."""
        self.sock.close()
        if relay_too and self.relay is not None:
            self.relay.close()


def dial(host: str, port: int, token: bytes, key: bytes, tls, heartbeat_timeout: float, deadline: float) -> Dialed:
    """Connect to the run's port and do the handshake by `deadline` (channel.connect: retried after a broken
    attempt); the connection fails writes after `heartbeat_timeout` s without acknowledgement (_bound_silence).
    Raises RuntimeError with the reason."""
    try:
        sock = channel.connect(host, port, token, key, tls, deadline)
    except channel.HandshakeRefused as exc:
        raise RuntimeError(f"the run's port {host}:{port} refused the handshake: {exc}") from None
    except (channel.HandshakeBroken, OSError) as exc:
        raise RuntimeError(f"no handshake with the run's port {host}:{port} before the start deadline "
                           f"({type(exc).__name__}: {exc})") from None
    _bound_silence(sock, heartbeat_timeout)
    if tls is None:
        return Dialed(sock)
    ours, theirs = socket.socketpair()
    return Dialed(theirs, channel.TlsRelay(sock, ours, name=f"tls-relay-{port}"))


def _bound_silence(sock: socket.socket, seconds: float) -> None:
    """A connection whose peer stopped acknowledging (its host is gone, no FIN ever comes) fails the next write
    after `seconds`: the worker's heartbeat thread then exits it. Keepalive probes cover an idle connection."""
    ms = max(1000, int(seconds * 1000))
    for level, opt, value in ((socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), ms),
                              (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
                              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), max(1, int(seconds // 3))),
                              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), max(1, int(seconds // 6))),
                              (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), 3)):
        if opt is not None:
            try:
                sock.setsockopt(level, opt, value)
            except OSError:
                pass
