"""One export's run: the steps between a validated Plan and the terminal event (supervisor.api is its caller).

    Plan (api.prepare)
      │
      ▼
    Run.start          mkdir OUT, lock it; release the live model into the pool (supervisor.offload; a live
      │                source: shared with the workers as memfds); GPU precheck; start the run thread
      ▼
    _run → _export     journal.read → _verified: the parts that stand, those to redo (calibrated: from the
      │                newest good boundary) → Started
      ├─▶ _copy_ahead  the non-layer part copied as is (supervisor.verbatim), journaled once the plan keeps it
      ├─▶ _preflight   spawner thread → warm parent (_start_zygote) → _make_scheduler; _judge: a worker's
      │                export plan (Describe), before the parts or beside them
      ├─▶ scheduler    a thread per slot: _start_worker (_fork from the zygote) ── ExportLayer ──▶ worker
      │      ◀── LayerWritten ── _record: on disk as described? journal (fsync) → events, progress
      ├─▶ _finalize    config, index, side files, the loader check, Finalized, done marker
      ▼
    cleanup (finally)  scheduler, zygote, copy, journal closed; the model restored, the pool freed, OUT
                       unlocked; then the terminal event (Finished | Failed | Cancelled)
    _on_log            the child's lines, from the log pumps: the last LOG_KEEP kept, LogLine events bounded

Owns one export's control flow, its retry policy (through supervisor.scheduler), the pool and warm parent, the
journal records of written parts, the release and restore of the live model and the clean-up on every path. It
never validates a job (api.prepare did, and hands it the Plan), never quantizes (the child does), never parses the
wire format (shared.framing), and imports torch only when a live model is handed to it (supervisor.offload).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import shutil
import threading
import time
import traceback as tb
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from shared import durable, layout
from shared.job import Job, warm_profile
from shared.load_verdict import LIFT_HINT, transformers_only
from shared.load_verdict import problems as load_problems
from shared.messages import (LISTEN_FD_ENV, LISTEN_PORT_ENV, NON_LAYER, PROTOCOL_VERSION, Boundary, CheckLoad, Describe,
                             Described, Heartbeat, Hello, LayerWritten, LoadChecked, Settle, Settled)
from supervisor import events as ev
from supervisor import calibration, finalize, journal, verbatim
from supervisor.group import Group, data_plane_env, interface_holding
from supervisor.errors import Cancelled, ExportFailed, InputError, NoRoom, OutputError, SourceError, SupervisorError
from supervisor.lock import Lock
from supervisor.source import SourceInfo
from supervisor.scheduler import Scheduler, Slot
from supervisor.worker import CancelledWait, Worker, WorkerLost, spawn
from supervisor.zygote import Zygote, ZygoteLost, keep_warm_seconds

if TYPE_CHECKING:  # supervisor.live imports torch; a plan for a checkpoint never needs it
    from supervisor.cluster import Cluster
    from supervisor.live import Saved
    from supervisor.qlora import LiveLora, Shared

ENOSPC = 28
# Test-only: "1" judges the export plan beside the first parts, "0" before them, whatever the host's free memory
# (tests/scenarios run both orderings on the CPU machine).
PLAN_BESIDE_ENV = "SUPERVISOR_TEST_PLAN_BESIDE"
# Test-only: seconds a cluster slot whose node left waits for Ray to place it elsewhere before it is left out
# (default supervisor.cluster.PLACE_SECONDS); a left-out slot then asks every ROOM_POLL s until a node has room.
PLACE_ENV = "SUPERVISOR_TEST_PLACE_SECONDS"
ROOM_POLL = 2.0


def cluster_place_seconds() -> float:
    from supervisor.cluster import PLACE_SECONDS

    return float(os.environ.get(PLACE_ENV) or PLACE_SECONDS)
LOG_KEEP = 2000  # child log lines kept for a UI that connects late (recent_logs())
LOG_QUEUED_MAX = 1000  # LogLine events waiting unread at most; past that a flood is counted, not queued


@dataclass
class Plan:
    job: Job
    output: str
    source: SourceInfo
    fingerprint: str
    state: journal.State
    device: str  # the first of `devices`
    devices: list[str]  # every device the workers use ("cpu" or "cuda:N", the supervisor's numbering)
    calibration: calibration.Calibration | None = None  # calibrated jobs: the validated data, for the child
    # the source is the live model handed to Supervisor (its pool), not a folder: its names, as the fingerprint
    # saw them (supervisor.live.Saved; tensors are looked up again by path after the release moves them)
    live: Saved | None = None
    # a PEFT model over a quantized base: its LoRA pairs, merged over the 16-bit checkpoint job.source names
    # (supervisor.qlora.LiveLora; the pairs are copied into a pool of their own at the release)
    lora: LiveLora | None = None
    fresh: bool = False  # the output folder did not exist or was empty: a refused run leaves it that way
    world: int = 1  # calibrated: the ranks of the group that calibrates each layer (calibration.group_size)
    world_note: str = ""  # why it is 1 where more were asked
    cluster: Cluster | None = None  # [resources] cluster = "ray": the joined cluster, one agent per slot


class Run:
    """One export's steps, from a Plan to its terminal event, on a thread of its own; Supervisor is its only caller
    (see the module docstring for the steps)."""

    def __init__(self, plan: Plan, model=None, *, tokenizer=None, pool=None, retry_delay: float = 0.5):
        """`plan`: the validated job (api.prepare); `model`, `tokenizer`, `pool`: as handed to Supervisor."""
        self.job = plan.job
        self.plan = plan
        self.model = model
        self.tokenizer = tokenizer
        self.retry_delay = retry_delay
        self._pool, self._own_pool = pool, False
        self._live = None  # live.Saved while a live model is the source: its tensors, now in the pool
        self._pool_spec = None  # shared.messages.Pool sent to every worker
        self._pairs: Shared | None = None  # plan.lora's pairs, copied into self._pairs_pool (supervisor.qlora)
        self._pairs_pool = None
        self._logs: collections.deque = collections.deque(maxlen=LOG_KEEP)
        self._log_lock = threading.Lock()
        self._logs_queued = self._logs_dropped = 0
        self._events: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock: Lock | None = None
        self._handle = None  # offload handle while the live model is released
        self._journal: journal.Journal | None = None
        self._scheduler: Scheduler | None = None
        self._plan_load = None  # the loader's verdict on the predicted output (shared.messages.LoadReport)
        self._described: Described | None = None  # the export plan, once judged good
        self._judged = threading.Event()  # set with it
        self._copy: verbatim.Copy | None = None  # the non-layer part written ahead by this process
        self._closing = threading.Event()  # the run is over: a copy still waiting for the verdict gives up
        self._zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._spawner: ThreadPoolExecutor | None = None
        self._deleter: ThreadPoolExecutor | None = None  # unlinks spent boundary files off the critical path
        self._done: dict[int, journal.Shard] = {}
        self._t0 = time.monotonic()
        self.terminal: ev.Event | None = None
        self.error: BaseException | None = None
        self._cleanup_lock = threading.Lock()
        self._started = False
        self._progress: _Progress | None = None
        self._boundary = None  # calibrated: the newest journaled (durable) boundary: the inputs of the next layer
        # calibrated, one worker: (the layer whose inputs the last reply left pending, that reply's fence)
        self._pending: tuple[int, str] | None = None
        self._arithmetic: journal.Arithmetic | None = None  # calibrated: what the layers were computed with
        self._had_layers = False  # the journal held a layer when the run began
        self._output_existed = os.path.isdir(self.plan.output)

    # ---- what Supervisor calls -----------------------------------------------------------------------------
    def start(self) -> None:
        """Lock the output, release the live model, start the run thread (the first call only)."""
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
            self.cleanup()
            raise
        self._thread = threading.Thread(target=self._run, name="supervisor-run", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def cancel(self) -> None:
        self._cancel.set()

    def next_event(self, timeout: float) -> ev.Event:
        """The next event, or queue.Empty after `timeout` s; a LogLine taken off no longer counts as queued."""
        e = self._events.get(timeout=timeout)
        if isinstance(e, ev.LogLine):
            with self._log_lock:
                self._logs_queued -= 1
        return e

    def recent_logs(self) -> list[ev.LogLine]:
        return list(self._logs)

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
            self.error = exc if isinstance(exc, Cancelled) else Cancelled(
                "export cancelled; run the same job again to resume")
            terminal = ev.Cancelled()
        except SupervisorError as exc:
            self.error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=str(exc), index=getattr(exc, "index", None),
                                 traceback=getattr(exc, "traceback", ""), exit_code=exc.exit_code)
        except BaseException as exc:  # noqa: BLE001 - an internal bug still restores the model and unlocks
            self.error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=f"internal error: {exc}",
                                 traceback="".join(tb.format_exception(exc)), exit_code=1)
        try:
            self.cleanup()
            if isinstance(self.error, InputError):
                self._discard_fresh_output()
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            terminal = ev.Failed(kind=type(exc).__name__, message=str(exc),
                                 traceback="".join(tb.format_exception(exc)))
        self.terminal = terminal
        self._flush_dropped_logs()  # the reader learns of a flood it missed before the run's last event
        self._emit(terminal)

    def _discard_fresh_output(self) -> None:
        """Bad input found by a worker (before any part is journaled): leave a new output folder as it was, absent or
        empty, so the fixed job runs there without a 'holds another export' refusal. Only a folder this run created
        (or found empty) and whose journal holds no part is removed; a killed run's journal header stays, so a re-run
        resumes."""
        out = self.plan.output
        if not self.plan.fresh or journal.read(out).shards:
            return
        shutil.rmtree(layout.state_dir(out), ignore_errors=True)
        for fn in finalize.shard_files(self.plan.source.num_layers):  # written ahead of the plan's verdict: in a
            durable.unlink_quietly(os.path.join(out, fn))  # folder that was new or empty, every shard is this run's
        if not self._output_existed:
            with contextlib.suppress(OSError):
                os.rmdir(out)

    def cleanup(self) -> None:
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
            if self._copy is not None:  # before the journal closes: it journals through it
                self._closing.set()
                steps.callback(self._copy.join)
                self._copy = None
            if self._spawner is not None:
                steps.callback(self._spawner.shutdown, wait=True)
                self._spawner = None
            if self._deleter is not None:  # its unlinks finish before the lock on the output is released
                steps.callback(self._deleter.shutdown, wait=True)
                self._deleter = None
            if self.plan.cluster is not None:  # after the scheduler's stop: its workers are the agents' children
                steps.callback(self.plan.cluster.close)
                self.plan.cluster = None
            if self._zygote is not None:
                steps.callback(self._zygote.close)
                self._zygote = None
            if self._scheduler is not None:
                steps.callback(self._scheduler.close)
                self._scheduler = None

    def _release_model(self) -> None:
        if self.model is None:
            return
        from supervisor import offload

        if self.plan.live is not None:
            self._live = self.plan.live  # named before the release: after it all tensors share a chunk
            if self._pool is None:
                self._pool, self._own_pool = offload.PinnedPool(), True
            result = offload.release(self.model, buffers=self._pool, share_host=True)
            if isinstance(result, offload.NotReleased):
                raise SourceError(f"the live model cannot be exported: {result.reason}")
            self._handle = result
            self._share_live_model()
        else:
            if self.plan.lora is not None:
                self._share_pairs()  # before the release: a failed copy leaves the model as it was
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

    def _share_pairs(self) -> None:
        """A QLoRA model's pairs, copied into a pool of their own that the child maps (supervisor.qlora)."""
        from supervisor import offload, qlora

        self._pairs_pool = offload.PinnedPool()
        self._pairs = qlora.share(self.plan.lora, self._pairs_pool, self.plan.source.path)
        self._pool_spec = self._pairs.spec

    def _close_pool(self) -> None:
        self._live = self._pool_spec = self._pairs = None
        if self._pairs_pool is not None:
            self._pairs_pool.end_lease()
            self._pairs_pool.close()
            self._pairs_pool = None
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
        self._arithmetic, self._had_layers = st.arithmetic, any(i >= 0 for i in st.shards)
        done, redo = self._verified(st, n)
        self._journal = journal.Journal(out, st) if st.header else \
            journal.start(out, self.job, plan.fingerprint, n, world=plan.world)
        for idx, rec in done.items():
            # verified by its bytes under a new identity (copied, restored from a backup): journal the new
            # identity, so the next run trusts it again by its stat
            fresh = journal.restat(out, rec)
            if fresh is not rec:
                self._journal.append(fresh)
                done[idx] = fresh
        self._clear_tmp()
        todo = [p for p in parts if p not in done]
        self._emit(ev.Started(output=out, total=len(parts), todo=len(todo), resumed=len(done), redo=sorted(redo),
                              world=plan.world, world_note=plan.world_note,
                              source_note=plan.lora.note if plan.lora is not None else ""))
        if plan.cluster is not None:
            c = plan.cluster
            c.on_refused = self._refused
            self._emit(ev.ClusterJoined(address=c.address, host=c.listener.host, port=c.listener.port,
                                        nodes=len({a.node_id for a in c.agents}), agents=[a.where for a in c.agents],
                                        left_out=c.left_out))
        if not todo and st.finalized is not None and not redo and not journal.verify_files(out, journal.not_shards(st.finalized.files, done)):
            self._evaluate()
            return ev.Finished(output=out, parts=len(parts), nbytes=sum(r.nbytes for r in done.values()),
                               seconds=0.0, already_complete=True)
        self._progress = _Progress(total=len(parts), done=len(done), source_bytes=plan.source.nbytes)
        self._done = done
        self._copy_ahead(todo)
        self._preflight()
        self._scheduler.run(todo)
        self._finalize(done)
        self._evaluate()
        total_bytes = sum(r.nbytes for r in done.values())
        return ev.Finished(output=out, parts=len(parts), nbytes=total_bytes,
                           seconds=round(time.monotonic() - self._t0, 3))

    def _evaluate(self) -> None:
        """[evaluate]: the finished export's quality against its source (supervisor.quality), journaled under
        .export/quality and reported as QualityLayer / QualityMeasured events; the lock is this run's."""
        e = self.job.evaluate
        if e is None:
            return
        from supervisor import quality

        quality.measure(self.plan.output, e.dataset, e.samples, e.seq_len, on_event=self._emit, locked=True,
                        cancelled=self._cancel.is_set)

    def _preflight(self) -> None:
        """Start the pool, and judge the export plan: a worker predicts every part's output on meta tensors and
        runs transformers' loader on it. An export that would quantize nothing, or whose output would load with
        missing or unexpected weights, is refused with the reason (a new output folder is then removed again:
        _discard_fresh_output). A data-free export is judged by a worker of its own while the first parts run
        (Scheduler.plan_beside: none is journaled before the verdict). Judged first, before any part, instead: a
        calibrated export (its parts run in order on one worker), one whose workers are spawned rather than forked
        (each start is a full import: the parts would wait for the planner's), and a CPU export whose host has no
        free memory for one more worker (devices.room_for_planner). On the 2-core VM, beside the parts took 0.4-0.5 s
        off the time from the warm parent's readiness to the end (3.07-3.62 s against 3.52-4.14 s, eight alternating
        runs each, 2026-12-01): judged first, one core idled while the other judged the plan."""
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        if self.plan.cluster is None:  # on a cluster each node's host has a warm parent of its own
            self._start_zygote()
        self._scheduler = self._make_scheduler()
        if self._copy is not None:
            self._scheduler.hand_off(NON_LAYER)
        from supervisor import devices

        forced = os.environ.get(PLAN_BESIDE_ENV)
        beside = forced == "1" if forced in ("0", "1") else self.plan.cluster is not None or \
            devices.room_for_planner([s.device for s in self._scheduler.slots], self._layer_bytes)
        forkable = self._zygote.forkable if self._zygote is not None else True
        if self.plan.calibration is not None or not forkable or not beside:
            self._judge()
        else:
            self._scheduler.plan_beside(self._judge)

    def _lifted(self, load) -> bool:
        """`[export] consumer = "vllm"` and the loader's only problem is transformers' own (README: consumer)."""
        return self.job.export.consumer == "vllm" and transformers_only(load)

    def _judge(self, slot: Slot | None = None) -> None:
        """The export plan, on `slot`'s worker (default slot 0's); raises SourceError to refuse the export."""
        described = self._scheduler.request(Describe(), Described, "the export plan", slot=slot)
        self._plan_load = described.load  # the end-of-export check reuses it when the files match the prediction
        what = f"{self.job.export.scheme} export of " + (
            repr(self.job.source.path) if self.job.source is not None else "the live model")
        if described.parts and not any(part.quantized for part in described.parts):
            raise SourceError(f"{what} would quantize nothing: no weight matches the scheme's targets outside the "
                              f"ignore list (by {described.backend}); see `supervisor plan`")
        problem = load_problems(described.load)
        if problem and not self._lifted(described.load):
            raise SourceError(f"{what} would not load in transformers: {problem}{LIFT_HINT(described.load)}")
        self._described = described
        self._judged.set()

    # ---- the non-layer part written ahead, while the workers' libraries import (supervisor.verbatim) -------------
    def _copy_ahead(self, todo: list[int]) -> None:
        part = verbatim.plan(self.job, self.plan.source) if NON_LAYER in todo else None
        if part is not None and self._pairs is not None and self._pairs.touches(self._part_names(NON_LAYER)):
            part = None  # a live LoRA pair merges into the non-layer part (lm_head): a worker exports it
        if part is not None:
            self._copy = verbatim.Copy(part, self.plan.output, self._await_plan, self._settle_copy)
            self._copy.start()

    def _await_plan(self) -> Described | None:
        """The export plan once judged good; None when the run stops first (refused, failed, cancelled)."""
        while not self._judged.wait(0.1):
            scheduler = self._scheduler  # cleanup may drop it meanwhile
            if self._cancel.is_set() or self._closing.is_set() or (scheduler is not None and scheduler.stopping):
                return None
        return self._described

    def _settle_copy(self, reply: LayerWritten | None, why: str) -> None:
        """The copy's outcome to the scheduler (`why`: the reason a worker exports the part instead). A run that is
        ending meanwhile has no scheduler left, or one that journals nothing more (Scheduler.landed)."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        if reply is not None:
            scheduler.landed(reply)
        else:
            self._emit(ev.CopyDeclined(index=NON_LAYER, reason=why))
            scheduler.take_back(NON_LAYER)

    def _part_names(self, index: int) -> list[str]:
        from supervisor import live  # the rule the child reads a part's names with

        src = self.plan.source
        return live.part_names(src.tensor_names, src.layer_prefix, index, src.num_layers)

    def _source_changed(self, index: int, rec: journal.Shard) -> str | None:
        """A live model's part whose tensors differ from those its shard was made from (a re-run after a crash
        with a changed model): redone, never mixed in."""
        if self._live is None and self._pairs is None:
            return None
        from supervisor import live

        names = self._part_names(index)
        if self._pairs is not None:
            return None if self._pairs.digest(names) == rec.source_digest else "the live adapter changed"
        return None if live.part_digest(self._live, names) == rec.source_digest else "the live model changed"

    def _make_scheduler(self) -> Scheduler:
        from supervisor import devices

        r = self.job.resources
        calibrated = self.plan.calibration is not None
        # calibrated: each layer's inputs are the previous layer's outputs, so one worker, in order
        cluster = self.plan.cluster
        if cluster is not None:
            # one slot per seat; one whose node leaves the cluster with no room elsewhere waits for room (NoRoom)
            count = 1 if calibrated else len(cluster.agents)
            slots = [Slot(id=i, device=cluster.device, optional=True, elastic=True) for i in range(count)]
        else:
            slots = [self.plan.devices[0]] if calibrated else devices.worker_slots(self.plan.devices, r.workers,
                                                                                   self._layer_bytes)
            # a worker the default count added beyond one per GPU is left out if its GPU cannot hold it (NoRoom)
            slots = [Slot(id=i, device=d, optional=r.workers <= 0 and d != "cpu" and d in slots[:i])
                     for i, d in enumerate(slots)]
        return Scheduler(slots, max_attempts=r.max_attempts, part_timeout=r.part_timeout,
                         retry_delay=self.retry_delay, sequential=calibrated, cancel=self._cancel, emit=self._emit,
                         start_worker=self._start_worker, on_written=self._record, on_heartbeat=self._on_heartbeat,
                         recycle=self._should_recycle, settle=self._settle_before_stop, place=self._place,
                         boundary=self._boundary_for, restart=self._restart_for,
                         room_timeout=r.startup_timeout if cluster is not None else 0.0)

    # ---- calibrated exports: the boundary (a layer's input activations) crossing from one layer to the next ----
    def _verified(self, st: journal.State, n: int) -> tuple[dict[int, journal.Shard], list[int]]:
        """The journaled parts that stand and those to redo. A calibrated export continues after the last layer
        whose outputs (the boundary) are durable and good: every layer from there is redone, in order, starting
        from that boundary (journal.calibrated_resume)."""
        done, redo = {}, []
        for idx, rec in st.shards.items():
            if (journal.verify_shard(self.plan.output, rec) or self._source_changed(idx, rec)) is None:
                done[idx] = rec
            else:
                redo.append(idx)
        if self.plan.calibration is not None:
            start, self._boundary = journal.calibrated_resume(self.plan.output, st, n, done, self.plan.world)
            redo = sorted(set(redo) | {i for i in done if i >= start})
            done = {i: r for i, r in done.items() if i < start}  # NON_LAYER (-1) stays when good
            journal.prune_boundaries(self.plan.output, self._boundary)
        return done, redo

    def _boundary_for(self, index: int) -> list[Boundary] | None:
        """The journaled inputs of layer `index` (one file, or one per rank of a group), for workers that do not hold
        them in memory (None: none)."""
        bs = self._boundary
        return bs if bs and all(b.feeds == index for b in bs) else None

    def _restart_for(self, index: int) -> int:
        """The first layer to export again before layer `index` when no worker holds its inputs and none are
        durable: the one the newest durable boundary feeds (0: its inputs come from the samples)."""
        bs = self._boundary
        return bs[0].feeds if bs and bs[0].feeds <= index else 0

    def _check_boundary(self, reply: LayerWritten) -> Boundary | None:
        """Hold a calibrated reply's boundaries to what was asked: the next layer's inputs on disk under this
        attempt's fence, or pending; and a settled one (returned) under the fence of the reply that left it."""
        n, world = self.plan.source.num_layers, self.plan.world
        if self.plan.calibration is None or reply.index < 0:
            return None
        settled, pending, self._pending = reply.settled, self._pending, None
        if settled is not None:
            self._check_settled(settled, pending, reply.index)
        if reply.index >= n - 1:
            return settled
        if reply.pending and world == 1 and reply.boundary is None:
            self._pending = (reply.index + 1, reply.fence)
            return settled
        bs = reply.boundaries if world > 1 else [reply.boundary] if reply.boundary is not None else []
        names = [layout.boundary_name(reply.index + 1, r if world > 1 else None, reply.fence) for r in range(world)]
        if [b.file for b in bs] != names or any(b.feeds != reply.index + 1 or not self._on_disk(b) for b in bs):
            raise ExportFailed(f"worker did not leave layer {reply.index + 1}'s calibration inputs on disk as "
                               "described", index=reply.index)
        return settled

    def _check_settled(self, settled: Boundary, pending: tuple[int, str] | None, index: int) -> None:
        """A boundary named durable must be the inputs of layer `index` the reply before left pending, under its
        fence, on disk as described."""
        expected = layout.boundary_name(index, None, pending[1]) if pending is not None and pending[0] == index \
            else None
        if settled.file != expected or settled.feeds != index or not self._on_disk(settled):
            raise ExportFailed(f"worker named layer {index}'s calibration inputs durable, but not as the layer "
                               "before left them", index=index)

    def _settle_before_stop(self, w: Worker) -> None:
        """Before a calibrated worker is recycled: have it finish the inputs its last reply left pending and journal
        them, so that its successor starts from them rather than one layer back. A worker that cannot (dies, hangs
        past the heartbeat timeout) costs that layer, as any worker's loss does."""
        pending = self._pending
        if self.plan.calibration is None or pending is None:
            return
        try:
            reply = w.request(Settle(), self._cancel.is_set, lambda hb: None,
                              timeout=self.job.resources.heartbeat_timeout)
        except (WorkerLost, CancelledWait):
            return
        if not isinstance(reply, Settled) or reply.boundary is None:
            return
        self._pending = None
        self._check_settled(reply.boundary, pending, pending[0])
        self._journal_boundary(pending[0] - 1, [reply.boundary])

    def _on_disk(self, b: Boundary) -> bool:
        path = os.path.join(self.plan.output, b.file)
        return os.path.isfile(path) and os.path.getsize(path) == b.nbytes

    def _journal_boundary(self, index: int, bs: list[Boundary]) -> None:
        """Layer `index`'s record again, now naming the boundaries its outputs made (durable), and they become the
        newest: the one before them is spent."""
        rec = self._done.get(index)
        if rec is None:
            raise ExportFailed(f"worker named layer {index + 1}'s calibration inputs durable before layer {index} "
                               "was journaled", index=index + 1)
        rec = msgspec.structs.replace(rec, boundary=bs[0] if len(bs) == 1 else None,
                                      boundaries=bs if len(bs) > 1 else [])
        self._journal.append(rec)
        self._done[index] = rec
        spent, self._boundary = self._boundary, bs
        for b in spent or []:  # it fed an earlier layer; the new one was held to its layer's name
            self._discard(os.path.join(self.plan.output, b.file))

    def _clear_tmp(self) -> None:
        tmp = layout.state_path(self.plan.output, layout.TMP)
        for fn in os.listdir(tmp):
            os.unlink(os.path.join(tmp, fn))

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("export cancelled; run the same job again to resume")

    def _start_zygote(self) -> None:
        """Start the warm parent that forks workers. It is spawned from the long-lived spawner thread: a
        parent-death signal fires when the *thread* that spawned a process ends, not only its process."""
        from supervisor import devices

        self._check_cancel()
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.plan.devices == ["cpu"]:
            env = devices.child_env("cpu", env)
        log = layout.state_path(self.plan.output, layout.LOGS, "zygote.log")
        z = Zygote(env, log, warm_profile(self.job), self.job.resources.startup_timeout, pass_fds=self._pool_fds,
                   on_log=self._on_log, keep_warm=keep_warm_seconds(self.job.resources.keep_warm))
        t = time.monotonic()
        try:
            self._spawner.submit(z.start, self._cancel.is_set).result()
        except ZygoteLost as exc:
            raise ExportFailed(f"workers cannot start: {exc.reason}", traceback=exc.log_tail) from None
        except CancelledWait:
            raise Cancelled("export cancelled; run the same job again to resume") from None
        self._zygote = z
        self._emit(ev.PoolStarted(pid=z.pid, seconds=round(time.monotonic() - t, 3), imports=z.seconds,
                                  forking=z.forkable, reused=z.reused, kept=z.keep_warm if z.kept else 0.0))

    @property
    def _pool_fds(self) -> tuple[int, ...]:
        """A live model's pool memfds, inherited by the zygote (so by every worker it forks) or a spawned worker."""
        return tuple(self._pool_spec.fds) if self._pool_spec is not None else ()

    def _fork(self, env: dict, fds: tuple[int, int], out_fds: tuple[int, int], listen_fd: int | None = None):
        """Fork a worker from the zygote; a zygote that died is started again once (on the spawner thread).
        `listen_fd`: a socket the worker inherits (a group's rank 0: its store's, shared.messages.LISTEN_FD_ENV)."""
        with self._zygote_lock:
            try:
                if self._zygote is None or not self._zygote.alive:
                    old, self._zygote = self._zygote, None
                    if old is not None:
                        old.close()
                    self._start_zygote()
                if not self._zygote.forkable:
                    # the imports touched CUDA on this machine: a fork would not be safe; spawn instead (an inherited
                    # fd keeps its number)
                    extra = () if listen_fd is None else (listen_fd,)
                    if listen_fd is not None:
                        env = {**env, LISTEN_FD_ENV: str(listen_fd)}
                    return self._spawner.submit(spawn, env, fds, out_fds, self._pool_fds + extra).result()
                return self._zygote.fork([], env, fds, out_fds, listen_fd)
            except ZygoteLost as exc:
                raise WorkerLost(exc.reason, exc.log_tail) from None

    def _start_worker(self, slot: Slot, on_hello=lambda: None) -> Worker | Group:
        """A ready worker for `slot`: the child sees only the slot's GPU (as cuda:0), or none on CPU. `on_hello()`:
        the child exists and has its Hello (Worker.start). A calibrated export on a group (plan.world > 1): the
        slot's worker is the Group of every rank (supervisor.group), one per device."""
        w = self._start_group(slot, on_hello) if self.plan.world > 1 and not slot.planner else \
            self._start_one(slot, slot.device, slot.id, on_hello)
        if self.plan.calibration is not None and not slot.planner:
            self._settle_arithmetic(w)
        return w

    def _settle_arithmetic(self, w: Worker | Group) -> None:
        """What the calibrated workers compute with, as they report it: refused when the journal holds layers computed
        otherwise (before they export one), journaled when it is new."""
        ranks = w.ranks if isinstance(w, Group) else [w]
        rec = journal.Arithmetic(threads=[x.ready.threads for x in ranks],
                                 devices=[x.ready.device_model for x in ranks])
        calibration.check_arithmetic(self.plan.output, self._arithmetic,
                                     self._had_layers or any(i >= 0 for i in self._done), rec.threads, rec.devices)
        if rec != self._arithmetic:
            self._journal.append(rec)
            self._arithmetic = rec

    def _start_group(self, slot: Slot, on_hello) -> Group:
        self._check_cancel()
        world, devs = self.plan.world, self.plan.devices
        rank_devices = [devs[r] for r in range(world)] if devs != ["cpu"] else ["cpu"] * world

        def start_rank(spec, cancelled, register, listen_fd) -> Worker:
            return self._start_one(slot, rank_devices[spec.rank], spec.rank, on_hello if spec.rank == 0 else
                                   (lambda: None), group=spec, sharing=world if devs == ["cpu"] else 1,
                                   cancelled=cancelled, register=register, listen_fd=listen_fd)

        cluster = self.plan.cluster
        g = Group.start(world, start_rank, cancelled=self._cancel.is_set, timeout=self.job.resources.collective_timeout,
                        backend="gloo" if devs == ["cpu"] else "nccl",
                        rendezvous=(lambda: cluster.rendezvous(0)) if cluster is not None else None)
        slot.worker = g
        return g

    def _start_one(self, slot: Slot, device: str, worker_id: int, on_hello=lambda: None, *, group=None,
                   sharing: int | None = None, cancelled=None, register=None, listen_fd: int | None = None) -> Worker:
        """One worker on `device` (a group's rank `worker_id` when `group` is its GroupSpec; `listen_fd`: rank 0's
        store socket on this host, supervisor.group)."""
        from supervisor import devices

        self._check_cancel()
        plan, r, cluster = self.plan, self.job.resources, self.plan.cluster
        child_device = "cpu" if device == "cpu" else "cuda:0"
        job = self.job
        agent = None
        if cluster is not None:  # this slot's seat and node host (a group's rank r: seat r; the planner: seat 0)
            agent = cluster.agent(worker_id if group is not None else 0 if slot.planner else slot.id,
                                  wait=ROOM_POLL if slot.parked else cluster_place_seconds())
            # CPU workers on one node split its cores; each GPU seat has a GPU of its own
            sharing, cores = (cluster.on_node(agent) if device == "cpu" else 1), agent.cpus
        else:
            # the slots on this slot's device: CPU workers split the cores; GPU workers may take turns on their GPU
            if sharing is None:
                sharing = sum(s.device == device for s in self._scheduler.slots) if self._scheduler else 1
            cores = os.cpu_count() or 1
        threads = devices.worker_threads(r.torch_threads, device, sharing, cores)
        if threads != r.torch_threads:
            job = msgspec.structs.replace(job, resources=msgspec.structs.replace(r, torch_threads=threads))
        lock = layout.device_lock(plan.output, device) if group is None and agent is None and \
            devices.device_stage_shared(device, sharing, self._layer_bytes) else ""
        hello = Hello(version=PROTOCOL_VERSION, job=job, output=plan.output, device=child_device, worker=worker_id,
                      calibration_sha256=plan.calibration.sha256 if plan.calibration else "",
                      pool=self._pool_spec, device_lock=lock, group=group)
        log = layout.state_path(plan.output, layout.LOGS,
                                f"rank-{worker_id}.log" if group is not None else f"worker-{slot.id}.log")
        if agent is not None:
            from supervisor.remote import RemoteWorker

            # rank 0: its node's host hands it the store socket it bound for this port (Cluster.rendezvous)
            env = {**agent.env, LISTEN_PORT_ENV: str(group.port)} if group is not None and group.rank == 0 else \
                agent.env
            w = RemoteWorker(hello, log, env, startup_timeout=r.startup_timeout,
                             heartbeat_timeout=r.heartbeat_timeout, host=agent.host_actor, listener=cluster.listener,
                             where=agent.where,
                             cancelled=cancelled or self._cancel.is_set)
        else:
            env = devices.child_env(device, dict(os.environ))
            env["PYTHONUNBUFFERED"] = "1"
            if group is not None:  # the ranks' gloo and NCCL sockets on loopback, as the store
                env.update(data_plane_env(interface_holding(group.host)))
            fork = self._fork if listen_fd is None else functools.partial(self._fork, listen_fd=listen_fd)
            w = Worker(hello, log, env, startup_timeout=r.startup_timeout, heartbeat_timeout=r.heartbeat_timeout,
                       fork=fork, on_log=self._on_log)
        if register is not None:
            register(w)  # the group kills it if another rank fails to start
        else:
            slot.worker = w  # so a stop or kill reaches it while it starts
        t = time.monotonic()
        beat = self._on_heartbeat if group is None or group.rank == 0 else (lambda hb: None)
        ready = w.start(cancelled or self._cancel.is_set, beat, on_hello)
        check_layers(ready, plan.source)
        self._check_gpu_room(ready, device, sharing if slot.optional else 1)
        now = time.monotonic()
        if not slot.planner:  # the export plan's worker exports no part: not one of the run's workers to a reader
            self._emit(ev.WorkerStarted(pid=ready.pid, device=device, seconds=round(now - t, 3), worker=worker_id,
                                        where=w.where,
                                        since_death=None if slot.died_at is None else round(now - slot.died_at, 3),
                                        gpu_free=ready.gpu_free, gpu_total=ready.gpu_total))
        p = self._progress
        if p is not None and p.done == p.done_at_start:
            p.start = time.monotonic()  # rates measure exporting, not the first worker's imports
        return w

    @property
    def _layer_bytes(self) -> int:
        """A decoder layer's source bytes, on average."""
        return self.plan.source.nbytes // max(self.plan.source.num_layers, 1)

    def _layer_need(self) -> int:
        # A layer in flight: its tensors, the next layer read ahead, and the quantized copy (~2.5x a layer).
        return int(2.5 * self._layer_bytes)

    def _precheck_gpu(self) -> None:
        """Before a child starts: if this process already uses CUDA (a studio holding its model), ask the device
        for its free memory now, after the release. The CLI never initializes CUDA here (a context costs
        ~0.5 GB of the very memory we want free); the worker then measures it itself (_check_gpu_room)."""
        import sys
        torch = sys.modules.get("torch")
        if self.plan.device == "cpu" or torch is None or not torch.cuda.is_initialized():
            return
        from supervisor import devices
        for device in self.plan.devices:
            devices.check_free_memory(device, self._layer_need() + (512 << 20))  # + the child's context

    def _check_gpu_room(self, ready, device: str | None = None, workers: int = 1) -> None:
        """Refuse a GPU that cannot hold a layer: the worker measured its free memory after starting. `workers` > 1:
        a worker the default count added (Slot.optional), which starts only where the GPU holds the layers of all
        `workers` workers on it (they start side by side, so a worker's measurement may not yet see the others')."""
        device = device or self.plan.device
        if not ready.gpu_total:
            return
        need = self._layer_need() * workers
        if ready.gpu_free >= need:
            return
        free = f"{device} has {ready.gpu_free / 2**30:.1f} GiB free as the worker sees it"
        if workers > 1:
            raise NoRoom(f"{free}, {workers} workers' layers there need about {need / 2**30:.1f} GiB; going on "
                         "with fewer (set [resources] workers to choose the count)")
        raise NoRoom(f"{free}, a layer needs about {need / 2**30:.1f} GiB: free memory on that GPU (or hand the live "
                     "model to Supervisor(model=...)), or set [resources] device to another one")

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
            group = self._scheduler.slots[0].worker if self.plan.world > 1 and self._scheduler else None
            self._emit(p.event(worker_rss=hb.rss, stage=hb.stage, index=hb.index,
                               ranks=group.alive if isinstance(group, Group) else 0))

    def _record(self, reply: LayerWritten, w: Worker | None, retries: int) -> None:
        """Journal a written part (the scheduler calls this one part at a time, with its failed attempts; `w`, the
        worker that wrote it, is the scheduler's to account: None for the non-layer part this process copied)."""
        path = os.path.join(self.plan.output, reply.file)
        if reply.file != layout.shard_name(reply.index) or not os.path.isfile(path) \
                or os.path.getsize(path) != reply.nbytes:
            raise ExportFailed(f"worker reported {reply.file} but it is not on disk as described", index=reply.index)
        settled = self._check_boundary(reply)
        if settled is not None:  # the inputs of this layer, left pending by the reply before: durable now
            self._journal_boundary(reply.index - 1, [settled])
        again = reply.index in self._done  # a layer redone from an earlier boundary (Scheduler: restart)
        rec = journal.Shard(index=reply.index, file=reply.file, digest=reply.digest, nbytes=reply.nbytes,
                            seconds=round(reply.seconds, 3), ino=reply.ino, mtime_ns=reply.mtime_ns,
                            source_bytes=reply.source_bytes, peak_rss=reply.peak_rss, peak_gpu=reply.peak_gpu,
                            retries=retries, quant_error=reply.quant_error, stages=reply.stages,
                            boundary=reply.boundary, boundaries=reply.boundaries, losses=reply.losses,
                            ranks=reply.ranks, source_digest=reply.source_digest,
                            where=w.where if w is not None else self._here)
        self._journal.append(rec)
        self._done[reply.index] = rec
        last = reply.index == self.plan.source.num_layers - 1
        if self.plan.calibration is not None and reply.index >= 0 and (journal.boundaries(rec) or last):
            # journaled: the new boundary is the only one the next layer needs, so the one before it is spent (the
            # last layer needs none; a pending one stays the newest until it is named durable)
            spent, self._boundary = self._boundary, journal.boundaries(rec)
            for b in spent or []:  # it fed this layer; _check_boundary held the new one to the next layer's name
                self._discard(os.path.join(self.plan.output, b.file))
        self._emit(ev.LayerWritten(index=reply.index, file=reply.file, nbytes=reply.nbytes,
                                   seconds=round(reply.seconds, 3), peak_rss=reply.peak_rss, peak_gpu=reply.peak_gpu,
                                   retries=retries, quant_error=reply.quant_error, stages=reply.stages,
                                   ranks=reply.ranks, losses=reply.losses, where=rec.where))
        if not again:
            self._progress.add(reply.source_bytes, reply.nbytes)
        self._emit(self._progress.event(worker_rss=reply.rss))

    def _place(self, reply: LayerWritten) -> None:
        """Move the shard the replying attempt staged (named by its fence, the one this run sent) to its name (the
        scheduler calls this as it takes the reply; journaled then, or after the plan's verdict). Only the attempt
        the scheduler waited on gets here; a worker that outlived its attempt staged under another fence, which
        nothing places (shared/messages.py, Fencing). A group rank other than 0 stages no shard."""
        if not reply.file:
            return
        out = self.plan.output
        staged = os.path.join(out, layout.staged_name(reply.index, reply.fence))
        try:
            st = os.stat(staged)
        except OSError:
            st = None
        if not reply.fence or st is None or st.st_size != reply.nbytes or st.st_ino != reply.ino:
            raise ExportFailed(f"worker reported {layout.shard_name(reply.index)} staged as attempt {reply.fence!r}, "
                               "but no such file is on disk as described", index=reply.index)
        durable.place(staged, os.path.join(out, layout.shard_name(reply.index)))

    @property
    def _here(self) -> str:
        """Where a part this process wrote itself (the non-layer copy) was written: named on a cluster only."""
        if self.plan.cluster is None:
            return ""
        import socket

        return f"{socket.gethostname()} (the supervisor)"

    def _refused(self, peer: str, reason: str) -> None:
        """A connection to the run's port closed unread (supervisor.remote): logged under .export/logs, an event."""
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} refused a connection from {peer}: {reason}\n"
        with contextlib.suppress(OSError), open(layout.state_path(self.plan.output, layout.LOGS, "cluster.log"), "a") as f:
            f.write(line)
        self._emit(ev.ConnectionRefused(peer=peer, reason=reason))

    def _discard(self, path: str) -> None:
        """Unlink a spent boundary file in the background: freeing a 2 GB file's cached pages takes ~0.45 s, which
        would otherwise sit between one calibrated layer and the next. Only that one file is named, never a newer
        one the worker is writing; one left behind by a crash is pruned when the export resumes (_verified)."""
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deleter")
        self._deleter.submit(durable.unlink_quietly, path)

    def _should_recycle(self, w: Worker) -> bool:
        r = self.job.resources
        by_count = r.recycle_after_layers and w.layers_done >= r.recycle_after_layers
        by_rss = r.recycle_above_rss_mb and w.rss > r.recycle_above_rss_mb * 1024 * 1024
        return bool(by_count or by_rss)

    def _finalize(self, done: dict[int, journal.Shard]) -> None:
        out = self.plan.output
        staging = layout.state_path(out, layout.STAGING)
        reply = self._scheduler.write_config(staging)
        finalize.place_config(reply.path, out)
        shutil.rmtree(staging, ignore_errors=True)  # the attempts' folders (a failed one's config.json among them)
        shards = finalize.shard_files(self.plan.source.num_layers)
        finalize.write_index(out, shards)
        finalize.copy_side_files(self.plan.source.path, out)
        # the folder as a loader sees it: every weight must land where transformers expects it (no random experts)
        checked = self._scheduler.request(CheckLoad(folder=out, known=self._plan_load), LoadChecked,
                                          "the loader check")
        self._scheduler.close()
        problem = load_problems(checked.load)
        if problem and not self._lifted(checked.load):
            raise ExportFailed(f"the export in {out!r} does not load correctly in transformers: {problem}")
        files = finalize.output_files(out, {r.file: r.digest for r in done.values()})
        self._journal.append(journal.Finalized(files=files))
        finalize.write_done(out, files)


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

    def event(self, worker_rss: int = 0, stage: str = "", index: int | None = None, ranks: int = 0) -> ev.Progress:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        finished_now = self.done - self.done_at_start
        eta = (elapsed / finished_now) * (self.total - self.done) if finished_now else None
        return ev.Progress(done=self.done, total=self.total, bytes_written=self.bytes_written,
                           mb_per_s=round(self.bytes_read / elapsed / 1e6, 2),
                           eta_s=None if eta is None else round(eta, 1), worker_rss=worker_rss, stage=stage,
                           index=index, ranks=ranks)


def check_layers(ready, source: SourceInfo) -> None:
    if ready.num_layers != source.num_layers or ready.layer_prefix != source.layer_prefix:
        raise SourceError(f"the model class sees {ready.num_layers} layers under {ready.layer_prefix!r} but the "
                          f"weights hold {source.num_layers} under {source.layer_prefix!r}; "
                          "this architecture is not supported")
