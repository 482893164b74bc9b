"""What one worker does: the handshake (Hello -> Ready), then a loop of `match` on the supervisor's messages.

    serve(reader, writer, parent_pid)   Hello ─▶ Exporter(hello, beat) ─▶ Ready
      ExportLayer ─▶ Exporter.export: read (the next part read ahead), backend.quantize_*, stage, LayerWritten
                     (a calibrated worker alone: the next layer started ahead beside the write, child/ahead.py;
                     any other message drops it)
      WriteConfig | Describe | CheckLoad ─▶ ConfigWritten | Described | LoadChecked
      Settle ─▶ Settled;  Stop ─▶ return
    any exception ─▶ Failed(kind, message, traceback) on the pipe (never pickled)

One long-lived process exports many layers (importing torch + llm-compressor costs seconds, so a process per layer
is too slow). Talks only over the two dedicated pipe fds: stdout/stderr belong to the libraries. It writes nothing
after its parent is gone (child/process.py). It must never import the supervisor package.
"""
from __future__ import annotations

import contextlib
import gc
import os
import secrets
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

from child import faults, process
from child.ahead import LayerAhead
from child.backends.backend import ReadAhead
from child.process import Beat
from shared import layout
from shared.arithmetic import device_model
from shared.framing import EndOfStream, Reader, Writer
from shared.messages import (NON_LAYER, PROTOCOL_VERSION, CheckLoad, ConfigWritten, Describe, Described, EvaluateLayer,
                             ExportLayer, Failed, Hello, LayerWritten, LoadChecked, LoadReport, Ready, Settle, Settled,
                             Stop, WriteConfig)

# A layer read ahead onto the GPU sits there beside the one being quantized. Up to this size that is cheap and
# hides the read; a bigger layer (a large MoE's: GBs of experts) is read ahead on the host only, so the GPU holds
# about one layer at a time.
DEVICE_READ_AHEAD_MAX = 2 << 30


