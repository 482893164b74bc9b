"""The embedding API: `Supervisor(job, model=...)`, its events and cancel; the CLI calls the same thing.

    caller ──job──▶ Supervisor.__init__   validate job, source, output, fingerprint (writes nothing)
                    .start / __enter__    lock OUT, release the live model's GPU memory, start the run thread
                    run thread            journal → parts to do → worker(s) → journal each shard → finalize
                                          finally: stop the worker, restore the live model, unlock, terminal event
                    .events()             typed events (supervisor.events) until Finished | Failed | Cancelled
                    .cancel()             from any thread: stop soon, leave a resumable state
                    __exit__              cancel if still running, join, restore (idempotent) on every path

Owns the run's control flow and retry policy. It never quantizes (the child does), never parses the wire
format (shared.framing), and imports torch only when a live model is handed to it (supervisor.offload).
"""
from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
import traceback as tb
from dataclasses import dataclass

from shared import layout
from shared.job import Job, JobSyntaxError, parse_toml
from shared.messages import NON_LAYER, PROTOCOL_VERSION, ConfigWritten, ExportLayer, Failed, Heartbeat, Hello, LayerWritten, WriteConfig
from supervisor import events as ev
from supervisor import finalize, journal
from supervisor.errors import (Cancelled, DeviceError, ExportFailed, InputError, JobError, OutputError, SourceError,
                               SupervisorError)
from supervisor.lock import Lock, probe
from supervisor.source import SourceInfo, inspect
from supervisor.worker import CancelledWait, Worker, WorkerLost

ENOSPC = 28
LOG_KEEP = 2000  # child log lines kept for a UI that connects late (recent_logs())
LOG_QUEUED_MAX = 1000  # LogLine events waiting unread at most; past that a flood is counted, not queued


