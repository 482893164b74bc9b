"""The worker's process facts: its heartbeat, its parent, its memory, the libraries it runs with.

    Beat (a thread) ── every HEARTBEAT_SECONDS ──▶ parent_alive(): exits (3) when the supervisor is gone
                                                 Heartbeat(index, stage, rss) on the pipe; exits (3) if it broke
    adopt(parent_pid)     python -m child: the pid the heartbeat and the exporter check before every write
    set_heartbeat(s)      the Hello's heartbeat period

The one copy of these globals: child/__main__.py runs as `__main__` under `python -m child`, so a module that read
them from `child.__main__` would get a second copy (`_parent_pid = 0`, the parent check silently off); every module
reads them here. Owns these facts only; it never reads the source, writes a shard or imports the supervisor.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading
import time

from child import faults
from shared.framing import Writer
from shared.messages import Heartbeat

HEARTBEAT_SECONDS = 1.0
PR_SET_PDEATHSIG = 1


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> None:
    # glibc keeps freed layer-sized blocks in its arenas (the prefetch thread has its own); handing them back
    # after each layer keeps a long-lived worker's RSS flat instead of creeping up with fragmentation.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so the peak after a layer is that layer's own peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # lifetime peak; Linux reports KiB


class Beat(threading.Thread):
    """Sends a Heartbeat every second with the current stage; exits the process if the parent is gone."""

    def __init__(self, writer: Writer, parent_pid: int):
        super().__init__(daemon=True, name="heartbeat")
        self.writer, self.parent_pid = writer, parent_pid
        self.index: int | None = None
        self.stage = "starting"

    def set(self, index: int | None, stage: str) -> None:
        self.index, self.stage = index, stage
        faults.rss_doing("main", stage)  # a bench's host-memory trace (off unless asked)

    def run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            parent_alive()  # exits if not
            if faults.hanging:
                continue
            try:
                self.writer.send(Heartbeat(index=self.index, stage=self.stage, rss=rss()))
            except OSError:
                os._exit(3)  # the supervisor's end of the pipe is gone


_parent_pid = 0


def parent_alive() -> None:
    """Exit at once if the supervisor that started us is gone (we must not write after it died)."""
    if _parent_pid and os.getppid() != _parent_pid:
        os._exit(3)


def set_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the heartbeat thread's parent check still applies



def adopt(parent_pid: int) -> None:
    """Check `parent_pid` from now on (0: no check): the supervisor, or the node host, that started this worker."""
    global _parent_pid
    _parent_pid = parent_pid


def set_heartbeat(seconds: float) -> None:
    """The Hello's heartbeat period, for the Beat thread."""
    global HEARTBEAT_SECONDS
    HEARTBEAT_SECONDS = seconds


def gpu_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of our GPU as this process sees it: the supervisor's memory check and the proof
    that a released live model really left the device."""
    if not device.startswith("cuda"):
        return 0, 0
    import torch
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def versions() -> dict[str, str]:
    from shared.versions import installed

    found = installed(("torch", "transformers", "llmcompressor", "compressed-tensors", "torchao", "safetensors"), None)
    return {pkg: v for pkg, v in found.items() if v is not None}
