"""Child worker entry point: `python -m child --read-fd R --write-fd W --parent-pid P`.

Handshake (Hello → Ready), then a loop of `match` on messages from the supervisor; one long-lived process
exports many layers (importing torch + llm-compressor costs seconds, so a process per layer is too slow).
Talks only over the two dedicated pipe fds: stdout/stderr belong to the libraries (the supervisor pumps them into
the worker log and LogLine events).
It exits on Stop, on EOF from the supervisor, or when its parent dies (parent-death signal, plus a check of
the parent pid in the heartbeat thread), and it writes nothing after its parent is gone.
It must never import the supervisor package.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import gc
import os
import resource
import secrets
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

from child import faults
from shared import layout
from shared.arithmetic import device_model
from shared.framing import EndOfStream, FrameError, Reader, Writer
from shared.messages import (NON_LAYER, PROTOCOL_VERSION, CheckLoad, ConfigWritten, Describe, Described, EvaluateLayer,
                             ExportLayer, Failed, Heartbeat, Hello, LayerWritten, LoadChecked, LoadReport, Ready,
                             Settle, Settled, Stop, ToChild, WriteConfig)

HEARTBEAT_SECONDS = 1.0
# A layer read ahead onto the GPU sits there beside the one being quantized. Up to this size that is cheap and
# hides the read; a bigger layer (a large MoE's: GBs of experts) is read ahead on the host only, so the GPU holds
# about one layer at a time.
DEVICE_READ_AHEAD_MAX = 2 << 30
PR_SET_PDEATHSIG = 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    # glibc keeps freed layer-sized blocks in its arenas (the prefetch thread has its own); handing them back
    # after each layer keeps a long-lived worker's RSS flat instead of creeping up with fragmentation.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so the peak after a layer is that layer's own peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
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

    def run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            parent_alive()  # exits if not
            if faults.hanging:
                continue
            try:
                self.writer.send(Heartbeat(index=self.index, stage=self.stage, rss=_rss()))
            except OSError:
                os._exit(3)  # the supervisor's end of the pipe is gone


_parent_pid = 0


def parent_alive() -> None:
    """Exit at once if the supervisor that started us is gone (we must not write after it died)."""
    if _parent_pid and os.getppid() != _parent_pid:
        os._exit(3)


def _set_parent_death_signal() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the heartbeat thread's parent check still applies


class Exporter:
    """What one worker does with ExportLayer / WriteConfig: read, quantize, write."""

    def __init__(self, hello: Hello, beat: Beat):
        from child import quant_error
        from child.backend import make_backend  # heavy: torch, transformers, llm-compressor
        from child.source import open_source

        job = hello.job
        if job.resources.torch_threads:
            import torch
            torch.set_num_threads(job.resources.torch_threads)
        self.rank = hello.group.rank if hello.group is not None else 0
        if hello.group is not None:
            from child import group

            beat.set(None, "rendezvous")
            group.join(hello.group, job.resources.startup_timeout)
        self.output, self.device, self.beat = hello.output, hello.device, beat
        self.device_lock = hello.device_lock  # several workers take turns on this GPU: see _device_stage
        self._index: int | None = None
        self._writer: Writer | None = None
        measure = job.export.measure_error
        quant_error.enabled = hello.device.startswith("cuda") if measure is None else measure
        from child.staging import HostStaging

        self.source = open_source(job, hello.pool)
        # the output's way off the GPU, reused part after part
        self._staging = HostStaging(hello.device, stage_host=faults.stage_host())
        # a live model has no checkpoint folder: the supervisor wrote its config.json beside the pool
        self.config_dir = hello.pool.config_dir if hello.pool is not None else job.source.path
        self._trust_remote_code = job.source is not None and job.source.allow_remote_code
        self.backend = make_backend(job, self.config_dir, hello.device, output=hello.output, source=self.source,
                                    stage=self._stage, calibration_sha256=hello.calibration_sha256,
                                    to_host=self._staging.to_host)
        self.prefix = self.backend.layer_prefix
        self._clock: tuple[str, float] | None = None  # the calibrated stage in progress, since when
        self._substages: dict[str, float] = {}
        self._reached: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead: dict[int, Future] = {}

    def _names(self, index: int) -> list[str]:
        if index == NON_LAYER:
            return self.source.non_layer_names(self.prefix, self.backend.num_layers)
        return self.source.layer_names(self.prefix, index)

    def _read(self, index: int) -> tuple[dict, str]:
        fut = self._ahead.pop(index, None)
        return fut.result() if fut is not None else self._load(index)

    def _load(self, index: int, *, onto_device: bool = True) -> tuple[dict, str]:
        """Part `index`'s tensors, for a layer on a GPU already on the device (unless `onto_device` is False).
        safetensors hands out tensors that map the file, so the bytes are only read (page faults, then the copy to
        the GPU) when first touched: doing that in the prefetch thread overlaps it with the part before
        (measured on an H200: a 436 MB layer spent ~0.2 s of its 0.43 s "quantize" stage reading)."""
        names = self._names(index)
        tensors, digest = self.source.read(names), self.source.digest(names)  # the digest: of the source bytes
        return (self._onto_device(index, tensors) if onto_device else tensors), digest

    def _onto_device(self, index: int, tensors: dict) -> dict:
        if index != NON_LAYER and self.device.startswith("cuda") and self.backend.reads_to_device \
                and not self.device_lock and self.source.nbytes(tensors) <= DEVICE_READ_AHEAD_MAX:
            return {k: v.to(self.device) for k, v in tensors.items()}
        return tensors

    def _prefetch(self, index: int | None) -> None:
        """Start reading part `index` (the next one) in the background, beside this part's quantize stage; its copy
        to the GPU waits for _prefetch_onto_device. Keeps at most one part in flight."""
        for stale in [k for k in self._ahead if k != index]:
            self._ahead.pop(stale).cancel()
        if index is not None and index not in self._ahead:
            self._ahead[index] = self._pool.submit(self._load, index, onto_device=False)

    def _prefetch_onto_device(self, index: int | None) -> None:
        """Once this part's quantize stage is over: copy the part read ahead to the GPU, beside this part's write.
        Beside the quantize stage the copy held it up, on the default stream or on one of its own: measured on an
        H200 (2026-12-01, `bench/export_bench.py --per-layer`), an 8B-shaped layer's quantize stage took 0.07-0.11 s
        beside the copy and 0.016-0.025 s for the last layer, which has none to copy; after it, 0.012-0.035 s.
        (The prefetch thread runs one task at a time, in order: the read has finished when the copy starts.)"""
        read = self._ahead.get(index) if index is not None else None
        if read is None:
            return

        def copy() -> tuple[dict, str]:
            tensors, digest = read.result()
            return self._onto_device(index, tensors), digest

        self._ahead[index] = self._pool.submit(copy)

    @contextlib.contextmanager
    def _device_stage(self, index: int):
        """The part's time on the device. With Hello.device_lock (workers sharing a GPU whose layers are too big for
        two at once) it is taken in turns: wait for the lock's flock, quantize, and before letting go hand every
        cached block back to the driver, so the GPU holds one worker's layer at a time while the other worker reads
        or writes on the host. A worker that dies holding it releases it with its file descriptor. Yields a dict
        whose "wait" is the seconds spent waiting for the lock."""
        timing = {"wait": 0.0}
        if not self.device_lock:
            yield timing
            return
        import fcntl

        import torch

        self.beat.set(index, "wait-device")
        t = time.perf_counter()
        fd = os.open(self.device_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            timing["wait"] = time.perf_counter() - t
            self.beat.set(index, "quantize")
            faults.hit("device", index, self._writer)
            yield timing
            gc.collect()  # a reference cycle must not keep a layer's GPU memory past the turn
            if self.device.startswith("cuda"):
                torch.cuda.empty_cache()
        finally:
            os.close(fd)

    def _stage(self, name: str) -> None:
        """A stage inside the part in progress (calibrated: forward, calibrate, and inside it a group's reduce, solve
        and broadcast, then propagate, quantize): shown in heartbeats, timed (LayerWritten.ranks), and a fault point
        for tests ("quantize" fires once, after the part, as for every backend)."""
        if self._clock is not None:
            self._stage_end()
        self._clock = (name, time.perf_counter())
        self.beat.set(self._index, name)
        if name != "quantize" and name not in self._reached:  # a stage entered again (calibrate, after a reduce)
            self._reached.add(name)
            faults.hit(name, self._index, self._writer)

    def _take_substages(self) -> dict[str, dict[str, float]]:
        """The calibrated stages' seconds in the part just done, under this worker's rank ({} for data-free)."""
        if self._clock is not None:
            self._stage_end()
        out, self._substages = self._substages, {}
        return {str(self.rank): {k: round(v, 4) for k, v in out.items()}} if out else {}

    def _stage_end(self) -> None:
        last, since = self._clock
        self._substages[last] = self._substages.get(last, 0.0) + time.perf_counter() - since
        self._clock = None

    def export(self, msg: ExportLayer, writer: Writer) -> LayerWritten:
        from child import quant_error
        from child.writer import stage_shard

        index, t0 = msg.index, time.perf_counter()
        fence = msg.fence or secrets.token_hex(8)  # every file of this attempt is named by it (messages: Fencing)
        self._index, self._writer = index, writer
        quant_error.take()  # drop what a failed earlier part may have left
        quant_error.take_losses()
        _reset_peak_rss()
        gpu = self._gpu_reset()
        self._clock, self._substages, self._reached = None, {}, set()
        self.beat.set(index, "read")
        tensors, digest = self._read(index)
        self._prefetch(msg.prefetch)
        source_bytes = self.source.nbytes(tensors)
        faults.hit("read", index, writer)
        t_read = time.perf_counter()
        self.backend.begin(index, msg.boundary, fence)  # calibrated: this layer's inputs (from memory, a file, or computed)
        self.beat.set(index, "quantize")
        staged_before = self._staging.capacity
        t1 = time.perf_counter()
        with self._device_stage(index) as turn:
            if index == NON_LAYER:
                out = self.backend.quantize_non_layer(tensors)
            else:
                out = self.backend.quantize_layer(index, tensors)
            del tensors
            if out is not None:  # pass-through tensors may still be on the device
                out = {k: v.to("cpu") for k, v in out.items()}
        t2 = time.perf_counter()
        substages = self._take_substages()
        if out is None:  # a group's rank other than 0: calibrated with the others, rank 0 writes the shard
            return self._rank_done(index, fence, t0, {"read": t_read - t0, "inputs": t1 - t_read,
                                                      "quantize": t2 - t1}, source_bytes, gpu, digest, substages)
        self._prefetch_onto_device(msg.prefetch)
        error_seconds = quant_error.spent
        errors = quant_error.take()
        losses = quant_error.take_losses()
        faults.hit("quantize", index, writer)
        self.beat.set(index, "write")
        parent_alive()

        def checkpoint(stage: str) -> None:
            parent_alive()
            faults.hit(stage, index, writer)

        out, metadata = self.backend.serialize(out)
        stages = {"read": t_read - t0, "inputs": t1 - t_read, "wait": turn["wait"],
                  "quantize": t2 - t1 - turn["wait"] - error_seconds, "error": error_seconds}
        w = stage_shard(out, os.path.join(self.output, layout.staged_name(index, fence)), checkpoint,
                        metadata=metadata, timings=stages)
        del out
        if index == NON_LAYER and self._staging.capacity > staged_before:
            self._staging.release()  # grown for a one-off part (a quantized lm_head): keep no more than a layer's
        t3 = time.perf_counter()
        settled = self.backend.settle()  # calibrated: this layer's inputs, whose file was written beside it
        boundary = self.backend.commit(index)  # calibrated: the next layer's inputs, durable now or `pending`
        checkpoint("boundary")
        t4 = time.perf_counter()
        gc.collect()
        _malloc_trim()
        self.source.trim()
        stages["boundary"] = t4 - t3
        stages["cleanup"] = time.perf_counter() - t4
        faults.log_live_tensors(index, settle=lambda: [f.result() for f in self._ahead.values()])
        self.beat.set(None, "idle")
        return LayerWritten(index=index, file=layout.shard_name(index), fence=fence, digest=w.digest, nbytes=w.nbytes, ino=w.ino, mtime_ns=w.mtime_ns,
                            seconds=time.perf_counter() - t0, source_bytes=source_bytes,
                            peak_rss=_peak_rss(), rss=_rss(), peak_gpu=self._gpu_peak(gpu), quant_error=errors,
                            stages={k: round(v, 4) for k, v in stages.items()}, boundary=boundary,
                            pending=self.backend.pending, settled=settled,
                            source_digest=digest, rank=self.rank, losses=losses, ranks=substages)

    def _rank_done(self, index: int, fence: str, t0: float, stages: dict, source_bytes: int, gpu, digest: str,
                   substages: dict) -> LayerWritten:
        """A group rank's part of a layer: no shard, only the boundary of its own samples, made durable."""
        from child import quant_error

        faults.hit("quantize", index, self._writer)
        parent_alive()
        t = time.perf_counter()
        boundary = self.backend.commit(index)
        faults.hit("boundary", index, self._writer)
        stages["boundary"] = time.perf_counter() - t
        gc.collect()
        _malloc_trim()
        self.source.trim()
        self.beat.set(None, "idle")
        return LayerWritten(index=index, file="", fence=fence, digest="", nbytes=0, seconds=time.perf_counter() - t0,
                            source_bytes=source_bytes, peak_rss=_peak_rss(), rss=_rss(), peak_gpu=self._gpu_peak(gpu),
                            stages={k: round(v, 4) for k, v in stages.items()}, boundary=boundary,
                            source_digest=digest, rank=self.rank, losses=quant_error.take_losses(),
                            ranks=substages)

    def write_config(self, msg: WriteConfig, writer: Writer) -> ConfigWritten:
        self.beat.set(None, "config")
        faults.hit("config", None, writer)
        os.makedirs(msg.dest, exist_ok=True)
        path = self.backend.write_config(os.path.join(self.config_dir, "config.json"), msg.dest)
        self.beat.set(None, "idle")
        return ConfigWritten(path=path)

    def describe(self, msg: Describe, writer: Writer) -> Described:
        from child.preview import describe

        def on_part(index: int) -> None:
            self.beat.set(index, "plan")
            parent_alive()

        faults.hit("plan", None, writer)
        described = describe(self.source, self.backend, os.path.join(self.config_dir, "config.json"),
                             self._trust_remote_code, on_part)
        self.beat.set(None, "idle")
        return described

    def check_load(self, msg: CheckLoad, writer: Writer) -> LoadChecked:
        from child.loadcheck import check_folder

        self.beat.set(None, "check")
        if not self.backend.checks_loading:
            report = LoadReport(checked=False, reason="the loader check covers compressed-tensors outputs")
        else:
            report = check_folder(msg.folder, self._trust_remote_code, msg.known)
        self.beat.set(None, "idle")
        return LoadChecked(load=report)

    def _gpu_reset(self):
        if not self.device.startswith("cuda"):
            return None
        import torch
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch

    def _gpu_peak(self, torch) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) if torch is not None else 0


