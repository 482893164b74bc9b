"""The child's stdout and stderr: copied to its log file as they arrive, and handed on line by line.

    child stdout ─pipe─┐                    ┌─▶ OUT/.export/logs/worker-N.log   (every byte, in arrival order)
    child stderr ─pipe─┴─▶ LogPump thread ──┤
                           (select, read)   └─▶ on_line(stream, text, pid)     (whole lines, each capped)

The pump reads as fast as the child writes, so a child printing a flood never blocks on a full pipe (the export
does not slow down), and it holds at most one partial line per stream (memory does not grow with the flood);
what the caller does with a line must be as cheap (supervisor/api.py keeps the last lines in a bounded deque).
Owns the two pipe read ends and the log file handle; it never interprets a line (the worker reads tracebacks
back from the log file).
"""
from __future__ import annotations

import os
import selectors
import threading
from typing import Callable

READ = 64 * 1024
MAX_LINE = 4096  # characters of one line handed on; the log file keeps the whole line
EARLY_MAX = 1 << 20  # bytes of lines kept before the log file is named (LogPump.attach)

OnLine = Callable[[str, str, int], None]


class LogPump(threading.Thread):
    def __init__(self, fds: dict[str, int], log_path: str | None, pid: int, on_line: OnLine | None = None):
        """`log_path` None: the file is not known yet (a warm parent started before its run's output was checked,
        supervisor.workers.zygote.EarlyStart); the lines wait in memory (at most EARLY_MAX bytes, the oldest
        dropped) until attach() names it."""
        super().__init__(daemon=True, name=f"log-pump-{pid}")
        self._fds = dict(fds)  # stream name -> read end (owned: closed at EOF)
        self._log_path, self._pid, self._on_line = log_path, pid, on_line
        self._partial = {stream: b"" for stream in fds}
        self._lock = threading.Lock()  # the file and the callback against attach()
        self._early: list[tuple[str, bytes]] = []  # whole lines read before attach(), in arrival order
        self._early_bytes = 0
        self._log = None  # the open log file, opened at the first lines once the path is known

    def attach(self, log_path: str, on_line: OnLine | None) -> None:
        """Name the log file and the callback: the lines read so far are written and handed on now, in order."""
        with self._lock:
            self._log_path, self._on_line = log_path, on_line
            early, self._early, self._early_bytes = self._early, [], 0
            for stream, done in early:
                self._write(stream, done)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for stream, fd in self._fds.items():
            sel.register(fd, selectors.EVENT_READ, stream)
        try:
            while sel.get_map():
                for key, _ in sel.select():
                    data = os.read(key.fd, READ)
                    if not data:
                        sel.unregister(key.fd)
                        os.close(key.fd)
                    done = self._complete(key.data, data, final=not data)
                    if done:
                        # whole lines only, so stdout and stderr interleave line by line as with one fd
                        with self._lock:
                            if self._log_path is None:
                                self._keep_early(key.data, done)
                            else:
                                self._write(key.data, done)
        finally:
            for key in list(sel.get_map().values()):
                os.close(key.fd)
            sel.close()
            with self._lock:
                if self._log is not None:
                    self._log.close()
                    self._log = None

    def _write(self, stream: str, done: bytes) -> None:
        if self._log is None:
            self._log = open(self._log_path, "ab")
        self._log.write(done)
        self._log.flush()  # the worker reads the log back to find a dead child's traceback
        self._hand_on(stream, done)

    def _keep_early(self, stream: str, done: bytes) -> None:
        *whole, rest = done.split(b"\n")  # a line each, so the oldest lines go first when over EARLY_MAX
        for line in [w + b"\n" for w in whole] + ([rest] if rest else []):
            self._early.append((stream, line))
            self._early_bytes += len(line)
        while self._early_bytes > EARLY_MAX and len(self._early) > 1:
            self._early_bytes -= len(self._early.pop(0)[1])

    def _complete(self, stream: str, data: bytes, final: bool) -> bytes:
        """The complete lines of this stream's buffer (newlines included); the rest waits for its newline."""
        buf = self._partial[stream] + data
        cut = buf.rfind(b"\n") + 1
        done, rest = buf[:cut], buf[cut:]
        if final or len(rest) > MAX_LINE * 4:  # EOF, or a line without end: let its start through
            done, rest = done + rest, b""
        self._partial[stream] = rest
        return done

    def _hand_on(self, stream: str, done: bytes) -> None:
        if self._on_line is None:
            return
        for line in done.removesuffix(b"\n").split(b"\n"):
            text = line.decode(errors="replace").rstrip("\r")
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE] + " [...]"
            self._on_line(stream, text, self._pid)
