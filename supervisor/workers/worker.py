"""One child worker process: start, dedicated pipes, handshake, requests with a heartbeat watch, stop.

    supervisor                         child (forked by the zygote, or spawned as python -m child; its own pipes)
      p2c_w ──frames──▶ p2c_r            stdout, stderr ─pipes─▶ LogPump ─▶ OUT/.export/logs/worker-N.log
      c2p_r ◀──frames── c2p_w                                             └─▶ on_log(stream, text, pid)

The parent closes its copies of the child's ends, so EOF means the child is gone. A child that dies, stays silent
past the heartbeat timeout, or sends a bad frame is one failure path: `WorkerLost`, with the reason and the tail
of its log (where Python and faulthandler print tracebacks). Stop is: Stop message, grace, SIGTERM, grace,
SIGKILL, then a wait of KILL_WAIT at most (a worker not gone by then is taken for lost). Owns the process and its
fds; it never decides about retries (the run loop does).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable

from shared.framing import EndOfStream, FrameError, Reader, Writer
from shared.messages import PROTOCOL_VERSION, Failed, Heartbeat, Hello, Ready, Stop, ToSupervisor
from supervisor.workers.handle import ProcessHandle, pumped
from supervisor.workers.logpump import LogPump, OnLine

POLL = 0.2  # seconds between checks of the process, the cancel flag and the heartbeat clock
KILL_WAIT = 10.0  # seconds stop() waits for the exit after SIGKILL; past it the worker is taken for lost
LOG_TAIL = 4000  # characters of the log's end reported when it holds no traceback
LOG_SCAN = 64 * 1024  # how far back the log is searched for the child's last traceback
LOG_TRACEBACK_MAX = 16000
# A Python traceback, or a faulthandler dump (segfault, abort). A dump lists every thread's stack and then all
# loaded extension modules (4 KB on a tiny CPU export, measured), so a fixed-size tail cuts off its first line.
_TRACEBACK_STARTS = ("Traceback (most recent call last)", "Fatal Python error")
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")


class WorkerLost(Exception):
    """The child died, hung or broke the protocol; `log_tail` holds the end of its log. `failed` is the child's own
    report when it failed to start (its `retry` says whether starting again could help)."""

    def __init__(self, reason: str, log_tail: str = "", failed: Failed | None = None):
        super().__init__(reason)
        self.reason = reason
        self.log_tail = log_tail
        self.failed = failed


class CancelledWait(Exception):
    """The caller's cancel flag was set while waiting for the child."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def spawn(env: dict[str, str] | None, fds: tuple[int, int], out_fds: tuple[int, int],
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """A fresh interpreter running the child (it imports everything itself) on pipes `fds` (its read and write
    ends), with stdout/stderr on `out_fds`. Its parent-death signal fires when the calling *thread* ends: call
    it from a thread that outlives the worker."""
    cmd = [sys.executable, "-P",  # -P: a 'child' folder in the cwd must not shadow our package
           "-m", "child", "--read-fd", str(fds[0]), "--write-fd", str(fds[1]), "--parent-pid", str(os.getpid())]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_fds[0], stderr=out_fds[1],
                            pass_fds=(*fds, *pass_fds), close_fds=True, env=env)


