"""A worker's process as the supervisor holds it: one handle protocol for the three ways a worker is started,
and the one launch that gives a process its stdout/stderr pipes and their log pump.

    ProcessHandle (pid, returncode, poll, wait, send_signal, terminate, kill)
      subprocess.Popen      python -P -m child spawned here (workers.worker.spawn), and the warm parent itself
      Forked                forked by the warm parent (workers.zygote): its exit arrives on the zygote's socket
      RemoteProc            started by a node's host (cluster.remote): its exit asked of that host over Ray
    Handle: what Forked and RemoteProc share (wait raises subprocess.TimeoutExpired, terminate and kill are signals)

    pumped(start, log_path, on_log)   stdout, stderr pipes ─▶ start(out_w, err_w) ─▶ LogPump(out_r, err_r) running;
                                      the parent's copies of the write ends closed (EOF means the process is gone)

Owns these only; it never decides when a worker stops (workers.worker) or whether it is retried (run.scheduler).
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable, Protocol

from supervisor.workers.logpump import LogPump, OnLine


class ProcessHandle(Protocol):
    """The subset of subprocess.Popen that a Worker uses."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class Handle:
    """A ProcessHandle for a process this interpreter did not spawn: a subclass says how its exit is learnt
    (`_exited(timeout)`) and how a signal reaches it (`send_signal`)."""

    pid: int
    returncode: int | None = None
    where = ""  # the node it runs on, for messages ("" on this host)

    def _exited(self, timeout: float | None) -> bool:
        """Whether the exit is known (self.returncode set), waiting up to `timeout` s."""
        raise NotImplementedError

    def poll(self) -> int | None:
        if self.returncode is None:
            self._exited(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited(timeout):
            where = f" on {self.where}" if self.where else ""
            raise subprocess.TimeoutExpired(f"worker {self.pid}{where}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def pumped(start: Callable[[int, int], ProcessHandle], log_path: str,
           on_log: OnLine | None) -> tuple[ProcessHandle, LogPump]:
    """Start a process with `start(stdout_fd, stderr_fd)` on fresh pipes, and pump both into `log_path` (and
    on_log) from a running LogPump. The parent's copies of the write ends are closed whatever happens; the read
    ends too when the start fails."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = start(out_w, err_w)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    pump = LogPump({"stdout": out_r, "stderr": err_r}, log_path, proc.pid, on_log)
    pump.start()
    return proc, pump
