"""Test-only fault injection inside the child: die, hang or send garbage at a named point of a layer's life.

Off unless the environment variable SUPERVISOR_TEST_FAULT holds a JSON object, which only tests set; a job file
cannot reach it. The object::

    {"point": "quantize", "action": "sigkill", "index": 2, "once": "/tmp/marker"}

point:  start | read | quantize | write_tmp | after_rename | config | any
action: sigkill | sigsegv | exit | raise | memoryerror | hang | garbage | truncated | oversized | leak | enospc
index:  the layer it fires on (omit: every layer; -1 is the non-layer shard)
once:   a marker file; the fault fires only while the file does not exist, and creates it when firing
        (so a restarted child goes on normally). Omit to fire every time.
Owns nothing else; it must never be consulted by anything but the child's main loop and writer.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import time

ENV = "SUPERVISOR_TEST_FAULT"

_spec: dict | None = None
_leak: list = []


def load() -> None:
    global _spec
    raw = os.environ.get(ENV)
    _spec = json.loads(raw) if raw else None


def hit(point: str, index: int | None = None, writer=None) -> None:
    """Fire the configured fault if it matches this point and layer."""
    s = _spec
    if not s or s.get("point") not in (point, "any"):
        return
    if "index" in s and s["index"] != index:
        return
    once = s.get("once")
    if once:
        if os.path.exists(once):
            return
        with open(once, "w") as f:
            f.write(f"{point} {index} {os.getpid()}\n")
    _fire(s["action"], s, writer)


def _fire(action: str, s: dict, writer) -> None:
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigsegv":
        ctypes.string_at(0)  # a real segmentation fault, not a Python-level signal
    elif action == "exit":
        os._exit(s.get("code", 7))
    elif action == "raise":
        raise RuntimeError(f"injected fault ({s})")
    elif action == "memoryerror":
        raise MemoryError("injected MemoryError")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action == "hang":
        _hang()
    elif action in ("garbage", "truncated", "oversized") and writer is not None:
        from shared.framing import HEADER, MAX_FRAME
        payload = {"garbage": HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",  # 0xc1 is never valid msgpack
                   "truncated": HEADER.pack(1000) + b"\x00" * 10,
                   "oversized": HEADER.pack(MAX_FRAME + 1)}[action]
        writer.send_raw(payload)
        _hang()  # the supervisor must act on the bad frame, not on our death
    elif action == "leak":
        _leak.append(bytearray(s.get("bytes", 64 * 1024 * 1024)))  # touched memory: RSS grows
        for buf in _leak[-1:]:
            buf[::4096] = b"\x01" * len(buf[::4096])


def _hang() -> None:
    # Stops heartbeats too (the heartbeat thread checks this flag), as a deadlocked child would.
    global hanging
    hanging = True
    while True:
        time.sleep(3600)


hanging = False
