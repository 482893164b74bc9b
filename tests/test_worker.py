"""supervisor/workers/worker.py: what a lost worker reports from its log (the child's last traceback, whole)."""
from __future__ import annotations

from shared.job import parse_job
from shared.messages import PROTOCOL_VERSION, Hello
from supervisor.workers.worker import LOG_TAIL, Worker

DUMP = ("Fatal Python error: Segmentation fault\n\n"
        + "".join(f"Thread 0x{i:016x} (most recent call first):\n  File \"t.py\", line {i} in run\n\n" for i in range(40))
        + "Current thread 0x1 (most recent call first):\n  File \"/x/child/faults.py\", line 72 in _fire\n\n"
        + "Extension modules: " + ", ".join(f"mod{i}" for i in range(300)) + " (total: 300)\n")


def _worker(tmp_path, *chunks: str) -> Worker:
    job = parse_job({"source": {"path": "s"}, "export": {"scheme": "W4A16", "output": "o"}})
    w = Worker(Hello(version=PROTOCOL_VERSION, job=job, output="o", device="cpu"), str(tmp_path / "w.log"),
               startup_timeout=1, heartbeat_timeout=1)
    with open(w.log_path, "w") as f:
        f.write(chunks[0])
    w._log_start = len(chunks[0]) if len(chunks) > 1 else 0  # what start() records: earlier workers' output
    with open(w.log_path, "a") as f:
        f.write("".join(chunks[1:]))
    return w


def test_fatal_error_dump_is_reported_from_its_first_line(tmp_path):
    """A faulthandler dump longer than the plain tail is reported whole, from 'Fatal Python error' on."""
    assert len(DUMP) > LOG_TAIL
    tail = _worker(tmp_path, "import warnings\n" * 50 + DUMP).log_tail()
    assert tail.startswith("Fatal Python error: Segmentation fault") and "child/faults.py" in tail
    assert tail.endswith("(total: 300)\n")


def test_chained_python_traceback_is_reported_with_its_cause(tmp_path):
    """'During handling of the above exception' keeps the first traceback of the chain in the report."""
    log = ("noise\nTraceback (most recent call last):\n  File a\nKeyError: 1\n\n"
           "During handling of the above exception, another exception occurred:\n\n"
           "Traceback (most recent call last):\n  File b\nValueError: 2\n")
    assert _worker(tmp_path, log).log_tail() == log[len("noise\n"):]


def test_an_earlier_workers_traceback_is_not_reported_as_this_childs(tmp_path):
    """Workers share one log file; a child killed without a traceback reports its own output, not an old one."""
    tail = _worker(tmp_path, "Traceback (most recent call last):\nRuntimeError: old\n", "importing...\n").log_tail()
    assert tail == "importing...\n"
