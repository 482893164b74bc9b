"""What a run tells its reader: the event queue, the children's log lines, the progress clock.

    Run, its helpers ── emit(event) ──▶ queue ──▶ next_event(timeout)   (Supervisor.events(); `t` stamped here)
    log pumps ── on_log(stream, text, pid) ──▶ the last LOG_KEEP lines (recent_logs())
                                           └─▶ LogLine events, at most LOG_QUEUED_MAX waiting unread: past that a
                                               flood is counted and said in one line, never queued without bound
    Progress: parts done, bytes, rate and ETA, measured from the first worker's readiness

Owns these only; it never decides anything about the run (supervisor.run.sequence does).
"""
from __future__ import annotations

import collections
import queue
import threading
import time

from supervisor import events as ev

LOG_KEEP = 2000  # child log lines kept for a UI that connects late (recent_logs())
LOG_QUEUED_MAX = 1000  # LogLine events waiting unread at most; past that a flood is counted, not queued


class EventFeed:
    def __init__(self):
        self.t0 = time.monotonic()
        self._events: queue.Queue = queue.Queue()
        self._logs: collections.deque = collections.deque(maxlen=LOG_KEEP)
        self._log_lock = threading.Lock()
        self._logs_queued = self._logs_dropped = 0

    def emit(self, e: ev.Event) -> None:
        e.t = round(time.monotonic() - self.t0, 3)
        self._events.put(e)

    def next_event(self, timeout: float) -> ev.Event:
        """The next event, or queue.Empty after `timeout` s; a LogLine taken off no longer counts as queued."""
        e = self._events.get(timeout=timeout)
        if isinstance(e, ev.LogLine):
            with self._log_lock:
                self._logs_queued -= 1
        return e

    def recent_logs(self) -> list[ev.LogLine]:
        return list(self._logs)

    def on_log(self, stream: str, text: str, pid: int) -> None:
        """Called by a log pump for every line: keep it, and stream it unless the reader is behind."""
        line = ev.LogLine(stream=stream, text=text, pid=pid, t=round(time.monotonic() - self.t0, 3))
        self._logs.append(line)
        with self._log_lock:
            if self._logs_queued >= LOG_QUEUED_MAX:
                self._logs_dropped += 1
                return
            dropped, self._logs_dropped = self._logs_dropped, 0
            self._logs_queued += 1 + bool(dropped)
        if dropped:
            self._emit_dropped(dropped, stream, pid)
        self.emit(line)

    def _emit_dropped(self, dropped: int, stream: str = "stderr", pid: int = 0) -> None:
        self.emit(ev.LogLine(stream=stream, pid=pid, text=f"[{dropped} lines not streamed while the reader was "
                             "behind; recent_logs() and the worker log have them]"))

    def flush_dropped_logs(self) -> None:
        """The reader learns of a flood it missed (before the run's last event)."""
        with self._log_lock:
            dropped, self._logs_dropped = self._logs_dropped, 0
            self._logs_queued += bool(dropped)
        if dropped:
            self._emit_dropped(dropped)


class Progress:
    def __init__(self, total: int, done: int, source_bytes: int):
        self.total, self.done = total, done
        self.source_total = source_bytes
        self.start = time.monotonic()
        self.done_at_start = done
        self.bytes_read = 0
        self.bytes_written = 0

    def first_worker_ready(self) -> None:
        """Rates measure exporting, not the first worker's imports."""
        if self.done == self.done_at_start:
            self.start = time.monotonic()

    def add(self, read: int, written: int) -> None:
        self.done += 1
        self.bytes_read += read
        self.bytes_written += written

    def event(self, worker_rss: int = 0, stage: str = "", index: int | None = None, ranks: int = 0) -> ev.Progress:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        finished_now = self.done - self.done_at_start
        eta = (elapsed / finished_now) * (self.total - self.done) if finished_now else None
        return ev.Progress(done=self.done, total=self.total, bytes_written=self.bytes_written,
                           mb_per_s=round(self.bytes_read / elapsed / 1e6, 2),
                           eta_s=None if eta is None else round(eta, 1), worker_rss=worker_rss, stage=stage,
                           index=index, ranks=ranks)