def load_job(path: str | os.PathLike) -> Job:
    """Read and validate a job.toml; raises JobError with a one-line message."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        raise JobError(f"job file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"job file {str(path)!r} cannot be read: {exc}") from exc
    try:
        job = parse_toml(text)
    except JobSyntaxError as exc:
        raise JobError(f"{path}: {exc}") from exc
    # Relative paths in a job file are relative to the file, so a job runs the same from any cwd.
    base = os.path.dirname(os.path.abspath(path))
    if job.source is not None:
        job.source.path = os.path.normpath(os.path.join(base, os.path.expanduser(job.source.path)))
        if job.source.adapter is not None:
            job.source.adapter = os.path.normpath(os.path.join(base, os.path.expanduser(job.source.adapter)))
    job.export.output = os.path.normpath(os.path.join(base, os.path.expanduser(job.export.output)))
    return job


@dataclass
class Plan:
    job: Job
    output: str
    source: SourceInfo
    fingerprint: str
    state: journal.State
    device: str
    live: bool = False  # the source is the live model handed to Supervisor (its pool), not a folder


def _is_within(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or os.path.commonpath([path, folder]) == folder


def _check_writable(output: str) -> None:
    probe_dir = output
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise OutputError(f"output {output!r} cannot be created: {probe_dir!r} is not a folder")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise OutputError(f"output {output!r} is not writable ({probe_dir!r} is read-only); "
                          "choose a writable [export] output")


def prepare(job: Job, model=None) -> Plan:
    """Validate everything about the job before anything is written; raises InputError subclasses. A job without
    [source] exports `model` itself (a live model, Python API only)."""
    from supervisor import devices

    output = os.path.abspath(job.export.output)
    if job.source is None:
        source, extra = _live_source(model, output)
    else:
        source, extra = _disk_source(job, output)
    probe(output)
    fp, parts = journal.fingerprint(job, source.stats, extra)
    state = journal.check_owner(output, fp, parts)
    _check_writable(output)
    device = devices.resolve_device(job.resources.device)
    return Plan(job, output, source, fp, state, device, live=job.source is None)


def _disk_source(job: Job, output: str) -> tuple[SourceInfo, dict | None]:
    source = inspect(job.source.path, allow_remote_code=job.source.allow_remote_code)
    extra = None
    if job.source.adapter is not None:
        from supervisor.adapter import inspect_adapter

        extra = {"adapter": inspect_adapter(job.source.adapter, source.path, source.files)}
    if _is_within(output, source.path):
        raise OutputError(f"output {job.export.output!r} is inside the source folder (or is it); "
                          "choose an output folder elsewhere")
    if os.path.exists(output) and _is_within(source.path, output):
        raise OutputError(f"the source folder is inside output {job.export.output!r}; choose another output")
    return source, extra


def _live_source(model, output: str) -> tuple[SourceInfo, dict]:
    if model is None:
        raise JobError("the job has no [source]: set [source] path to a checkpoint folder (only the Python API "
                       "exports a live model without one: Supervisor(job, model=...))")
    from supervisor import live

    # named and checked now; the tensors themselves are looked at again after the release (they move)
    return live.describe(live.saved_state(model), layout.state_path(output, live.CONFIG_DIR))


class Supervisor:
    """Runs one export in a supervised child; see the module docstring for the life cycle."""

    def __init__(self, job: Job | str | os.PathLike, model=None, *, tokenizer=None, pool=None,
                 retry_delay: float = 0.5):
        """`model`: the live model to release while the child runs (and, for a job without [source], the model
        to export); `tokenizer`: saved into the output of such a job; `pool`: an offload.PinnedPool to reuse
        across exports (pinning costs once), else one is made for this run and freed at its end."""
        self.job = job if isinstance(job, Job) else load_job(job)
        self.plan = prepare(self.job, model)
        self.model = model
        self.tokenizer = tokenizer
        self.retry_delay = retry_delay
        self._pool, self._own_pool = pool, False
        self._live = None  # live.Saved while a live model is the source: its tensors, now in the pool
        self._pool_spec = None  # shared.messages.Pool sent to every worker
        self._logs: collections.deque = collections.deque(maxlen=LOG_KEEP)
        self._log_lock = threading.Lock()
        self._logs_queued = self._logs_dropped = 0
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock: Lock | None = None
        self._handle = None  # offload handle while the live model is released
        self._journal: journal.Journal | None = None
        self._worker: Worker | None = None
        self._t0 = time.monotonic()
        self._terminal: ev.Event | None = None
        self._error: BaseException | None = None
        self._cleanup_lock = threading.Lock()
        self._started = False
        self._progress: _Progress | None = None

    # ---- public API --------------------------------------------------------------------------------------
    def __enter__(self) -> "Supervisor":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb_) -> bool:
        if self._thread is not None and self._thread.is_alive():
            self.cancel()
            self._thread.join()
        self._cleanup()
        return False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        out = self.plan.output
        try:
            for d in (out, layout.state_dir(out), layout.state_path(out, layout.LOGS),
                      layout.state_path(out, layout.TMP)):
                os.makedirs(d, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create output {out!r}: {exc.strerror}") from exc
        self._lock = Lock(out)
        self._lock.acquire()
        try:
            self._release_model()
            self._precheck_gpu()
        except BaseException:
            self._cleanup()
            raise
        self._thread = threading.Thread(target=self._run, name="supervisor-run", daemon=True)
        self._thread.start()

    def events(self, timeout: float | None = None):
        """Yield events until the terminal one (Finished, Failed or Cancelled), which is yielded last."""
        while True:
            try:
                e = self._events.get(timeout=0.1 if timeout is None else timeout)
            except queue.Empty:
                if timeout is not None:
                    return
                continue
            if isinstance(e, ev.LogLine):
                with self._log_lock:
                    self._logs_queued -= 1
            yield e
            if isinstance(e, ev.TERMINAL):
                return

    def recent_logs(self) -> list[ev.LogLine]:
        """The child's last LOG_KEEP lines (stdout and stderr), oldest first, whether or not events() saw them."""
        return list(self._logs)

    def cancel(self) -> None:
        """Stop the export soon (from any thread); what was written stays and a re-run resumes."""
        self._cancel.set()

    def wait(self) -> ev.Finished:
        """Block until the run ends; return Finished or raise the error that ended it."""
        if self._thread is not None:
            self._thread.join()
        self._cleanup()
        if isinstance(self._terminal, ev.Finished):
            return self._terminal
        if self._error is not None:
            raise self._error
        raise Cancelled("export cancelled before it finished; run it again to resume")

    # ---- run thread --------------------------------------------------------------------------------------
    def _emit(self, e: ev.Event) -> None:
        e.t = round(time.monotonic() - self._t0, 3)
        self._events.put(e)

    def _run(self) -> None:
        terminal: ev.Event
        try:
            try:
                terminal = self._export()
            except OSError as exc:
                if exc.errno != ENOSPC:
                    raise
                # The supervisor's own writes (journal, index, side files) on a full disk: same story as a shard.
                raise ExportFailed(f"disk full while writing into {self.plan.output!r} ({exc.filename or 'journal'}):"
                                   " free some space and run again to resume") from exc
        except (Cancelled, CancelledWait) as exc:
            self._error = exc if isinstance(exc, Cancelled) else Cancelled(
                "export cancelled; run the same job again to resume")
            terminal = ev.Cancelled()
        except SupervisorError as exc:
            self._error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=str(exc), index=getattr(exc, "index", None),
                                 traceback=getattr(exc, "traceback", ""), exit_code=exc.exit_code)
        except BaseException as exc:  # noqa: BLE001 - an internal bug still restores the model and unlocks
            self._error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=f"internal error: {exc}",
                                 traceback="".join(tb.format_exception(exc)), exit_code=1)
        try:
            self._cleanup()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=str(exc),
                                 traceback="".join(tb.format_exception(exc)))
        self._terminal = terminal
        self._flush_dropped_logs()  # the reader learns of a flood it missed before the run's last event
        self._emit(terminal)

    def _cleanup(self) -> None:
        """Stop the worker, close the journal, restore the model, unlock. Idempotent, safe from any thread."""
        # Every step runs even when an earlier one raises (on a full disk the journal's close raises): the live
        # model always comes back and the lock is always released. ExitStack runs the callbacks last-in first-out.
        with self._cleanup_lock, contextlib.ExitStack() as steps:
            if self._lock is not None:
                steps.callback(self._lock.release)
                self._lock = None
            steps.callback(self._close_pool)  # after the restore: the model lives in it until then
            steps.callback(self._restore_model)
            if self._journal is not None:
                steps.callback(self._journal.close)
                self._journal = None
            if self._worker is not None:
                steps.callback(self._worker.stop, grace=2.0)
                self._worker = None

    def _release_model(self) -> None:
        if self.model is None:
            return
        from supervisor import offload

        if self.plan.live:
            from supervisor import live

            self._live = live.saved_state(self.model)  # names first: after the release all tensors share a chunk
            if self._pool is None:
                self._pool, self._own_pool = offload.PinnedPool(), True
            result = offload.release(self.model, buffers=self._pool, share_host=True)
            if isinstance(result, offload.NotReleased):
                raise SourceError(f"the live model cannot be exported: {result.reason}")
            self._handle = result
            self._share_live_model()
        else:
            result = offload.release(self.model, buffers=self._pool)
        if isinstance(result, offload.NotReleased):
            self._emit(ev.MemoryReleased(released=False, reason=result.reason))
            return
        self._handle = result
        self._emit(ev.MemoryReleased(released=True, freed=dict(result.freed), moved_bytes=result.moved_bytes,
                                     seconds=result.seconds))

    def _share_live_model(self) -> None:
        """The released live model as the child's source: the pool's manifest and the config folder."""
        from supervisor import live

        config_dir = self.plan.source.path
        self._pool_spec = live.manifest(self._live, self._pool, config_dir)
        live.write_config_dir(self._live, self.tokenizer, config_dir)

    def _close_pool(self) -> None:
        self._live = self._pool_spec = None
        if self._own_pool and self._pool is not None and not self._pool.leased:
            self._pool.close()
            self._pool, self._own_pool = None, False

    def _restore_model(self) -> None:
        if self._handle is None:
            return
        from supervisor import offload

        t = time.monotonic()
        handle, self._handle = self._handle, None
        offload.restore(handle)
        self._emit(ev.ModelRestored(seconds=round(time.monotonic() - t, 4)))

    # ---- the export --------------------------------------------------------------------------------------
    def _export(self) -> ev.Event:
        plan, out = self.plan, self.plan.output
        n = plan.source.num_layers
        parts = list(range(n)) + [NON_LAYER]
        st = journal.read(out)  # re-read under the lock: the journal may have grown since prepare()
        if st.header is not None and st.header.fingerprint != plan.fingerprint:
            raise OutputError(f"output {out!r} changed hands while starting; run again")
        done, redo = {}, []
        for idx, rec in st.shards.items():
            problem = journal.verify_shard(out, rec) or self._source_changed(idx, rec)
            if problem is None:
                done[idx] = rec
            else:
                redo.append(idx)
        self._journal = journal.Journal(out, st) if st.header else journal.start(out, self.job, plan.fingerprint, n)
        self._clear_tmp()
        todo = [p for p in parts if p not in done]
        self._emit(ev.Started(output=out, total=len(parts), todo=len(todo), resumed=len(done), redo=sorted(redo)))
        if not todo and st.finalized is not None and not redo and not journal.verify_files(out, _not_in(st.finalized.files, done)):
            return ev.Finished(output=out, parts=len(parts), nbytes=sum(r.nbytes for r in done.values()),
                               seconds=0.0, already_complete=True)
        self._progress = _Progress(total=len(parts), done=len(done), source_bytes=plan.source.nbytes)
        for i, idx in enumerate(todo):
            nxt = todo[i + 1] if i + 1 < len(todo) else None
            done[idx] = self._export_part(idx, nxt)
        self._finalize(done)
        total_bytes = sum(r.nbytes for r in done.values())
        return ev.Finished(output=out, parts=len(parts), nbytes=total_bytes,
                           seconds=round(time.monotonic() - self._t0, 3))

    def _source_changed(self, index: int, rec: journal.Shard) -> str | None:
        """A live model's part whose tensors differ from those its shard was made from (a re-run after a crash
        with a changed model): redone, never mixed in."""
        if self._live is None:
            return None
        from supervisor import live

        names = live.part_names(self.plan.source.tensor_names, self.plan.source.layer_prefix, index)
        return None if live.part_digest(self._live, names) == rec.source_digest else "the live model changed"

    def _clear_tmp(self) -> None:
        tmp = layout.state_path(self.plan.output, layout.TMP)
        for fn in os.listdir(tmp):
            os.unlink(os.path.join(tmp, fn))

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("export cancelled; run the same job again to resume")

    def _ensure_worker(self) -> Worker:
        if self._worker is not None:
            return self._worker
        from supervisor import devices

        self._check_cancel()
        plan, r = self.plan, self.job.resources
        env = devices.child_env(plan.device, dict(os.environ))
        env["PYTHONUNBUFFERED"] = "1"
        child_device = "cpu" if plan.device == "cpu" else "cuda:0"
        hello = Hello(version=PROTOCOL_VERSION, job=self.job, output=plan.output, device=child_device,
                      pool=self._pool_spec)
        log = layout.state_path(plan.output, layout.LOGS, "worker-0.log")
        w = Worker(hello, log, env, startup_timeout=r.startup_timeout, heartbeat_timeout=r.heartbeat_timeout,
                   pass_fds=tuple(self._pool_spec.fds) if self._pool_spec is not None else (), on_log=self._on_log)
        self._worker = w
        t = time.monotonic()
        ready = w.start(self._cancel.is_set, self._on_heartbeat)
        if ready.num_layers != plan.source.num_layers or ready.layer_prefix != plan.source.layer_prefix:
            raise SourceError(f"the model class sees {ready.num_layers} layers under {ready.layer_prefix!r} but the "
                              f"weights hold {plan.source.num_layers} under {plan.source.layer_prefix!r}; "
                              "this architecture is not supported")
        self._emit(ev.WorkerStarted(pid=ready.pid, device=plan.device, seconds=round(time.monotonic() - t, 3),
                                    gpu_free=ready.gpu_free, gpu_total=ready.gpu_total))
        self._check_gpu_room(ready)
        p = self._progress
        if p is not None and p.done == p.done_at_start:
            p.start = time.monotonic()  # rates measure exporting, not the first worker's imports
        return w

    def _layer_need(self) -> int:
        src = self.plan.source
        # A layer in flight: its tensors, the next layer read ahead, and the quantized copy (~2.5x a layer).
        return int(2.5 * src.nbytes / max(src.num_layers, 1))

    def _precheck_gpu(self) -> None:
        """Before a child starts: if this process already uses CUDA (a studio holding its model), ask the device
        for its free memory now, after the release. The CLI never initializes CUDA here (a context costs
        ~0.5 GB of the very memory we want free); the worker then measures it itself (_check_gpu_room)."""
        import sys
        torch = sys.modules.get("torch")
        if self.plan.device == "cpu" or torch is None or not torch.cuda.is_initialized():
            return
        from supervisor import devices
        devices.check_free_memory(self.plan.device, self._layer_need() + (512 << 20))  # + the child's context

    def _check_gpu_room(self, ready) -> None:
        """Refuse a GPU that cannot hold a layer: the worker measured its free memory after starting."""
        if not ready.gpu_total:
            return
        need = self._layer_need()
        if ready.gpu_free < need:
            raise DeviceError(f"{self.plan.device} has {ready.gpu_free / 2**30:.1f} GiB free as the worker sees it, "
                              f"a layer needs about {need / 2**30:.1f} GiB: free memory on that GPU (or hand the live "
                              "model to Supervisor(model=...)), or set [resources] device to another one")

    def _drop_worker(self, kill: bool) -> None:
        if self._worker is not None:
            self._worker.kill() if kill else self._worker.stop()
            self._worker = None

    def _on_log(self, stream: str, text: str, pid: int) -> None:
        """Called by the worker's log pump for every line: keep it, and stream it unless the reader is behind."""
        line = ev.LogLine(stream=stream, text=text, pid=pid, t=round(time.monotonic() - self._t0, 3))
        self._logs.append(line)
        with self._log_lock:
            if self._logs_queued >= LOG_QUEUED_MAX:
                self._logs_dropped += 1
                return
            dropped, self._logs_dropped = self._logs_dropped, 0
            self._logs_queued += 1 + bool(dropped)
        if dropped:
            self._emit_dropped(dropped, stream, pid)
        self._emit(line)

    def _emit_dropped(self, dropped: int, stream: str = "stderr", pid: int = 0) -> None:
        self._emit(ev.LogLine(stream=stream, pid=pid, text=f"[{dropped} lines not streamed while the reader was "
                              "behind; recent_logs() and the worker log have them]"))

    def _flush_dropped_logs(self) -> None:
        with self._log_lock:
            dropped, self._logs_dropped = self._logs_dropped, 0
            self._logs_queued += bool(dropped)
        if dropped:
            self._emit_dropped(dropped)

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        p = self._progress
        if p is not None and hb.index is not None:
            self._emit(p.event(worker_rss=hb.rss, stage=hb.stage, index=hb.index))

    def _export_part(self, index: int, prefetch: int | None) -> journal.Shard:
        w, reply = self._with_retries(
            index, lambda attempt: ExportLayer(index=index, attempt=attempt, prefetch=prefetch), LayerWritten)
        return self._record(reply, w)

    def _with_retries(self, index: int | None, make_request, success: type):
        """Send make_request(attempt) until the reply is a `success`, each retry in a fresh worker; returns
        (worker, reply). index None is config.json at finalize. Disk full ends at once; other failures are
        retried up to max_attempts, then ExportFailed names the part and carries the child's last traceback."""
        r = self.job.resources
        what = "config.json" if index is None else _part_name(index)
        last_reason, last_tb = "", ""
        for attempt in range(1, r.max_attempts + 1):
            self._check_cancel()
            try:
                w = self._ensure_worker()
                if index is not None:
                    self._emit(ev.LayerStarted(index=index, attempt=attempt))
                reply = w.request(make_request(attempt), self._cancel.is_set, self._on_heartbeat,
                                  timeout=r.part_timeout if index is not None else 0.0)
                if isinstance(reply, success):
                    return w, reply
                if isinstance(reply, Failed):
                    if reply.errno == ENOSPC:
                        raise ExportFailed(f"disk full while writing {what} into {self.plan.output!r}: "
                                           "free some space and run again to resume", index=index,
                                           traceback=reply.traceback)
                    last_reason, last_tb = f"{reply.kind}: {reply.message}", reply.traceback
                else:
                    last_reason, last_tb = f"unexpected reply {type(reply).__name__}", ""
            except WorkerLost as exc:
                last_reason, last_tb = exc.reason, exc.log_tail
            except CancelledWait:
                raise Cancelled("export cancelled; run the same job again to resume") from None
            # Whatever went wrong, the next attempt gets a fresh process: a failed child's state is suspect.
            self._drop_worker(kill=True)
            self._retry_later(index, attempt, last_reason)
        raise ExportFailed(f"{what} failed {r.max_attempts} times; last error: {last_reason}",
                           index=index, traceback=last_tb)

    def _retry_later(self, index: int | None, attempt: int, reason: str) -> None:
        """Announce the next attempt (index None: config.json at finalize) and back off; no-op after the last."""
        if attempt >= self.job.resources.max_attempts:
            return
        delay = min(self.retry_delay * 2 ** (attempt - 1), 10.0)
        self._emit(ev.Retrying(index=index, attempt=attempt + 1, reason=reason, delay=delay))
        if self._cancel.wait(delay):
            raise Cancelled("export cancelled; run the same job again to resume")

    def _record(self, reply: LayerWritten, w: Worker) -> journal.Shard:
        path = os.path.join(self.plan.output, reply.file)
        if reply.file != layout.shard_name(reply.index) or not os.path.isfile(path) \
                or os.path.getsize(path) != reply.nbytes:
            raise WorkerLost(f"worker reported {reply.file} but it is not on disk as described")
        rec = journal.Shard(index=reply.index, file=reply.file, sha256=reply.sha256, nbytes=reply.nbytes,
                            seconds=round(reply.seconds, 3), source_digest=reply.source_digest)
        self._journal.append(rec)
        w.layers_done += 1
        w.rss = reply.rss
        self._emit(ev.LayerWritten(index=reply.index, file=reply.file, nbytes=reply.nbytes,
                                   seconds=round(reply.seconds, 3), peak_rss=reply.peak_rss, peak_gpu=reply.peak_gpu))
        self._progress.add(reply.source_bytes, reply.nbytes)
        self._emit(self._progress.event(worker_rss=reply.rss))
        self._maybe_recycle(w)
        return rec

    def _maybe_recycle(self, w: Worker) -> None:
        r = self.job.resources
        by_count = r.recycle_after_layers and w.layers_done >= r.recycle_after_layers
        by_rss = r.recycle_above_rss_mb and w.rss > r.recycle_above_rss_mb * 1024 * 1024
        if by_count or by_rss:
            self._drop_worker(kill=False)

    def _finalize(self, done: dict[int, journal.Shard]) -> None:
        out = self.plan.output
        staging = layout.state_path(out, layout.STAGING)
        _, reply = self._with_retries(None, lambda attempt: WriteConfig(dest=staging), ConfigWritten)
        self._drop_worker(kill=False)
        finalize.place_config(reply.path, out)
        shards = finalize.shard_files(self.plan.source.num_layers)
        finalize.write_index(out, shards)
        finalize.copy_side_files(self.plan.source.path, out)
        files = finalize.output_files(out, {r.file: r.sha256 for r in done.values()})
        self._journal.append(journal.Finalized(files=files))
        finalize.write_done(out, files)


