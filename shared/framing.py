"""Length-prefixed msgpack frames over a pipe file descriptor.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. Rules: a frame larger than the cap
is refused on both sides (a garbage length must not make us allocate gigabytes); EOF before the first byte of a
frame is a clean end (`EndOfStream`); EOF inside a frame, a bad length or undecodable bytes is `FrameError`.
Owns bytes on a fd only: it never interprets messages and never imports anything heavy.
"""
from __future__ import annotations

import os
import select
import struct
import threading
import time
from typing import Any

import msgspec

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # messages are small; a traceback is the largest thing that travels


class FrameError(Exception):
    """The peer sent something that is not a valid frame (truncated, oversized, undecodable)."""


class EndOfStream(Exception):
    """The peer closed its end cleanly, between frames."""


class Writer:
    """Encodes and writes whole frames; safe to share between threads (a lock keeps frames whole)."""

    def __init__(self, fd: int, max_frame: int = MAX_FRAME):
        self.fd = fd
        self.max_frame = max_frame
        self._enc = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        if len(data) > self.max_frame:
            raise FrameError(f"refusing to send a {len(data)}-byte frame (cap {self.max_frame})")
        self.send_raw(HEADER.pack(len(data)) + data)

    def send_raw(self, buf: bytes) -> None:
        with self._lock:
            view = memoryview(buf)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]


class Reader:
    """Reads and decodes whole frames into one typed Union (a Decoder made once)."""

    def __init__(self, fd: int, type_: Any, max_frame: int = MAX_FRAME):
        self.fd = fd
        self.max_frame = max_frame
        self._dec = msgspec.msgpack.Decoder(type_)
        self._buf = bytearray()

    def readable(self, timeout: float | None) -> bool:
        """True if a frame may be read without blocking for long (data buffered or the fd is readable)."""
        if self._buf:
            return True
        r, _, _ = select.select([self.fd], [], [], timeout)
        return bool(r)

    def _fill(self, n: int, inside: bool, deadline: float | None) -> None:
        while len(self._buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                r, _, _ = select.select([self.fd], [], [], max(0.0, left))
                if not r:
                    raise TimeoutError(f"no complete frame within the deadline ({len(self._buf)} bytes buffered)")
            chunk = os.read(self.fd, max(65536, n - len(self._buf)))
            if not chunk:
                if inside or self._buf:
                    raise FrameError(f"stream ended inside a frame ({len(self._buf)} of {n} bytes)")
                raise EndOfStream()
            self._buf += chunk

    def recv(self, timeout: float | None = None) -> Any:
        """Read one whole frame and decode it; TimeoutError if it is not complete within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._fill(HEADER.size, inside=False, deadline=deadline)
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise FrameError(f"frame of {length} bytes exceeds the cap of {self.max_frame}")
        self._fill(HEADER.size + length, inside=True, deadline=deadline)
        payload = bytes(self._buf[HEADER.size:HEADER.size + length])
        del self._buf[:HEADER.size + length]
        try:
            return self._dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FrameError(f"undecodable frame: {exc}") from exc
