"""The warm pool: one pre-imported parent per run (child/zygote.py) that forks workers on request.

    Zygote.start()  python -P -m child.zygote (stdout/stderr pumped into OUT/.export/logs/zygote.log and on_log);
                    waits for {"ready"}
    Zygote.fork()   sends {"fork": {env, argv}} with the worker's pipe ends and stdout/stderr fds (SCM_RIGHTS) and
                    returns a Forked (Popen-like: pid, poll, wait, terminate, kill) once the zygote says
                    {"forked": pid}; {"exited": pid, code} arrive on a reader thread and settle that Forked
    Zygote.close()  closes the socket (the zygote exits, its workers with it) and waits for it

A fresh import of torch + transformers + llm-compressor costs 5-14 s; a fork costs milliseconds, so a worker
that dies is replaced at once. The zygote is spawned from the run's own thread, which lives until cleanup: a
parent-death signal fires when the thread that spawned a process ends. Owns that process and its socket only;
the worker protocol is supervisor.worker's.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from supervisor.logpump import LogPump, OnLine
from supervisor.worker import CancelledWait, describe_exit

MAX_MSG = 1 << 20


class ZygoteLost(Exception):
    """The zygote died or could not start; `log_tail` holds the end of its log."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


class Forked:
    """A worker forked by the zygote, with the subset of subprocess.Popen that supervisor.worker uses."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        self._settled = threading.Event()
        try:
            self._pidfd = os.pidfd_open(pid)  # signals through it cannot hit a recycled pid
        except (OSError, AttributeError):
            self._pidfd = None

    def _settle(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._settled.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._settled.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, OSError):
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, env: dict[str, str], log_path: str, fmt: str, startup_timeout: float,
                 pass_fds: tuple[int, ...] = (), on_log: OnLine | None = None):
        self.env, self.log_path, self.fmt, self.startup_timeout = env, log_path, fmt, startup_timeout
        self.pass_fds = pass_fds  # inherited by the zygote and so by every worker it forks (a live model's pool)
        self.on_log = on_log  # its import-time lines (library warnings) as LogLine events, like a worker's
        self._pump: LogPump | None = None
        self.proc: subprocess.Popen | None = None
        self.seconds = 0.0  # its import time, reported by itself
        self.forkable = True  # False: the imports touched CUDA, so workers must be spawned, not forked
        self._sock: socket.socket | None = None
        self._replies: queue.Queue = queue.Queue()
        self._children: dict[int, Forked] = {}
        self._early_exits: dict[int, int] = {}
        self._lock = threading.Lock()  # one fork request at a time
        self._state = threading.Lock()
        self._reader: threading.Thread | None = None
        self._lost: str | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._lost is None

    def start(self, cancelled: Callable[[], bool]) -> None:
        """Spawn the zygote and wait until it has imported everything; raises ZygoteLost."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        cmd = [sys.executable, "-P", "-m", "child.zygote", "--sock-fd", str(theirs.fileno()),
               "--parent-pid", str(os.getpid()), "--format", self.fmt]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                         pass_fds=(theirs.fileno(), *self.pass_fds), close_fds=True, env=self.env)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        self._pump = LogPump({"stdout": out_r, "stderr": err_r}, self.log_path, self.proc.pid, self.on_log)
        self._pump.start()
        self._sock = ours
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if cancelled():
                self.close()
                raise CancelledWait()
            try:
                msg = self._replies.get(timeout=0.2)
            except queue.Empty:
                if self._lost is not None:
                    raise ZygoteLost(f"the worker parent (zygote) {self._lost}", self.log_tail()) from None
                if time.monotonic() > deadline:
                    self.close()
                    raise ZygoteLost(f"the worker parent (zygote) did not finish importing within "
                                     f"{self.startup_timeout:.0f}s", self.log_tail()) from None
                continue
            if "ready" in msg:
                self.seconds = msg.get("seconds", 0.0)
                self.forkable = msg.get("forkable", True)
                return
            if "failed" in msg:
                self.close()
                raise ZygoteLost(f"the worker parent (zygote) failed to start: {msg['failed']}", self.log_tail())

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MSG)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "exited" in msg:
                with self._state:
                    child = self._children.pop(msg["exited"], None)
                    if child is None:
                        self._early_exits[msg["exited"]] = msg["code"]
                if child is not None:
                    child._settle(msg["code"])
            else:
                self._replies.put(msg)
        # The zygote is gone: its workers die with it (their parent-death signal), so settle them as killed.
        code = self.proc.wait() if self.proc is not None else -9
        self._lost = describe_exit(code)
        with self._state:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child._settle(-signal.SIGKILL)

    def fork(self, argv: list[str], env: dict[str, str], fds: tuple[int, int], out_fds: tuple[int, int]) -> Forked:
        """A new worker running `python -m child` with argv + its pipe fds, `out_fds` as its stdout and stderr;
        raises ZygoteLost."""
        with self._lock:
            if not self.alive:
                raise ZygoteLost(f"the worker parent (zygote) {self._lost or 'is not running'}", self.log_tail())
            req = json.dumps({"fork": {"env": env, "argv": argv}}).encode()
            try:
                socket.send_fds(self._sock, [req], [fds[0], fds[1], *out_fds])
            except OSError as exc:
                raise ZygoteLost(f"the worker parent (zygote) cannot be reached ({exc})", self.log_tail()) from exc
            while True:
                try:
                    msg = self._replies.get(timeout=0.5)
                    break
                except queue.Empty:
                    if not self.alive:
                        raise ZygoteLost(f"the worker parent (zygote) {self._lost or 'died'} while forking",
                                         self.log_tail()) from None
            child = Forked(msg["forked"], self)
            with self._state:
                code = self._early_exits.pop(child.pid, None)
                if code is None:
                    self._children[child.pid] = child
            if code is not None:
                child._settle(code)
            return child

    def close(self) -> None:
        """Stop the zygote (its workers go with it) and wait for it; idempotent."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self._pump is not None:
            self._pump.join(5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def log_tail(self, n: int = 4000) -> str:
        if self._pump is not None and self.proc is not None and self.proc.poll() is not None:
            self._pump.join(2)  # its last words may still be in the pipe
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

