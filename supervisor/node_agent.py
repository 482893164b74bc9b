"""What runs on a worker's node: a Seat per worker slot (it holds the slot's GPU, or CPU) and one NodeHost per node
(its warm parent, and the workers it forks).

    supervisor/cluster.py ──▶ Seat (Ray actor, num_gpus=1 or num_cpus=1, spread over the nodes)
                                info(): node id, address (and the interface holding it), host name, the GPUs
                                        Ray gave it, the node's cores and RAM
                           ──▶ NodeHost (Ray actor pinned to that node, no resources; one per node and run)
      probe(...)        can this node see the source and the output folder as the supervisor does?
      start_worker(…)   connect to the run's port (supervisor/remote.py) and send the preamble, then fork
                        `python -m child` from the node's warm parent (supervisor/zygote.py's Zygote, as on one host)
                        with that socket as the worker's read and write fds, its log file (shared file system) as
                        stdout/stderr and the seat's GPUs in CUDA_VISIBLE_DEVICES; returns the pid
      wait_worker(pid)  the exit code once the worker exits (the supervisor's RemoteProc waits on it)
      signal_worker     SIGTERM / SIGKILL, as Worker.stop asks

One warm parent per node, as on one host one per run: the libraries are imported once per node, and every worker
there is forked from it. The worker is the same `python -m child` with the same parent-death rules: it dies with
the warm parent, which dies with the NodeHost's spawner thread; the actors die with their node or with the
supervisor that owns them (Ray kills an owner's actors). A worker whose supervisor vanished without closing the
connection (its host lost) gets an error on its next heartbeat write within the heartbeat timeout
(TCP_USER_TIMEOUT) and exits. Owns the processes on its node only; it never reads frames (the connection is the
worker's) and never decides anything about the export.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from shared.messages import LISTEN_PORT_ENV

# Read by nothing on one host: a test can make one node of a local cluster see the shared file system under
# another root, as a node without the mount would (tests/cluster).
BLIND_ENV = "SUPERVISOR_TEST_NODE_BLIND"


class Seat:
    """A worker slot's place on the cluster: Ray gives it its GPU (or CPU); it reports where that is."""

    def info(self) -> dict:
        import psutil
        import ray

        ctx = ray.get_runtime_context()
        from supervisor.group import interface_holding

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

    def ping(self) -> bool:
        return True

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

    def free_port(self) -> int:
        """A port on this node's Ray IP for a calibrated group's rendezvous, hosted by its rank 0 here: its socket is
        bound now and held until start_worker hands it to rank 0 (so no other process can take the port meanwhile,
        and the store listens on that address alone); one held for an earlier start of the group is closed."""
        import ray

        from supervisor.group import bound_socket

        s = bound_socket(ray.util.get_node_ip_address())
        port = s.getsockname()[1]
        earlier, self._listening = self._listening, {port: s}  # one swap: start_worker pops from either, never both
        for held in earlier.values():
            held.close()
        return port

    def start_worker(self, host: str, port: int, preamble: bytes, env: dict[str, str], log_path: str, cwd: str,
                     heartbeat_timeout: float) -> int:
        from supervisor.zygote import Zygote, ZygoteLost

        with self._lock:
            if self._zygote is None or not self._zygote.alive:
                z = Zygote(self.env, self.zygote_log, self.fmt, self.startup_timeout, keep_warm=0.0)
                try:
                    self._spawner.submit(z.start, lambda: False).result()
                except ZygoteLost as exc:
                    raise RuntimeError(f"the warm parent on this node failed: {exc.reason}: "
                                       f"{exc.log_tail[-2000:]}") from None
                self._zygote = z
            sock = socket.create_connection((host, port), timeout=30)
            held = None
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                sock.sendall(preamble)
                sock.settimeout(None)
                _bound_silence(sock, heartbeat_timeout)
                if os.getcwd() != cwd and os.path.isdir(cwd):
                    os.chdir(cwd)  # relative paths mean what they mean to the supervisor (the fork takes this cwd)
                held = self._listening.pop(int(env.get(LISTEN_PORT_ENV) or 0), None)
                child = self._zygote.fork([], {**self.env, **env}, (sock.fileno(), sock.fileno()), (log, log),
                                          held.fileno() if held is not None else None)
            finally:
                sock.close()  # the worker holds its own copies
                os.close(log)
                if held is not None:
                    held.close()
            self._children[child.pid] = child
            return child.pid

    def wait_worker(self, pid: int) -> int:
        child = self._children.get(pid)
        if child is None:
            return -9
        code = child.wait()
        self._children.pop(pid, None)
        return code

    def signal_worker(self, pid: int, sig: int) -> None:
        child = self._children.get(pid)
        if child is not None:
            child.send_signal(signal.Signals(sig))

    def close(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.close()  # kills this node's workers of the run, then the warm parent exits
                self._zygote = None


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
