"""Workers on other nodes: the run's TCP port, and a Worker whose process runs on another node.

    supervisor (this host)                                  node host (a Ray actor on the worker's node)
      Listener: one TCP port for the run, bound to the      RemoteWorker.start ─▶ host.start_worker(token, key, …)
      address the cluster reaches this host by                 connect to HOST:PORT, the handshake (channel.py):
        ◀──── TCP [TLS] ──── hello · token, then a challenge each way on the worker's key, the secret never sent ──▶
      one selector thread: every handshake in flight at     fork `python -m child` from the node's warm parent
      once, each within HANDSHAKE_SECONDS; at most          with that socket (or, with TLS, its relay's end) as
      MAX_HANDSHAKES (beyond: the least advanced, oldest    its read and write fds (stdout/stderr: the worker log
      one is closed); accept errors (EMFILE …) back off      on the shared file system)
        failed ─▶ closed, reported (on_refused, at most REFUSALS_SHOWN a window, then one count), the run goes on
        done ─▶ handed to the RemoteWorker waiting on token
      RemoteWorker: Hello ─▶ Ready, ExportLayer ─▶ LayerWritten … msgspec frames exactly as over a local pipe

No tensor crosses the connection: workers read the source and write shards on the shared file system. A worker
whose connection drops (its supervisor died) reads EOF and exits, as over a pipe. The process is watched through
Ray: `RemoteProc.poll()` asks the node host's `wait_worker` (one call at a time, each answered within
WAIT_SLICE: an exit code, "not yet", or an error when the actor or its node died), so a dead node is a dead
worker at once, without waiting for the heartbeat timeout, and no host thread waits a worker's whole life. Owns
the port, the handshakes there and the remote process handle; it never talks to Ray about placement
(supervisor/cluster/seats.py does) and never decides about retries (the scheduler does).
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import Future
from typing import Callable

from supervisor.cluster import channel
from supervisor.errors import one_line
from supervisor.workers.handle import Handle
from supervisor.workers.worker import CancelledWait, Worker, WorkerLost

TOKEN_BYTES = channel.TOKEN_BYTES
SECRET_BYTES = channel.SECRET_BYTES
MAX_HANDSHAKES = 100  # connections in handshake at once: what strangers can hold of the supervisor's files
ACCEPT_BATCH = 64  # connections accepted in one turn before the handshakes in flight get theirs
ACCEPT_BACKOFF = (0.05, 1.0)  # seconds the port is left alone after EMFILE, ENFILE, ENOBUFS...: first, most
REFUSALS_SHOWN = 5  # refusals reported one by one in a window; the others as one count at its end
REFUSAL_WINDOW = 10.0
WAIT_SLICE = 10.0  # seconds one wait_worker call may hold a host thread before it answers "not yet"
_LOG = logging.getLogger("supervisor")
# accept(2) passes pending network errors of that one connection on: the next one is fine
_CONNECTION_ERRNOS = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                      errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH}


class _Handshake:
    """One accepted connection in handshake: its steps (channel.serve), deadline and progress."""

    __slots__ = ("fd", "sock", "peer", "steps", "deadline", "want", "stage", "order")

    def __init__(self, sock: socket.socket, peer: str, steps, deadline: float, order: int):
        self.fd, self.sock, self.peer, self.steps, self.deadline = sock.fileno(), sock, peer, steps, deadline
        self.want, self.stage, self.order = 0, 0, order


class _Refusals:
    """Refusals reported at a bounded rate: the first REFUSALS_SHOWN of a window one by one, then one count of
    the others when the window ends (a flood must not become a flood of log lines and events)."""

    def __init__(self, report: Callable[[str, str], None]):
        self.report = report
        self.window_start, self.shown, self.held = -REFUSAL_WINDOW, 0, 0
        self.addresses: set[str] = set()
        self.last = ("", "")

    def add(self, peer: str, reason: str, now: float) -> None:
        if now - self.window_start >= REFUSAL_WINDOW and not self.held:
            self.window_start, self.shown = now, 0
        if self.shown < REFUSALS_SHOWN:
            self.shown += 1
            self._report(peer, reason)
        else:
            self.held += 1
            self.addresses.add(peer.rsplit(":", 1)[0])
            self.last = (peer, reason)

    def due(self) -> float | None:
        return self.window_start + REFUSAL_WINDOW if self.held else None

    def flush(self, now: float, final: bool = False) -> None:
        """Report the count held once its window ended; `final` (the port closes): whatever is held, at once."""
        if self.held and (final or now - self.window_start >= REFUSAL_WINDOW):
            (peer, reason), seconds = self.last, min(now - self.window_start, REFUSAL_WINDOW)
            self._report(f"{len(self.addresses)} address(es)",
                         f"{self.held} more connections refused within {seconds:.0f}s (counted, not shown one by "
                         f"one); the last, from {peer}: {reason}")
            self.window_start, self.shown, self.held, self.addresses = now, 0, 0, set()

    def _report(self, peer: str, reason: str) -> None:
        try:
            self.report(peer, reason)
        except Exception:  # noqa: BLE001 - a failing report must not stop the port
            _LOG.exception("reporting a refused connection failed")


class Listener:
    """The run's port: accepts connections, runs each one's handshake (supervisor/cluster/channel.py) on one selector
    thread, hands those that prove the run's secret to the worker that waits for their token.
    `on_refused(peer, reason)` is told of connections closed for failing it, at a bounded rate (_Refusals)."""

    def __init__(self, host: str, on_refused: Callable[[str, str], None], tls: ssl.SSLContext | None = None):
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.tls = tls  # the server context where Ray runs with TLS (channel.tls_contexts)
        self._refusals = _Refusals(on_refused)
        self._sock = socket.create_server((host, 0), backlog=128)
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._waiting: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._pending: dict[int, _Handshake] = {}  # fd -> handshake in flight
        self._accepted = 0
        self._paused_until: float | None = None
        self._backoff = ACCEPT_BACKOFF[0]
        self._warned_at = -3600.0
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._sock.fileno(), selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r.fileno(), selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="remote-listener", daemon=True)
        self._thread.start()

    def expect(self, token: bytes) -> Future:
        """A Future that receives the socket of the connection that proves `token`'s key."""
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

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # ---- the selector thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._sel.select(self._next_wake()):
                    if key.data == "accept":
                        self._accept_some()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif key.fd in self._pending:  # not closed by an accept in this same turn
                        self._advance(self._pending[key.fd])
                now = time.monotonic()
                for hs in [h for h in self._pending.values() if h.deadline <= now]:
                    self._refuse(hs, f"no complete handshake within {channel.HANDSHAKE_SECONDS:.0f}s")
                if self._paused_until is not None and now >= self._paused_until:
                    self._paused_until = None
                    self._sel.register(self._sock.fileno(), selectors.EVENT_READ, "accept")
                self._refusals.flush(now)
        except Exception:  # noqa: BLE001 - a bug here must be loud: no worker could connect any more
            _LOG.exception("the run's port stopped accepting connections")
            raise
        finally:
            for hs in list(self._pending.values()):
                self._drop(hs)
            self._refusals.flush(time.monotonic(), final=True)  # a count the window had not reported yet

    def _next_wake(self) -> float:
        now = time.monotonic()
        times = [h.deadline for h in self._pending.values()]
        times += [t for t in (self._paused_until, self._refusals.due()) if t is not None]
        return max(0.0, min([now + 1.0, *times]) - now)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self._sock.accept()  # cannot block: a non-blocking socket
            except BlockingIOError:
                return
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _CONNECTION_ERRNOS:
                    continue  # that connection failed before we got it
                self._pause(exc)  # EMFILE, ENFILE, ENOBUFS, ENOMEM: it stays in the backlog; try again soon
                return
            self._backoff = ACCEPT_BACKOFF[0]
            if len(self._pending) >= MAX_HANDSHAKES:
                self._refuse(self._least_advanced(), f"closed unfinished: {MAX_HANDSHAKES} handshakes in flight "
                                                     "(a flood of connections?)")
            self._accepted += 1
            conn.setblocking(False)
            peer = f"{addr[0]}:{addr[1]}"
            hs = _Handshake(conn, peer, channel.serve(conn, self.secret, self.tls),
                            time.monotonic() + channel.HANDSHAKE_SECONDS, self._accepted)
            self._pending[hs.fd] = hs
            self._advance(hs)

    def _pause(self, exc: OSError) -> None:
        """Out of files or buffers: leave the port alone a while (its connections wait in the backlog), and give
        back one stranger's file so that the next accept can succeed."""
        now = time.monotonic()
        if now - self._warned_at > 60:
            self._warned_at = now
            _LOG.warning("the run's port cannot accept (%s: %s); retrying every %.2g-%.2gs", type(exc).__name__,
                         exc.strerror, *ACCEPT_BACKOFF)
        if self._pending:
            self._refuse(self._least_advanced(), f"closed unfinished: this host is out of files ({exc.strerror})")
        self._paused_until = now + self._backoff
        self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF[1])
        self._sel.unregister(self._sock.fileno())

    def _least_advanced(self) -> _Handshake:
        # a worker's handshake moves at once; a stranger's idle connection never moves: it goes first
        return min(self._pending.values(), key=lambda h: (h.stage, h.order))

    def _advance(self, hs: _Handshake) -> None:
        try:
            want = hs.steps.send(None)
        except StopIteration as done:
            self._finish(hs, *done.value)
            return
        except (channel.HandshakeRefused, channel.HandshakeBroken) as exc:
            self._refuse(hs, str(exc))
            return
        except OSError as exc:
            self._refuse(hs, f"the connection failed ({type(exc).__name__}: {exc.strerror or exc})")
            return
        if hs.want:
            hs.stage += 1
        if want != hs.want:
            events = selectors.EVENT_READ if want == channel.READ else selectors.EVENT_WRITE
            if hs.want:
                self._sel.modify(hs.fd, events, hs)
            else:
                self._sel.register(hs.fd, events, hs)
            hs.want = want

    def _finish(self, hs: _Handshake, sock: socket.socket, token: bytes) -> None:
        self._forget_fd(hs)
        with self._lock:
            fut = self._waiting.get(token)
            taken = fut is not None and not fut.done()
            if taken:
                sock.setblocking(True)
                fut.set_result(sock)
        if not taken:
            _quiet_close(sock)
            self._refusals.add(hs.peer, "unknown worker token (a worker the run no longer waits for)",
                               time.monotonic())

    def _refuse(self, hs: _Handshake, reason: str) -> None:
        self._drop(hs)
        self._refusals.add(hs.peer, reason, time.monotonic())

    def _drop(self, hs: _Handshake) -> None:
        self._forget_fd(hs)
        hs.steps.close()
        _quiet_close(hs.sock)

    def _forget_fd(self, hs: _Handshake) -> None:
        if self._pending.pop(hs.fd, None) is not None and hs.want:
            try:
                self._sel.unregister(hs.fd)
            except (KeyError, ValueError):
                pass

    def close(self) -> None:
        """Stop accepting; close the handshakes in flight and the connections no worker took."""
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)  # it ends within one turn of its loop
        for s in (self._sock, self._wake_r, self._wake_w):
            _quiet_close(s)
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for fut in waiting:
            if fut.done() and fut.exception() is None:
                fut.result().close()