def _not_in(files: dict[str, str], shards: dict[int, journal.Shard]) -> dict[str, str]:
    """The finalized files that are not shards (those were just verified against their own records)."""
    hashed = {r.file for r in shards.values()}
    return {fn: sha for fn, sha in files.items() if fn not in hashed}


def _part_name(index: int) -> str:
    return "the non-layer shard" if index == NON_LAYER else f"layer {index}"


class _Progress:
    def __init__(self, total: int, done: int, source_bytes: int):
        self.total, self.done = total, done
        self.source_total = source_bytes
        self.start = time.monotonic()
        self.done_at_start = done
        self.bytes_read = 0
        self.bytes_written = 0

    def add(self, read: int, written: int) -> None:
        self.done += 1
        self.bytes_read += read
        self.bytes_written += written

    def event(self, worker_rss: int = 0, stage: str = "", index: int | None = None) -> ev.Progress:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        finished_now = self.done - self.done_at_start
        eta = (elapsed / finished_now) * (self.total - self.done) if finished_now else None
        return ev.Progress(done=self.done, total=self.total, bytes_written=self.bytes_written,
                           mb_per_s=round(self.bytes_read / elapsed / 1e6, 2),
                           eta_s=None if eta is None else round(eta, 1), worker_rss=worker_rss, stage=stage,
                           index=index)


def export(job: Job | str | os.PathLike, model=None, on_event=None, *, tokenizer=None) -> ev.Finished:
    """Run one export to the end (blocking); `on_event` sees every event. Raises the error that ended it."""
    with Supervisor(job, model=model, tokenizer=tokenizer) as run:
        for e in run.events():
            if on_event is not None:
                on_event(e)
        return run.wait()


__all__ = ["Supervisor", "export", "load_job", "prepare", "InputError"]
