"""The worker's bench-only hooks (child/faults.py): what bench/calib_bench.py reads must say what happened."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import mmap, sys, time
    from child import faults

    def wait_for(key, deadline=60.0):
        # the sampler runs every 2 ms; under load it may be late, never wrong
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            with faults._rss_trace.lock:
                if key in faults._rss_trace.samples:
                    return
            time.sleep(0.01)
        raise SystemExit(f"no sample under {key}")

    faults.rss_doing("main", "idle")
    wait_for((("main", "idle"),))
    faults.log_rss_trace(0)
    faults.rss_doing("main", "big")
    faults.rss_doing("ahead", "forward")
    held = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, len(held), 4096):
        held[i] = 1  # every page touched: anonymous memory in the RSS
    time.sleep(0.05)
    with faults._rss_trace.lock:
        faults._rss_trace.samples.clear()  # only samples taken with the pages held
    wait_for((("ahead", "forward"), ("main", "big")))
    faults.rss_doing("ahead", "")
    faults.log_rss_trace(1)
""")


def test_the_rss_trace_logs_each_part_s_peak_with_what_the_threads_did(tmp_path):
    trace = tmp_path / "rss.jsonl"
    env = {"SUPERVISOR_BENCH_RSS_TRACE": str(trace), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True, timeout=120, cwd=_root())
    parts = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [p["index"] for p in parts] == [0, 1]
    idle = parts[0]["peaks"][0]
    assert idle[4] == {"main": "idle"}
    total, anon, file, shmem, doing = parts[1]["peaks"][0]
    assert doing == {"main": "big", "ahead": "forward"}
    assert total == anon + file + shmem
    assert anon >= idle[1] + (200 << 20)  # the 256 MiB touched, in the anonymous part
    files = dict(parts[1]["files"])  # whose pages RssFile counts: the interpreter's own, at least
    assert files and all(path.startswith("/") and n > 0 for path, n in files.items())
    assert any("python" in os.path.basename(path) or ".so" in path for path in files)


def test_no_trace_is_kept_unless_asked(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from child import faults\nfaults.rss_doing('main', 'x')\n"
                          "faults.log_rss_trace(0)\nprint(faults._rss_trace is None)"],
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True, timeout=60,
                         cwd=_root())
    assert out.stdout.strip() == "True"


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