class Worker:
    """`fork(env, (read_fd, write_fd), (stdout_fd, stderr_fd))` starts the child from a warm parent (supervisor.workers.zygote); without
    it the child is spawned with a fresh interpreter (python -P -m child), which re-imports everything."""

    def __init__(self, hello: Hello, log_path: str, env: dict[str, str] | None = None, *,
                 startup_timeout: float, heartbeat_timeout: float, fork: Callable | None = None,
                 on_log: OnLine | None = None):
        self.hello = hello
        self.fork = fork
        self.on_log = on_log  # (stream, text, pid) per line the child prints; called from the pump thread
        self._pump: LogPump | None = None
        self.log_path = log_path
        self.env = env
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.proc: ProcessHandle | None = None
        self.ready: Ready | None = None
        self.rss = 0
        self.layers_done = 0
        self._reader: Reader | None = None
        self._writer: Writer | None = None
        self._fds: list[int] = []
        self._log_start = 0
        self._stop_sent = False

    where = ""  # the node a remote worker runs on (supervisor.cluster.remote); "" on this host

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, cancelled: Callable[[], bool], on_heartbeat: Callable[[Heartbeat], None],
              on_hello: Callable[[], None] = lambda: None) -> Ready:
        """Start the child and complete the handshake; raises WorkerLost or CancelledWait. `on_hello()` is called
        once the child exists and has its Hello, before waiting for its Ready (what it does then, a GPU worker's
        CUDA context among it, takes a few tenths of a second: others may start meanwhile)."""
        read_fd, write_fd = self._launch()
        self._writer, self._reader = Writer(write_fd), Reader(read_fd, ToSupervisor)
        self._send(self.hello)
        on_hello()
        reply = self.wait_reply(cancelled, on_heartbeat, deadline=time.monotonic() + self.startup_timeout,
                                too_late=f"did not become ready within {self.startup_timeout:.0f}s")
        if isinstance(reply, Failed):
            raise WorkerLost(f"worker failed to start: {reply.kind}: {reply.message}", reply.traceback, reply)
        if not isinstance(reply, Ready) or reply.version != PROTOCOL_VERSION:
            raise WorkerLost(f"worker sent {type(reply).__name__} instead of Ready (protocol {PROTOCOL_VERSION})",
                             self.log_tail())
        self.ready = reply
        return reply

    def _launch(self) -> tuple[int, int]:
        """Start the child process (self.proc) and return the fds to read its frames from and write frames to."""
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        start = self.fork or spawn
        try:
            with open(self.log_path, "ab") as log:
                self._log_start = os.fstat(log.fileno()).st_size  # earlier workers' output is not this child's
            # stdout/stderr go through the pump: into the log file, and to on_log as LogLine events
            self.proc, self._pump = pumped(lambda out_w, err_w: start(self.env, (p2c_r, c2p_w), (out_w, err_w)),
                                           self.log_path, self.on_log)
        finally:
            os.close(p2c_r)
            os.close(c2p_w)
        self._fds = [p2c_w, c2p_r]
        return c2p_r, p2c_w

    def _send(self, msg) -> None:
        try:
            self._writer.send(msg)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerLost(f"worker pipe closed ({exc.__class__.__name__}); {self._exit_text()}",
                             self.log_tail()) from exc

    def request(self, msg, cancelled: Callable[[], bool], on_heartbeat: Callable[[Heartbeat], None],
                timeout: float = 0.0):
        """Send one request and wait for its reply (anything but a Heartbeat); `timeout` > 0 bounds the wait even
        while heartbeats keep coming (a main thread stuck in a C call that released the GIL)."""
        self._send(msg)
        if timeout <= 0:
            return self.wait_reply(cancelled, on_heartbeat)
        return self.wait_reply(cancelled, on_heartbeat, deadline=time.monotonic() + timeout,
                               too_late=f"took longer than {timeout:g}s on one part (part_timeout)")

    def wait_reply(self, cancelled, on_heartbeat, deadline: float | None = None, too_late: str = ""):
        last = time.monotonic()
        while True:
            if cancelled():
                raise CancelledWait()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise WorkerLost(f"worker (pid {self.proc.pid}) {too_late}", self.log_tail())
            if self._reader.readable(POLL):
                msg = self._recv()
                last = time.monotonic()
                if isinstance(msg, Heartbeat):
                    self.rss = msg.rss or self.rss
                    on_heartbeat(msg)
                    continue
                return msg
            if self.proc.poll() is not None:
                # Drain anything it wrote before dying, then report the death.
                if self._reader.readable(0):
                    continue
                raise WorkerLost(f"worker (pid {self.proc.pid}) {self._exit_text()}", self.log_tail())
            if time.monotonic() - last > self.heartbeat_timeout:
                raise WorkerLost(f"worker (pid {self.proc.pid}) sent no heartbeat for {self.heartbeat_timeout:.0f}s "
                                 "(hung)", self.log_tail())

    def _recv(self):
        try:
            return self._reader.recv(timeout=self.heartbeat_timeout)
        except EndOfStream:
            self._reap(1.0)
            raise WorkerLost(f"worker (pid {self.proc.pid}) closed its pipe; {self._exit_text()}",
                             self.log_tail()) from None
        except FrameError as exc:
            raise WorkerLost(f"worker (pid {self.proc.pid}) sent a bad frame: {exc}", self.log_tail()) from exc
        except TimeoutError as exc:
            raise WorkerLost(f"worker (pid {self.proc.pid}) stalled inside a frame: {exc}", self.log_tail()) from exc

    def _reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _exit_text(self) -> str:
        code = self.proc.poll() if self.proc else None
        return describe_exit(code) if code is not None else "still running"

    def log_tail(self) -> str:
        """This child's log from its last traceback (with its chained causes) or fatal-error dump to the end;
        the log's last LOG_TAIL characters when it holds none."""
        self._drain_log(timeout=2.0)
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, f.tell() - LOG_SCAN))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        start = max(text.rfind(m) for m in _TRACEBACK_STARTS)
        if start < 0:
            return text[-LOG_TAIL:]
        while text[:start].rstrip().endswith(_CHAINED):
            earlier = text.rfind(_TRACEBACK_STARTS[0], 0, start)
            if earlier < 0:
                break
            start = earlier
        section = text[start:]
        if len(section) > LOG_TRACEBACK_MAX:
            half = LOG_TRACEBACK_MAX // 2
            section = section[:half] + "\n[...]\n" + section[-half:]
        return section

    def _drain_log(self, timeout: float) -> None:
        # A dead child's last words (its traceback) may still be in the pipe: let the pump reach EOF first.
        if self._pump is not None and self.proc is not None and self.proc.poll() is not None:
            self._pump.join(timeout)

    def ask_to_stop(self) -> None:
        """Send Stop without waiting, so that several workers wind down at once; stop() then waits."""
        if self.proc is not None and self.proc.poll() is None and not self._stop_sent:
            self._stop_sent = True
            try:
                self._writer.send(Stop())
            except OSError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        """Stop the child: Stop message, grace, SIGTERM, grace, SIGKILL, then wait KILL_WAIT at most (a worker
        not gone by then is taken for lost: logged, and its fds closed all the same)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.ask_to_stop()
            self._reap(grace)
        if self.proc.poll() is None:
            self.proc.terminate()
            self._reap(grace)
        if self.proc.poll() is None:
            self.proc.kill()
            self._reap(KILL_WAIT)
            if self.proc.poll() is None:
                self._taken_for_lost(KILL_WAIT)
        self._drain_log(timeout=5.0)  # a grandchild holding the pipes open must not hang the stop
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def _taken_for_lost(self, waited: float) -> None:
        """SIGKILL sent and no exit seen within `waited` s (a process stuck in the kernel, or a remote one whose
        node cannot be reached): say so and go on; its part is redone elsewhere (the caller requeues it)."""
        logging.getLogger("supervisor").warning(
            "worker (pid %s%s) not confirmed dead %.0fs after SIGKILL; taken for lost", self.proc.pid,
            f" on {self.where}" if self.where else "", waited)

    def kill(self) -> None:
        """Kill at once (hung or broken child), then the same cleanup as stop()."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.stop(grace=0)