class Exporter:
    """What one worker does with ExportLayer / WriteConfig: read, quantize, write."""

    def __init__(self, hello: Hello, beat: Beat):
        from child.backends import quant_error
        from child.backends.backend import make_backend  # heavy: torch, transformers, llm-compressor
        from child.sources import open_source

        job = hello.job
        if job.resources.torch_threads:
            import torch
            torch.set_num_threads(job.resources.torch_threads)
        self.rank = hello.group.rank if hello.group is not None else 0
        if hello.group is not None:
            from child.backends import group

            beat.set(None, "rendezvous")
            group.join(hello.group, job.resources.startup_timeout)
        self.output, self.device, self.beat = hello.output, hello.device, beat
        self.device_lock = hello.device_lock  # several workers take turns on this GPU: see _device_stage
        self._index: int | None = None
        self._writer: Writer | None = None
        measure = job.export.measure_error
        quant_error.enabled = hello.device.startswith("cuda") if measure is None else measure
        from child.staging import DeviceStaging, HostStaging

        self.source = open_source(job, hello.pool)
        # the output's way off the GPU, reused part after part
        self._staging = HostStaging(hello.device, stage_host=faults.stage_host())
        self._sync_stages = faults.sync_stages() and self.device.startswith("cuda")  # a bench's stage clock
        self._stage_peaks = [] if faults.stage_peaks() and self.device.startswith("cuda") else None  # a bench's
        # a live model has no checkpoint folder: the supervisor wrote its config.json beside the pool
        self.config_dir = hello.pool.config_dir if hello.pool is not None else job.source.path
        self._trust_remote_code = job.source is not None and job.source.allow_remote_code
        self.backend = make_backend(job, self.config_dir, hello.device, output=hello.output, source=self.source,
                                    stage=self._stage, calibration_sha256=hello.calibration_sha256,
                                    to_host=self._staging.to_host,
                                    sources_released=lambda: self._prefetch_onto_device(self._following))
        # the way onto the GPU for the parts read ahead (_onto_device): a calibrated worker's copy runs beside its own
        # queued kernels (the layer started ahead waits for it), through pinned chunks on a stream of its own; a
        # data-free worker's runs beside its write with nothing queued: the driver's copy (None). Through the chunks,
        # three FP8_DYNAMIC workers sharing an H100 waited 0.57 s a layer for it against 0.000 (docs/benchmarks.md,
        # thirty-third session; cause not traced)
        calibrated = getattr(self.backend, "inputs_ahead", None) is not None
        self._onto = DeviceStaging(hello.device) if hello.device.startswith("cuda") and calibrated else None
        self.prefix = self.backend.layer_prefix
        self._clock: tuple[str, float] | None = None  # the calibrated stage in progress, since when
        self._substages: dict[str, float] = {}
        self._reached: set[str] = set()
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead: dict[int, Future] = {}
        self._copying: int | None = None  # the part whose copy onto the device _prefetch_onto_device started
        self._following: int | None = None  # the part the supervisor asks for next (ExportLayer.prefetch)
        self._layer_ahead: LayerAhead | None = None  # the next calibrated layer, started beside this one's write

    def _names(self, index: int) -> list[str]:
        if index == NON_LAYER:
            return self.source.non_layer_names(self.prefix, self.backend.num_layers)
        return self.source.layer_names(self.prefix, index)

    def _read(self, index: int) -> tuple[dict, str]:
        # a part not read ahead stays on the host here: the backend copies it to the device as it builds the layer,
        # and copying it here first would only fault its pages in earlier (a calibrated layer 0's before its
        # embedding stage, whose peak host memory then held them too: 6.46 against 5.98 GiB measured on an 8B shape)
        fut = self._ahead.pop(index, None)
        return fut.result() if fut is not None else self._load(index)

    def _load(self, index: int) -> tuple[dict, str]:
        """Part `index`'s tensors on the host. safetensors hands out tensors that map the file, so the bytes are only
        read (page faults, then the copy to the GPU) when first touched: doing that in the prefetch thread
        (_prefetch_onto_device) overlaps it with the part before (measured on an H200: a 436 MB layer spent ~0.2 s
        of its 0.43 s "quantize" stage reading)."""
        names = self._names(index)
        return self.source.read(names), self.source.digest(names)  # the digest: of the source bytes

    def _onto_device(self, index: int, tensors: dict) -> dict:
        if index != NON_LAYER and self.device.startswith("cuda") and self.backend.reads_to_device \
                and not self.device_lock and self.source.nbytes(tensors) <= DEVICE_READ_AHEAD_MAX:
            on = self._onto.to_device(tensors) if self._onto is not None else \
                {k: v.to(self.device) for k, v in tensors.items()}
            return ReadAhead(on, host=tensors)
        return tensors

    def _prefetch(self, index: int | None) -> None:
        """Start reading part `index` (the next one) in the background, beside this part's quantize stage; its copy
        to the GPU waits for _prefetch_onto_device. Keeps at most one part in flight."""
        for stale in [k for k in self._ahead if k != index]:
            self._ahead.pop(stale).cancel()
        if index is not None and index not in self._ahead:
            self._ahead[index] = self._prefetcher.submit(self._load, index)
            self._copying = None if self._copying == index else self._copying  # read again: copied again

    def _prefetch_onto_device(self, index: int | None) -> None:
        """Once this part's quantize stage is over: copy the part read ahead to the GPU, beside this part's write.
        Beside the quantize stage the copy held it up, on the default stream or on one of its own: measured on an
        H200 (2026-12-01, `bench/export_bench.py --per-layer`), an 8B-shaped layer's quantize stage took 0.07-0.11 s
        beside the copy and 0.016-0.025 s for the last layer, which has none to copy; after it, 0.012-0.035 s.
        (The prefetch thread runs one task at a time, in order: the read has finished when the copy starts.)
        A calibrated layer read ahead has its next one copied earlier, once it holds neither its Hessians nor its
        source tensors (make_backend's sources_released: after the solve, and after its errors are measured), beside
        its last stages, through pinned memory on a stream of its own (DeviceStaging): ready when the next layer
        starts, right after this one's quantize stage (child/ahead.py)."""
        read = self._ahead.get(index) if index is not None else None
        if read is None or self._copying == index:
            return
        self._copying = index

        def copy() -> tuple[dict, str]:
            tensors, digest = read.result()
            faults.rss_doing("read-ahead", f"copy {index}")
            try:
                return self._onto_device(index, tensors), digest
            finally:
                faults.rss_doing("read-ahead", "")

        self._ahead[index] = self._prefetcher.submit(copy)

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
        for tests ("quantize" fires once, after the part, as for every backend). A layer started ahead clocks its
        first stages itself, until the worker takes it over (child/ahead.py)."""
        # on a layer's own thread, whether the worker still holds it: dropped, it must stop at its gate, never go on
        # as the worker's part in progress
        ahead = LayerAhead.here()
        if ahead is not None and ahead.stage(name, self._reading):
            faults.rss_doing("ahead", name)
            return
        if self._clock is not None:
            if self._sync_stages:
                import torch
                torch.cuda.synchronize(self.device)
            self._stage_end()
        self._clock = (name, time.perf_counter())
        self.beat.set(self._index, name)
        if name != "quantize" and name not in self._reached:  # a stage entered again (calibrate, after a reduce)
            self._reached.add(name)
            faults.hit(name, self._index, self._writer)

    def _reading(self) -> int | None:
        """A stage ends (of a layer started ahead): its kernels waited for (a bench's stage clock); the peak GPU
        memory so far (a bench's), or None."""
        if self._sync_stages:
            import torch
            torch.cuda.synchronize(self.device)
        if self._stage_peaks is None:
            return None
        import torch
        return torch.cuda.max_memory_allocated(self.device)

    def _take_substages(self) -> dict[str, dict[str, float]]:
        """The calibrated stages' seconds in the part just done, under this worker's rank ({} for data-free)."""
        if self._clock is not None:
            self._stage_end()
        out, self._substages = self._substages, {}
        if self._stage_peaks:
            faults.log_stage_peaks(self._index, self._stage_peaks)
            self._stage_peaks = []
        return {str(self.rank): {k: round(v, 4) for k, v in out.items()}} if out else {}

    def _stage_end(self) -> None:
        last, since = self._clock
        self._substages[last] = self._substages.get(last, 0.0) + time.perf_counter() - since
        if self._stage_peaks is not None:
            import torch

            self._stage_peaks.append((last, torch.cuda.max_memory_allocated(self.device)))
        self._clock = None

    def export(self, msg: ExportLayer, writer: Writer) -> LayerWritten:
        ahead = self._layer_ahead
        if ahead is not None and ahead.index != msg.index:
            self.drop_ahead()  # started for another request (after a failure the supervisor retries the failed part)
            ahead = None
        try:
            return self._export(msg, writer, ahead)
        except BaseException:
            self.drop_ahead()  # this part's (it failed before it was taken over), or the next one's, started beside
            raise

    def _export(self, msg: ExportLayer, writer: Writer, ahead: LayerAhead | None) -> LayerWritten:
        from child.backends import quant_error
        from child.writer import stage_shard

        index, t0 = msg.index, time.perf_counter()
        fence = msg.fence or secrets.token_hex(8)  # every file of this attempt is named by it (messages: Fencing)
        self._index, self._writer, self._following = index, writer, msg.prefetch
        quant_error.take()  # drop what a failed earlier part may have left
        quant_error.take_losses()
        process.reset_peak_rss()
        # a layer started ahead: its peak GPU memory counts from its start (_start_ahead)
        gpu = self._gpu_reset() if ahead is None else self._gpu()
        self._clock, self._substages, self._reached = None, {}, set()
        self.beat.set(index, "read")
        facts = ahead.read_facts() if ahead is not None else None
        if ahead is not None and facts is None:  # its read failed: read here, as without it
            self.drop_ahead()
            ahead = None
        if ahead is None:
            tensors, digest = self._read(index)
            source_bytes = self.source.nbytes(tensors)
        else:
            tensors, (digest, source_bytes) = None, facts
        self._prefetch(msg.prefetch)
        faults.hit("read", index, writer)
        t_read = time.perf_counter()
        self.backend.begin(index, msg.boundary, fence)  # calibrated: this layer's inputs (from memory, a file, or computed)
        self.beat.set(index, "quantize")
        staged_before = self._staging.capacity
        t1 = time.perf_counter()
        ahead_s = 0.0  # how long before its request the layer was started (child/ahead.py)
        with self._device_stage(index) as turn:
            if ahead is not None:
                out, ahead_s = self._take_ahead(ahead, index, t0)
            elif index == NON_LAYER:
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
        peak_gpu = self._gpu_peak(gpu)  # this part's, before the next one starts beside its write
        self._start_ahead(index, msg.prefetch)
        self.beat.set(index, "write")
        process.parent_alive()

        def checkpoint(stage: str) -> None:
            process.parent_alive()
            faults.rss_doing("main", f"write: {stage}")
            faults.hit(stage, index, writer)

        out, metadata = self.backend.serialize(out)
        stages = {"read": t_read - t0, "inputs": t1 - t_read, "wait": turn["wait"],
                  "quantize": t2 - t1 - turn["wait"] - error_seconds, "error": error_seconds}
        if ahead_s:
            stages["ahead"] = ahead_s
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
        process.malloc_trim()
        self.source.trim()  # the layer ahead only reads its weights until it is taken over (child/ahead.py)
        stages["boundary"] = t4 - t3
        stages["cleanup"] = time.perf_counter() - t4
        faults.log_live_tensors(index, settle=self._settle_in_flight)
        faults.log_rss_trace(index)
        self.beat.set(None, "idle")
        return LayerWritten(index=index, file=layout.shard_name(index), fence=fence, digest=w.digest, nbytes=w.nbytes, ino=w.ino, mtime_ns=w.mtime_ns,
                            seconds=time.perf_counter() - t0, source_bytes=source_bytes,
                            peak_rss=process.peak_rss(), rss=process.rss(), peak_gpu=peak_gpu, quant_error=errors,
                            stages={k: round(v, 4) for k, v in stages.items()}, boundary=boundary,
                            pending=self.backend.pending, settled=settled,
                            source_digest=digest, rank=self.rank, losses=losses, ranks=substages)

    def _start_ahead(self, index: int, following: int | None) -> None:
        """Start layer `following` beside this layer's write, on a thread of its own (child/ahead.py), when the
        supervisor will ask for it next (ExportLayer.prefetch is index + 1) and the backend has its inputs whole in
        RAM (a calibrated worker alone: Calibrator.inputs_ahead), its read-ahead in flight."""
        inputs_ahead = getattr(self.backend, "inputs_ahead", None)
        if inputs_ahead is None or index == NON_LAYER or following != index + 1 or self.device_lock \
                or following not in self._ahead or faults.no_ahead():
            return
        inputs = inputs_ahead(following)
        if inputs is None:
            return
        read = self._ahead.pop(following)
        gc.collect()  # a reference cycle must not keep this layer's device memory beside the next one's
        torch = self._gpu()
        if torch is not None:
            # cuBLAS keeps a workspace per thread's handle (32 MiB on an H100, through the caching allocator): the
            # layer's thread would hold one beside this thread's, which has nothing more to multiply (measured: every
            # layer's peak 32 MiB higher). Given back here, the next use makes one again.
            release = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if release is not None:
                release()
        self._gpu_reset()

        # its output goes to the host with every part's, in _export
        self._layer_ahead = LayerAhead(following, read,
                                       lambda tensors: self.backend.quantize_layer(following, tensors, inputs=inputs),
                                       self.source.nbytes)

    def _take_ahead(self, ahead: LayerAhead, index: int, asked: float) -> tuple[dict | None, float]:
        """Layer `index`, started ahead, taken over: the heartbeats and fault points of the stages it ran ahead fire
        here in order, the worker's stage clock goes on from its own, and its thread goes on to the end. Its output,
        and how long before `asked` (its request's arrival) it started. One that failed ahead runs here as it would
        have (those points fired already)."""
        def replay(name: str) -> None:
            self.beat.set(index, name)
            self._reached.add(name)
            faults.hit(name, index, self._writer)

        def hand_over(clock, substages: dict, peaks: list) -> None:
            self._clock, self._substages = clock, substages
            if self._stage_peaks is not None:
                self._stage_peaks = peaks

        if not ahead.take(replay, hand_over):
            self.drop_ahead()
            tensors, _ = self._load(index)
            return self.backend.quantize_layer(index, tensors), 0.0
        self._layer_ahead = None  # its thread is the layer's now; this one waits for it
        faults.rss_doing("ahead", "")
        return ahead.result(), max(asked - ahead.started, 0.0)

    def drop_ahead(self) -> None:
        """A layer started ahead that will not be asked for (another message came): ended before anything else."""
        ahead, self._layer_ahead = self._layer_ahead, None
        if ahead is not None:
            ahead.drop()
            faults.rss_doing("ahead", "")

    def _settle_in_flight(self) -> None:
        for f in self._ahead.values():
            f.result()
        if self._layer_ahead is not None:
            self._layer_ahead.parked()

    def _rank_done(self, index: int, fence: str, t0: float, stages: dict, source_bytes: int, gpu, digest: str,
                   substages: dict) -> LayerWritten:
        """A group rank's part of a layer: no shard, only the boundary of its own samples, made durable."""
        from child.backends import quant_error

        faults.hit("quantize", index, self._writer)
        process.parent_alive()
        t = time.perf_counter()
        boundary = self.backend.commit(index)
        faults.hit("boundary", index, self._writer)
        stages["boundary"] = time.perf_counter() - t
        gc.collect()
        process.malloc_trim()
        self.source.trim()
        self.beat.set(None, "idle")
        return LayerWritten(index=index, file="", fence=fence, digest="", nbytes=0, seconds=time.perf_counter() - t0,
                            source_bytes=source_bytes, peak_rss=process.peak_rss(), rss=process.rss(), peak_gpu=self._gpu_peak(gpu),
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
            process.parent_alive()

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
        torch = self._gpu()
        if torch is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
        return torch

    def _gpu(self):
        if not self.device.startswith("cuda"):
            return None
        import torch
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
        hello = reader.recv()  # bounded: Hello comes first; a dead parent is EOF
    except EndOfStream:
        return 0
    if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
        got = getattr(hello, "version", type(hello).__name__)
        writer.send(Failed(kind="ProtocolError", message=f"expected Hello version {PROTOCOL_VERSION}, got {got}"))
        return 2
    process.set_heartbeat(hello.heartbeat_seconds)
    faults.worker = hello.worker
    beat = Beat(writer, parent_pid)
    beat.start()
    try:
        faults.hit("start", None, writer)  # inside: an exception while starting is reported like a real one
        from child.imports import hide_unused
        from shared.job import warm_profile

        hide_unused(warm_profile(hello.job))  # a spawned worker imports its libraries now (a forked one has them)
        if hello.evaluate is not None:  # `verify --quality`: the source and the export side by side
            from child.backends.evaluate import Evaluator

            exporter = Evaluator(hello, beat, beat.set)
        else:
            exporter = Exporter(hello, beat)
    except Exception as exc:  # noqa: BLE001 - every failure crosses the pipe as data
        writer.send(_failed(None, exc))
        return 1
    gc.freeze()  # what the worker built to start (skeleton, config) lives as long as it: keep it out of each
    # layer's gc.collect(), which then costs milliseconds instead of a third of a second (see child.zygote)
    free, total = process.gpu_memory(hello.device)
    import torch  # imported with the backend already

    writer.send(Ready(version=PROTOCOL_VERSION, pid=os.getpid(), device=hello.device,
                      layer_prefix=exporter.prefix, num_layers=_num_layers(exporter),
                      versions=process.versions(), gpu_free=free, gpu_total=total, threads=torch.get_num_threads(),
                      device_model=device_model(hello.device)))
    beat.set(None, "idle")
    drop_ahead = getattr(exporter, "drop_ahead", lambda: None)
    while True:
        try:
            msg = reader.recv()  # bounded: the parent check ends an orphan
        except EndOfStream:
            drop_ahead()
            return 0
        if not isinstance(msg, (ExportLayer, Settle)):
            # a layer started ahead is asked for by the next ExportLayer or by nothing (child/ahead.py); Settle (a
            # recycled worker's pending inputs made durable) touches nothing it uses: answered first, the Stop after
            # it ends it
            drop_ahead()
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
                    from child.backends import group

                    group.leave()
                return 0
            case _:
                writer.send(Failed(kind="ProtocolError", message=f"unexpected message {type(msg).__name__}"))
                return 2


def _num_layers(worker) -> int:
    backend = getattr(worker, "backend", None)
    return backend.num_layers if backend is not None else worker.num_layers