# Failures the same input and code would repeat: a tensor layout the model does not have, a group size that does not
# tile a weight, an architecture transformers cannot build. Memory, disk and I/O errors and RuntimeErrors (CUDA
# out-of-memory among them) depend on the moment, and crashes are not exceptions at all: those are retried.
_REPEATS = (ValueError, TypeError, KeyError, IndexError, AttributeError, NotImplementedError, ImportError)


def _failed(index: int | None, exc: BaseException) -> Failed:
    from child.errors import Refused

    return Failed(index=index, kind=type(exc).__name__, message=str(exc) or type(exc).__name__,
                  traceback="".join(traceback.format_exception(exc)),
                  errno=exc.errno if isinstance(exc, OSError) else None,
                  retry=not isinstance(exc, _REPEATS), refused=isinstance(exc, Refused))


def serve(reader: Reader, writer: Writer, parent_pid: int) -> int:
    try:
        hello = reader.recv()
    except EndOfStream:
        return 0
    if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
        got = getattr(hello, "version", type(hello).__name__)
        writer.send(Failed(kind="ProtocolError", message=f"expected Hello version {PROTOCOL_VERSION}, got {got}"))
        return 2
    global HEARTBEAT_SECONDS
    HEARTBEAT_SECONDS = hello.heartbeat_seconds
    faults.worker = hello.worker
    beat = Beat(writer, parent_pid)
    beat.start()
    try:
        faults.hit("start", None, writer)  # inside: an exception while starting is reported like a real one
        from child.backend import hide_unused
        from shared.job import warm_profile

        hide_unused(warm_profile(hello.job))  # a spawned worker imports its libraries now (a forked one has them)
        if hello.evaluate is not None:  # `verify --quality`: the source and the export side by side
            from child.evaluate import Evaluator

            exporter = Evaluator(hello, beat, beat.set)
        else:
            exporter = Exporter(hello, beat)
    except Exception as exc:  # noqa: BLE001 - every failure crosses the pipe as data
        writer.send(_failed(None, exc))
        return 1
    gc.freeze()  # what the worker built to start (skeleton, config) lives as long as it: keep it out of each
    # layer's gc.collect(), which then costs milliseconds instead of a third of a second (see child.zygote)
    free, total = _gpu_memory(hello.device)
    import torch  # imported with the backend already

    writer.send(Ready(version=PROTOCOL_VERSION, pid=os.getpid(), device=hello.device,
                      layer_prefix=exporter.prefix, num_layers=_num_layers(exporter),
                      versions=_versions(), gpu_free=free, gpu_total=total, threads=torch.get_num_threads(),
                      device_model=device_model(hello.device)))
    beat.set(None, "idle")
    while True:
        try:
            msg = reader.recv()
        except EndOfStream:
            return 0
        match msg:
            case ExportLayer():
                try:
                    reply = exporter.export(msg, writer)
                except Exception as exc:  # noqa: BLE001 - MemoryError included: report, then the supervisor decides
                    reply = _failed(msg.index, exc)
                writer.send(reply)
            case WriteConfig() | Describe() | CheckLoad():
                handle = {WriteConfig: exporter.write_config, Describe: exporter.describe,
                          CheckLoad: exporter.check_load}[type(msg)]
                try:
                    reply = handle(msg, writer)
                except Exception as exc:  # noqa: BLE001
                    reply = _failed(None, exc)
                writer.send(reply)
            case EvaluateLayer():
                try:
                    reply = exporter.evaluate(msg)
                except Exception as exc:  # noqa: BLE001
                    reply = _failed(msg.index, exc)
                beat.set(None, "idle")
                writer.send(reply)
            case Settle():
                try:
                    reply = Settled(boundary=exporter.backend.settle())
                except Exception as exc:  # noqa: BLE001
                    reply = _failed(None, exc)
                writer.send(reply)
            case Stop():
                if hello.group is not None:
                    from child import group

                    group.leave()
                return 0
            case _:
                writer.send(Failed(kind="ProtocolError", message=f"unexpected message {type(msg).__name__}"))
                return 2


def _num_layers(worker) -> int:
    backend = getattr(worker, "backend", None)
    return backend.num_layers if backend is not None else worker.num_layers


def _gpu_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of our GPU as this process sees it: the supervisor's memory check and the proof
    that a released live model really left the device."""
    if not device.startswith("cuda"):
        return 0, 0
    import torch
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "torchao", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    global _parent_pid
    ap = argparse.ArgumentParser(prog="python -m child")
    ap.add_argument("--read-fd", type=int, required=True)
    ap.add_argument("--write-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=0)
    args = ap.parse_args(argv)
    # Ctrl-C reaches the whole process group; the supervisor decides how we stop, not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _parent_pid = args.parent_pid
    faulthandler.enable()  # a segfault leaves a Python traceback in the worker log
    _set_parent_death_signal()
    parent_alive()
    faults.load()
    reader, writer = Reader(args.read_fd, ToChild), Writer(args.write_fd)
    try:
        return serve(reader, writer, args.parent_pid)
    except (FrameError, BrokenPipeError) as exc:
        print(f"child: pipe error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
