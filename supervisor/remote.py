"""Workers on other nodes: the run's TCP port and secret, and a Worker whose process runs on another node.

    supervisor (this host)                                  node host (a Ray actor on the worker's node)
      Listener: one TCP port for the run, bound to the      RemoteWorker.start ─▶ host.start_worker(token, …)
      address the cluster reaches this host by                 connect to HOST:PORT, send PREAMBLE:
        ◀──────── TCP ──────── MAGIC · secret (32 B) · token (16 B) ────────
      accept thread: reads the preamble only (fixed size,     fork `python -m child` from the node's warm parent
      a deadline), compares the secret in constant time:      with that socket as its read and write fds
        wrong or missing ─▶ closed before any frame is read,  (stdout/stderr: the worker log on the shared file
        logged (on_refused), the run goes on                  system)
        right ─▶ handed to the RemoteWorker waiting on token
      RemoteWorker: Hello ─▶ Ready, ExportLayer ─▶ LayerWritten … msgspec frames exactly as over a local pipe

No tensor crosses the connection: workers read the source and write shards on the shared file system. A worker
whose connection drops (its supervisor died) reads EOF and exits, as over a pipe. The process is watched through
Ray: `RemoteProc.poll()` is the node host's `wait_worker` reference (resolved when the worker exits, or with an error
when the actor or its node died), so a dead node is a dead worker at once, without waiting for the heartbeat
timeout. Owns the port, the secret check and the remote process handle; it never talks to Ray about placement
(supervisor/cluster.py does) and never decides about retries (the scheduler does).
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import subprocess
import threading
import time
from concurrent.futures import Future
from typing import Callable

from supervisor.cluster import one_line
from supervisor.worker import CancelledWait, Worker, WorkerLost

MAGIC = b"LWSUP01\n"
SECRET_BYTES = 32
TOKEN_BYTES = 16
PREAMBLE_BYTES = len(MAGIC) + SECRET_BYTES + TOKEN_BYTES
PREAMBLE_SECONDS = 10.0  # a connection that has not sent its preamble by then is closed


def preamble(secret: bytes, token: bytes) -> bytes:
    return MAGIC + secret + token


class Listener:
    """The run's port: accepts connections, checks each one's preamble, hands good ones to the worker that waits
    for its token. `on_refused(peer, reason)` is told of every connection closed for a wrong or missing secret."""

    def __init__(self, host: str, on_refused: Callable[[str, str], None]):
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.on_refused = on_refused
        self._sock = socket.create_server((host, 0), backlog=64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._waiting: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="remote-listener", daemon=True)
        self._thread.start()

    def expect(self, token: bytes) -> Future:
        """A Future that receives the socket of the connection that presents `token` (with the secret)."""
        fut: Future = Future()
        with self._lock:
            self._waiting[token] = fut
        return fut

    def forget(self, token: bytes, taken: bool) -> None:
        """Stop waiting for `token`; a connection that arrived and was not `taken` is closed."""
        with self._lock:
            fut = self._waiting.pop(token, None)
        if not taken and fut is not None and fut.done() and fut.exception() is None:
            fut.result().close()  # it arrived after its worker gave up on it

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            # each connection's preamble on a thread of its own: a silent one must not hold up the others
            threading.Thread(target=self._check, args=(conn, f"{peer[0]}:{peer[1]}"), daemon=True,
                             name="remote-preamble").start()

    def _check(self, conn: socket.socket, peer: str) -> None:
        reason = ""
        try:
            conn.settimeout(PREAMBLE_SECONDS)
            data = b""
            while len(data) < PREAMBLE_BYTES:
                chunk = conn.recv(PREAMBLE_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            data, reason = b"", f"no preamble ({exc.__class__.__name__})"
        magic, secret = data[:len(MAGIC)], data[len(MAGIC):len(MAGIC) + SECRET_BYTES]
        token = data[len(MAGIC) + SECRET_BYTES:]
        if len(data) < PREAMBLE_BYTES:
            reason = reason or f"closed after {len(data)} of the preamble's {PREAMBLE_BYTES} bytes"
        elif magic != MAGIC:
            reason = "not a worker's preamble"
        elif not hmac.compare_digest(secret, self.secret):
            reason = "wrong secret"
        if not reason:
            with self._lock:
                fut = self._waiting.get(token)
            if fut is None or fut.done():
                reason = "unknown worker token"
        if reason:
            conn.close()
            self.on_refused(peer, reason)
            return
        conn.settimeout(None)
        fut.set_result(conn)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for fut in waiting:
            if fut.done() and fut.exception() is None:
                fut.result().close()


class RemoteProc:
    """A worker process on another node, with the subset of subprocess.Popen that supervisor.worker uses; its
    exit is the node host's `wait_worker` reference (an error there: the actor or its node died)."""

    def __init__(self, host, pid: int, where: str):
        import ray

        self._ray = ray
        self.host, self.pid, self.where = host, pid, where
        self.returncode: int | None = None
        self.lost = ""  # why the process is taken for dead without an exit code (its node or actor died)
        self._ref = host.wait_worker.remote(pid)

    def _settle(self, timeout: float | None) -> bool:
        ray = self._ray
        ready, _ = ray.wait([self._ref], timeout=timeout)
        if not ready:
            return False
        try:
            self.returncode = ray.get(self._ref)
        except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, node death: Ray's own reports
            self.returncode = -9
            self.lost = f"its node's host died ({type(exc).__name__}: the node left the cluster, or was stopped)"
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._settle(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._settle(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid} on {self.where}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.host.signal_worker.remote(self.pid, int(sig))
            except Exception:  # noqa: BLE001 - a dead host: the process is gone with it
                pass

    def terminate(self) -> None:
        import signal
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal
        self.send_signal(signal.SIGKILL)


class RemoteWorker(Worker):
    """A Worker whose child runs on another node: started by that node's host, its frames over the run's TCP
    connection (Listener), its log written by the host on the shared file system."""

    def __init__(self, *args, host, listener: Listener, where: str, cancelled: Callable[[], bool], **kwargs):
        """host: the NodeHost actor of the worker's node (supervisor/node_agent.py)."""
        super().__init__(*args, **kwargs)
        self.host, self.listener, self.where, self._cancelled = host, listener, where, cancelled

    def _launch(self) -> tuple[int, int]:
        import ray

        token = secrets.token_bytes(TOKEN_BYTES)
        arrived = self.listener.expect(token)
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = os.fstat(log.fileno()).st_size
        deadline = time.monotonic() + self.startup_timeout
        sock = None
        try:
            ref = self.host.start_worker.remote(self.listener.host, self.listener.port,
                                                 preamble(self.listener.secret, token), self.env, self.log_path,
                                                 os.getcwd(), self.heartbeat_timeout)
            pid = self._wait_ref(ray, ref, deadline)
            self.proc = RemoteProc(self.host, pid, self.where)
            while True:
                try:
                    sock = arrived.result(timeout=0.2)
                    break
                except TimeoutError:
                    self._check_wait(deadline, "did not connect")
                    if self.proc.poll() is not None:
                        raise WorkerLost(f"worker on {self.where} exited before it connected "
                                         f"({self.proc.lost or self._exit_text()})", self.log_tail()) from None
        finally:
            self.listener.forget(token, taken=sock is not None)
        fd = sock.detach()
        self._fds = [fd]
        return fd, fd

    def _wait_ref(self, ray, ref, deadline: float):
        while True:
            ready, _ = ray.wait([ref], timeout=0.2)
            if ready:
                try:
                    return ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the host's error or its death, as Ray reports it
                    raise WorkerLost(f"the node host on {self.where} could not start a worker: "
                                     f"{one_line(exc)}", "") from None
            self._check_wait(deadline, "was not started")

    def _check_wait(self, deadline: float, what: str) -> None:
        if self._cancelled():
            raise CancelledWait()
        if time.monotonic() > deadline:
            raise WorkerLost(f"worker on {self.where} {what} within {self.startup_timeout:.0f}s", self.log_tail())

    def _exit_text(self) -> str:
        text = super()._exit_text()
        lost = getattr(self.proc, "lost", "")
        return f"{text}: {lost}" if lost else text