def _quiet_close(sock) -> None:
    try:
        sock.close()
    except OSError:
        pass


class RemoteProc(Handle):
    """A worker process on another node (a ProcessHandle, supervisor/workers/handle.py). Its exit is asked of the
    node host one `wait_worker` call at a time, each answered within WAIT_SLICE (the exit code, or None: not yet);
    an error there means the actor or its node died."""

    def __init__(self, host, pid: int, where: str):
        import ray

        self._ray = ray
        self.host, self.pid, self.where = host, pid, where
        self.returncode: int | None = None
        self.lost = ""  # why the process is taken for dead without an exit code (its node or actor died)
        self._ref = None
        self._ask()

    def _ask(self) -> None:
        self._ref = self.host.wait_worker.remote(self.pid, WAIT_SLICE)

    def _settle(self, timeout: float | None) -> bool:
        """Whether the exit is known, waiting up to `timeout` s (None: without a bound; nothing here asks that)."""
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([self._ref], timeout=left)
            if not ready:
                return False
            try:
                code = ray.get(self._ref)
            except Exception as exc:  # noqa: BLE001 - RayActorError, ActorDiedError, node death: Ray's own reports
                self.returncode = -9
                self.lost = f"its node's host died ({type(exc).__name__}: the node left the cluster, or was stopped)"
                return True
            if code is not None:
                self.returncode = code
                return True
            self._ask()  # not yet: ask again (each call holds a host thread for one slice at most)
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _exited(self, timeout: float | None) -> bool:
        return self.returncode is not None or self._settle(timeout)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                self.host.signal_worker.remote(self.pid, int(sig))  # not waited for: the exit says it landed
            except Exception:  # noqa: BLE001 - a dead host: the process is gone with it
                pass


