"""supervisor/workers/logpump.py and the LogLine events: a child's lines reach the log file and the caller, floods stay bounded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from shared.job import parse_job
from supervisor import Supervisor, api, events as ev
from supervisor.workers.logpump import MAX_LINE, LogPump

PRINTER = r"""
import sys
for i in range(50000):
    print(f"out {i}")
    print(f"err {i}", file=sys.stderr)
print("x" * 10000)
sys.stdout.write("no newline at the end")
"""


def test_lines_before_the_log_is_named_wait_and_come_first(tmp_path, monkeypatch):
    """A pump started without a log file (a warm parent launched before its run's output was checked) reads on, so
    its child never blocks; attach() writes and hands on what came before, in order, then the rest follows. Kept in
    memory meanwhile: at most EARLY_MAX bytes, the oldest lines dropped first."""
    from supervisor.workers import logpump

    monkeypatch.setattr(logpump, "EARLY_MAX", 60)
    r, w = os.pipe()
    lines = []
    pump = LogPump({"stdout": r}, None, 7, None)
    pump.start()
    for i in range(10):  # 10 lines of 10 bytes before attach: the first 5 do not fit in 60 bytes with the rest
        os.write(w, f"before {i:02d}\n".encode())
    deadline = time.monotonic() + 30
    while not (pump._early and pump._early[-1][1] == b"before 09\n") and time.monotonic() < deadline:
        time.sleep(0.01)  # until the pump has read all ten (it keeps reading while no file is named)
    log = tmp_path / "zygote.log"
    assert not log.exists()
    pump.attach(str(log), lambda stream, text, pid: lines.append((stream, text, pid)))
    os.write(w, b"after 0\n")
    os.close(w)
    pump.join(timeout=10)
    kept = [f"before {i:02d}" for i in range(4, 10)] + ["after 0"]
    assert log.read_text().splitlines() == kept
    assert lines == [("stdout", text, 7) for text in kept]


def test_pump_copies_every_byte_and_hands_on_whole_lines(tmp_path):
    """Every byte lands in the log; each stream's lines arrive whole and in order, a long line capped, the last
    unterminated line delivered at EOF."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", PRINTER], stdout=out_w, stderr=err_w)
    os.close(out_w)
    os.close(err_w)
    lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
    log = tmp_path / "worker.log"
    pump = LogPump({"stdout": out_r, "stderr": err_r}, str(log), proc.pid,
                   lambda stream, text, pid: lines[stream].append(text))
    pump.start()
    assert proc.wait(timeout=60) == 0
    pump.join(timeout=10)
    assert not pump.is_alive()
    assert lines["stderr"] == [f"err {i}" for i in range(50000)]
    assert lines["stdout"][:50000] == [f"out {i}" for i in range(50000)]
    assert lines["stdout"][50000] == "x" * MAX_LINE + " [...]"
    assert lines["stdout"][50001:] == ["no newline at the end"]
    text = log.read_text()
    assert text.count("\n") == 100001 and "x" * 10000 in text


def test_flood_from_the_child_is_logged_whole_and_streamed_bounded(tiny_models, tmp_path, monkeypatch):
    """A child printing 100,000 lines mid-export: the export finishes, the worker log has every line, the caller who
    reads events only at the end finds at most LOG_QUEUED_MAX of them queued (plus a note), and recent_logs() holds
    the last 2,000."""
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps({"point": "quantize", "action": "flood", "index": 0,
                                                            "lines": 100_000}))
    job = parse_job({"source": {"path": tiny_models("llama")},
                     "export": {"scheme": "W8A16", "output": str(tmp_path / "out")}, "resources": {"device": "cpu"}})
    with Supervisor(job) as run:
        run.wait()  # nobody reads events while the flood runs
        logs = [e for e in run.events() if isinstance(e, ev.LogLine)]
        recent = run.recent_logs()
    assert api.LOG_QUEUED_MAX <= len(logs) <= api.LOG_QUEUED_MAX + 2
    assert any("lines not streamed" in e.text for e in logs)
    assert len(recent) == api.LOG_KEEP
    flood = [e.text for e in recent if e.text.startswith("flood line ")]
    # the last lines of both streams (their relative order is the pipes', not the child's)
    assert {"flood line 99998", "flood line 99999"} <= set(flood)
    assert {e.stream for e in recent if e.text.startswith("flood line ")} == {"stdout", "stderr"}
    with open(tmp_path / "out" / ".export" / "logs" / "worker-0.log") as f:
        assert sum(line.startswith("flood line ") for line in f) == 100_000
