"""Library output: where the lines of torch, torchao, transformers and llm-compressor go, and how --debug shows them.

Only our own lines reach the terminal. Library code runs only in child processes whose stdout and stderr go to a
log file: the workers (supervisor/workers/worker.py, OUT/.export/logs/worker-N.log) and, for `supervisor demo`, the
model build and the load-back check (`run_logged`, below). `Echo` follows such logs and copies every new line to
the terminal for --debug. Nothing is filtered or silenced (no warning filter, no verbosity setting), so a real
error always lands whole in its log.

Owns the logged helper process and the echo; it never parses, reorders or drops a line.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

POLL = 0.2  # seconds between looks at the followed logs


def run_logged(module_args: list[str], log_path: str, *, env: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Run `python -P -m <module_args> --result-fd N` with stdout and stderr appended to log_path; returns its
    exit code and what it wrote to fd N (its result, kept apart from whatever the libraries print)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    read_end, write_end = os.pipe()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-P", "-m", *module_args, "--result-fd", str(write_end)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    pass_fds=(write_end,), env=env)
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end, "rb") as result:
            read_end = -1
            data = result.read()  # EOF when the helper exits (it holds the only write end)
        return proc.wait(), data  # bounded: its stdout reached EOF, the helper has exited
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


class Echo:
    """While open, copy each new line of every *.log file in `folders` to the terminal (stderr).

    Files that exist when it opens are followed from their current end (earlier runs' lines are not news);
    folders and files that appear later are picked up. Writes through whatever `sys.stderr` is at the time, so
    rich's live progress display keeps its bar below the echoed lines."""

    def __init__(self, folders: list[str], enabled: bool = True):
        self.folders, self.enabled = list(folders), enabled
        self._offsets: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Echo":
        if self.enabled:
            for path in self._logs():
                self._offsets[path] = os.path.getsize(path)
            self._thread = threading.Thread(target=self._follow, name="log-echo", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()  # bounded: the thread polls _stop
            self._drain(final=True)  # whatever was written after the last poll

    def _logs(self) -> list[str]:
        out = []
        for folder in self.folders:
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            out += [os.path.join(folder, n) for n in names if n.endswith(".log")]
        return out

    def _follow(self) -> None:
        while not self._stop.wait(POLL):
            self._drain()

    def _drain(self, final: bool = False) -> None:
        for path in self._logs():
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = len(data) if final else data.rfind(b"\n") + 1  # a partial line waits for its newline
            if end:
                self._offsets[path] = start + end
                sys.stderr.write(data[:end].decode(errors="replace"))
                sys.stderr.flush()