class RemoteWorker(Worker):
    """A Worker whose child runs on another node: started by that node's host, its frames over the run's TCP
    connection (Listener), its log written by the host on the shared file system."""

    def __init__(self, *args, host, listener: Listener, where: str, cancelled: Callable[[], bool], **kwargs):
        """host: the NodeHost actor of the worker's node (supervisor/cluster/node_agent.py)."""
        super().__init__(*args, **kwargs)
        self.host, self.listener, self.where, self._cancelled = host, listener, where, cancelled
        self._relay: channel.TlsRelay | None = None

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
            # the host gets this worker's key, never the run's secret (channel.worker_key)
            ref = self.host.start_worker.remote(self.listener.host, self.listener.port, token,
                                                 channel.worker_key(self.listener.secret, token),
                                                 self.listener.tls is not None, self.env, self.log_path, os.getcwd(),
                                                 self.heartbeat_timeout, self.startup_timeout)
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
        if isinstance(sock, ssl.SSLSocket):  # frames are read and written on plain fds: relay them through TLS
            ours, theirs = socket.socketpair()
            self._relay = channel.TlsRelay(sock, ours, name=f"tls-relay-{pid}")
            sock = theirs
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

    def _taken_for_lost(self, waited: float) -> None:
        super()._taken_for_lost(waited)
        if self.proc is not None and not self.proc.lost:
            self.proc.lost = f"not confirmed dead within {waited:.0f}s (its node unreachable?)"
