"""Test-only fault injection inside the child: die, hang or send garbage at a named point of a layer's life.

Off unless the environment variable SUPERVISOR_TEST_FAULT holds JSON, which only tests set; a job file cannot
reach it. The value is one fault object or a list of them::

    {"point": "quantize", "action": "sigkill", "index": 2, "once": "/tmp/marker"}
    [{"point": "read", "action": "hang", "index": 0, "once": "/tmp/m0"},
     {"point": "start", "action": "garbage", "once": "/tmp/m1", "after": "/tmp/m0"}]

point:  start | read | device | quantize | write_tmp | staged | boundary | config | plan | any | zygote
        (action "unforkable"); device fires inside a worker's turn on a GPU it shares (Hello.device_lock), lock held;
        plan fires as a worker starts describing the export (Describe); evaluate fires in a quality worker
        (`verify --quality`, child/backends/evaluate.py) once both models' layer `index` is loaded, before it runs
        calibrated methods also: forward | calibrate | propagate (stages inside quantize), and boundary fires
        after the next layer's inputs were committed (durable, or being made durable), before the supervisor hears
        of the layer; boundary_sync fires in the thread that makes a layer's inputs durable beside it (index: the
        layer they feed), written but not yet fsynced
action: sigkill | sigsegv | exit | raise | repeats | memoryerror | hang | stall | garbage | truncated | oversized |
        leak | enospc | flood | await | partitioned  (raise: a RuntimeError, retried; repeats: a ValueError, which
        the child reports as certain to repeat; await: wait until the file `path` exists, then go on; after
        `timeout` seconds (default 300) raise a RuntimeError instead; partitioned: as await, with heartbeats
        stopped from then on, as a worker cut off from its supervisor that later goes on with its part)
        (hang stops heartbeats too; stall keeps them going, as a main thread stuck in a GIL-free C call would)
index:  the layer it fires on (omit: every layer; -1 is the non-layer shard); start and config have no layer
worker: the worker slot it fires in (Hello.worker; omit: every worker; the export plan's own worker, on GPUs, is
        the slot after the last part's: resources.workers)
once:   a marker file; the fault fires only while the file does not exist, and creates it when firing (so a
        restarted child goes on normally). The marker holds JSON: point, index, action, pid, time (epoch
        seconds), so a test can measure how long the supervisor took to notice. Omit to fire every time.
after:  a marker file that must exist for the fault to be armed (chains faults: "the restart after that
        crash fails too")
bytes:  for leak, how much to keep alive per hit (default 64 MiB); code: for exit, the exit code (default 7)
lines:  for flood, how many lines to print, alternating stdout and stderr, numbered (default 100000)

At a point, the first armed fault in list order fires.

Also test-only: SUPERVISOR_TEST_TENSOR_LOG names a file to which the child appends, after each part, the CPU
tensor storages still alive in its heap (count and bytes, after gc and once the read-ahead of the next part has
landed): what the memory tests use to show that no tensor of a finished layer survives it.

And SUPERVISOR_TEST_STAGE_HOST=1 makes a CPU worker copy its outputs through its reusable host buffer
(child/staging.py) as a GPU worker does, so the CPU suite runs that buffer's life through real exports.

And SUPERVISOR_TEST_FUSED_ATTENTION=1 installs AWQ's fused eager attention (child/backends/eager_attention.py, on
GPUs only otherwise) on any device, so the CPU suite runs it through real exports against oneshot.

And SUPERVISOR_BENCH_SYNC_STAGES=1 (bench/calib_bench.py --sync-stages) makes the worker wait for its GPU at
every stage change, so each stage's seconds are its own kernels' rather than whatever the queue held when the
clock read (slower: the launch queue drains each time). SUPERVISOR_BENCH_STAGE_PEAKS names a file to which a GPU
worker appends, after each calibrated part, {index, peaks: [[stage, the part's peak GPU memory allocated so far, in
bytes], ...] as each stage ended, in order}: the stage in which a layer's peak is reached (bench/calib_bench.py
--stage-peaks). SUPERVISOR_BENCH_RSS_TRACE names a file to which a worker appends, after each part, where its host
memory peaked: a thread samples /proc/self/status every 2 ms (RssAnon, RssFile, RssShmem) beside what the worker's
threads were doing then (the main loop's stage, a layer started ahead's, the read-ahead's copy), and the part's
largest samples are logged as {index, peaks: [[total, anon, file, shmem, {thread: what}], ...], files: [[path,
resident bytes], ...] (the file mappings with the most pages in the RSS as the part ends)} (bench/calib_bench.py
--rss-trace). SUPERVISOR_BENCH_NO_AHEAD=1 starts no calibrated layer ahead (child/ahead.py), so one build's memory
and clock can be measured with and without it.

And SUPERVISOR_TEST_KERNELS, a comma-separated list, switches parts of the GPU path (`switched`): a name turns a part
on, "no" and the name off, e.g. "pack,norotary"; absent, each keeps its default. The parts: the one-kernel softmax's
packed halves (pack, off) and shared-memory rows (smem, on) (child/backends/warp_softmax.py), the rotary kernel
(rotary, on; child/backends/rotary.py), read at their import; AWQ's grid search without waits (search, on;
child/backends/awq_search.py), its passes sample by sample within it (samplewise, on: each sample's output let go
before the next pass, not held for the whole pass) and replayed from a CUDA graph (graph, on;
child/backends/graphed_pass.py), and its capture (capture, on; child/backends/awq_capture.py), read
at each layer by child/backends/calibrate.py. Tests and benches (bench/gpu_session.sh) compare a part with and without
it.

Owns nothing else; it must never be consulted by anything but the child's main loop, its writer, the boundary
thread (child/backends/calibrate.py hands the last its point) and a layer started ahead once it is taken over
(child/ahead.py: the points of its stages run ahead fire in the main loop then, in order; the rest in its thread,
which is the layer's from there on while the main loop waits for it). Fault points, that is: the bench's trace
labels (rss_doing) are set from any of the worker's threads, and only ever read by the trace's own.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import threading
import time

ENV = "SUPERVISOR_TEST_FAULT"
TENSOR_LOG = "SUPERVISOR_TEST_TENSOR_LOG"
STAGE_HOST = "SUPERVISOR_TEST_STAGE_HOST"
SYNC_STAGES = "SUPERVISOR_BENCH_SYNC_STAGES"
STAGE_PEAKS = "SUPERVISOR_BENCH_STAGE_PEAKS"
RSS_TRACE = "SUPERVISOR_BENCH_RSS_TRACE"
NO_AHEAD = "SUPERVISOR_BENCH_NO_AHEAD"
KERNELS = "SUPERVISOR_TEST_KERNELS"

_specs: list[dict] = []
worker: int | None = None  # this child's slot (Hello.worker), once it has its Hello
_leak: list = []
hanging = False  # set by a hang: the heartbeat thread stops beating, as in a deadlocked child


def load() -> None:
    global _specs
    raw = os.environ.get(ENV)
    spec = json.loads(raw) if raw else []
    _specs = spec if isinstance(spec, list) else [spec]


def _armed(s: dict, point: str, index: int | None) -> bool:
    if s.get("point") not in (point, "any"):
        return False
    if "index" in s and s["index"] != index:
        return False
    if "worker" in s and s["worker"] != worker:
        return False
    if s.get("after") and not os.path.exists(s["after"]):
        return False
    return not (s.get("once") and os.path.exists(s["once"]))


def asks(point: str, action: str) -> bool:
    """Whether an armed fault asks for `action` at `point` (for behaviours that are not a failure, like the warm
    parent's "unforkable": it reports its imports touched CUDA, so the supervisor spawns workers instead)."""
    return any(s.get("action") == action and _armed(s, point, None) for s in _specs)


def hit(point: str, index: int | None = None, writer=None) -> None:
    """Fire the first configured fault that matches this point and layer."""
    for s in _specs:
        if _armed(s, point, index):
            if s.get("once"):
                with open(s["once"], "w") as f:
                    json.dump({"point": point, "index": index, "action": s["action"], "pid": os.getpid(),
                               "time": time.time()}, f)
            _fire(s["action"], s, writer)
            return


def _fire(action: str, s: dict, writer) -> None:
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigsegv":
        ctypes.string_at(0)  # a real segmentation fault, not a Python-level signal
    elif action == "exit":
        os._exit(s.get("code", 7))
    elif action == "raise":
        raise RuntimeError(f"injected fault ({s['point']}, {s['action']})")
    elif action == "repeats":
        raise ValueError(f"injected deterministic fault ({s['point']}, {s['action']})")
    elif action == "memoryerror":
        raise MemoryError("injected MemoryError")
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action == "hang":
        _hang()
    elif action == "stall":
        while True:  # the main thread is stuck but the heartbeat thread goes on beating: only part_timeout helps
            time.sleep(3600)
    elif action in ("garbage", "truncated", "oversized") and writer is not None:
        from shared.framing import HEADER, MAX_FRAME
        payload = {"garbage": HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",  # 0xc1 is never valid msgpack
                   "truncated": HEADER.pack(1000) + b"\x00" * 10,
                   "oversized": HEADER.pack(MAX_FRAME + 1)}[action]
        _stop_beating()  # no heartbeat may follow the bad bytes: the supervisor must act on the frame itself
        writer.send_raw(payload)
        _hang()
    elif action in ("await", "partitioned"):  # an ordering made to happen: wait for another process's progress
        if action == "partitioned":
            _stop_beating()  # for good: the supervisor hears nothing more of this worker
        deadline = time.monotonic() + s.get("timeout", 300)
        while not os.path.exists(s["path"]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"injected await: {s['path']} did not appear")
            time.sleep(0.05)
    elif action == "flood":
        import sys
        for i in range(s.get("lines", 100_000)):
            print(f"flood line {i}", file=sys.stdout if i % 2 == 0 else sys.stderr)
        sys.stdout.flush()
    elif action == "leak":
        # bytes(n) is zero pages the kernel may share; writing into every page makes the RSS really grow
        buf = bytearray(s.get("bytes", 64 * 1024 * 1024))
        buf[::4096] = b"\x01" * len(buf[::4096])
        _leak.append(buf)


def _stop_beating() -> None:
    global hanging
    hanging = True


def _hang() -> None:
    _stop_beating()
    while True:
        time.sleep(3600)


def log_live_tensors(index: int, settle=None) -> None:
    """Append {index, tensors, bytes} of the live non-meta tensor storages to $SUPERVISOR_TEST_TENSOR_LOG (no-op when
    unset). Storages, not tensor objects: a tensor read by safetensors is a view of a byte buffer (two objects, one
    storage). `settle` waits for work in flight (the read-ahead) so the count does not depend on its timing."""
    path = os.environ.get(TENSOR_LOG)
    if not path:
        return
    import gc
    import warnings

    import torch

    if settle is not None:
        settle()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies warns
        warnings.simplefilter("ignore")
        storages = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not o.is_meta:
                storage = o.untyped_storage()
                storages[(o.device, storage.data_ptr())] = storage.nbytes()
    with open(path, "a") as f:
        f.write(json.dumps({"index": index, "tensors": len(storages), "bytes": sum(storages.values())}) + "\n")


def stage_host() -> bool:
    """SUPERVISOR_TEST_STAGE_HOST=1: host outputs go through the worker's staging buffer too (see the docstring)."""
    return os.environ.get(STAGE_HOST) == "1"


def sync_stages() -> bool:
    """SUPERVISOR_BENCH_SYNC_STAGES=1: the stage clock waits for the device (see the docstring)."""
    return os.environ.get(SYNC_STAGES) == "1"


def stage_peaks() -> str:
    """SUPERVISOR_BENCH_STAGE_PEAKS: the file a GPU worker logs each stage's peak memory to ("": off)."""
    return os.environ.get(STAGE_PEAKS, "")


def log_stage_peaks(index: int, peaks: list[tuple[str, int]]) -> None:
    """Append one part's {index, peaks} to $SUPERVISOR_BENCH_STAGE_PEAKS (see the docstring)."""
    with open(stage_peaks(), "a") as f:
        f.write(json.dumps({"index": index, "peaks": peaks}) + "\n")


def no_ahead() -> bool:
    """SUPERVISOR_BENCH_NO_AHEAD=1: no calibrated layer is started ahead (see the docstring)."""
    return os.environ.get(NO_AHEAD) == "1"


def switched(name: str, default: bool) -> bool:
    """SUPERVISOR_TEST_KERNELS: whether the GPU path's part `name` is on (see the docstring)."""
    names = os.environ.get(KERNELS, "").split(",")
    return True if name in names else False if f"no{name}" in names else default


class _RssTrace:
    """SUPERVISOR_BENCH_RSS_TRACE's sampler (see the docstring)."""

    FIELDS = ("RssAnon:", "RssFile:", "RssShmem:")

    def __init__(self, path: str):
        self.path = path
        self.doing: dict[str, str] = {}
        self.samples: dict[tuple, tuple[int, int, int, int]] = {}  # what the threads did -> the largest sample then
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="rss-trace", daemon=True).start()

    def _sample(self) -> tuple[int, int, int, int]:
        # /proc itself: psutil's memory_info has no split of the RSS into anonymous, file and shared memory
        kib = [0, 0, 0]
        with open("/proc/self/status") as f:
            for line in f:
                for i, field in enumerate(self.FIELDS):
                    if line.startswith(field):
                        kib[i] = int(line.split()[1])
        return (sum(kib) << 10, kib[0] << 10, kib[1] << 10, kib[2] << 10)

    def _run(self) -> None:
        while True:
            sample = self._sample()
            with self.lock:
                key = tuple(sorted(self.doing.items()))
                if sample[0] > self.samples.get(key, (0,))[0]:
                    self.samples[key] = sample
            time.sleep(0.002)

    @staticmethod
    def _files() -> list[tuple[str, int]]:
        """The file mappings with the most resident memory now (path, bytes): whose pages RssFile counts."""
        import psutil
        maps = psutil.Process().memory_maps(grouped=True)
        return sorted(((m.path, m.rss) for m in maps if m.path.startswith("/")), key=lambda kv: -kv[1])[:10]

    def log(self, index: int) -> None:
        with self.lock:
            samples, self.samples = self.samples, {}
        top = sorted(samples.items(), key=lambda kv: -kv[1][0])[:12]
        with open(self.path, "a") as f:
            f.write(json.dumps({"index": index, "peaks": [[*v, dict(k)] for k, v in top],
                                "files": self._files()}) + "\n")


_rss_trace: _RssTrace | None = None
_rss_trace_made = threading.Lock()  # the worker's threads may set their first labels at once: one sampler


def rss_doing(thread: str, what: str) -> None:
    """Bench (SUPERVISOR_BENCH_RSS_TRACE): what `thread` of the worker does from now on ("" for nothing)."""
    global _rss_trace
    path = os.environ.get(RSS_TRACE, "")
    if not path:
        return
    with _rss_trace_made:
        if _rss_trace is None:
            _rss_trace = _RssTrace(path)
    with _rss_trace.lock:
        if what:
            _rss_trace.doing[thread] = what
        else:
            _rss_trace.doing.pop(thread, None)


def log_rss_trace(index: int) -> None:
    """Bench: append the part's largest host-memory samples to $SUPERVISOR_BENCH_RSS_TRACE, start anew."""
    if _rss_trace is not None:
        _rss_trace.log(index)
