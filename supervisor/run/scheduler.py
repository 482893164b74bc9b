"""The queue of parts and the workers that export them: which worker gets what, retries, backoff, recycling.

    Scheduler.run(todo)
      parts to do (ascending) ─▶ queue ─┬─▶ slot 0 thread ── Worker (cuda:0 | cpu) ── ExportLayer ─▶ child
                                        └─▶ slot 1 thread ── Worker (cuda:1 | cpu) ── …
      LayerWritten ─▶ on_written(reply, worker, retries) (journal, events), one at a time under one lock
      a part that failed ─▶ back to the queue (attempt + 1); its slot backs off, then starts a fresh worker
      a part out of attempts, a full disk, a worker that sees another model ─▶ abort: every slot stops, raise
      a failure the child marks as certain to repeat (Failed.retry False) ─▶ abort at once, no retry
      a part handed off (hand_off) ─▶ the caller writes it (supervisor.run.verbatim) ─▶ landed (journaled) | take_back

Each slot owns one worker process at a time and sends it one part at a time, so every failure is charged to
exactly the part that was in flight (a worker with several parts in flight could not say which one killed it).
Throughput comes from several slots: on a GPU their reads, copies and writes overlap, and the output does not
depend on which slot wrote which part. A slot takes the first waiting part (with several slots the non-layer part,
then the layers in order) and reserves the next one as its read-ahead hint. Calibrated exports run with one slot
(whose worker is a group of W ranks when the export calibrates on several: supervisor.workers.group, one worker to this
module) and strictly in order (a part's inputs are the previous part's outputs); a failed part then comes back first,
before anything after it, and each request names the journaled inputs of its layer (`boundary(index)`) for a
fresh worker that does not hold them in memory; where none are journaled yet (a worker on its own makes them durable
beside the next layer, shared/messages.py), the layers from the newest journaled boundary (`restart(index)`) are
exported again first.
Owns scheduling only: it never touches the journal or files itself (on_written does) and never quantizes.
"""
from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from shared.messages import (NON_LAYER, Boundary, ConfigWritten, ExportLayer, Failed, Heartbeat, LayerWritten,
                             WriteConfig)
from supervisor import events as ev
from supervisor.errors import Cancelled, ExportFailed, NoRoom, SourceError, SupervisorError
from supervisor.workers.worker import CancelledWait, Worker, WorkerLost

MAX_BACKOFF = 10.0


def for_good(failed: Failed, what: str) -> SupervisorError:
    """A failure the child says would repeat: bad input (exit 2) when it refused the job, else a failed export."""
    message = " ".join(failed.message.split())  # one line, whatever the library's message looked like
    if failed.refused:
        return SourceError(message)
    return ExportFailed(f"{what} failed: {failed.kind}: {message} (not retried: the same input fails the same way)",
                        index=failed.index, traceback=failed.traceback)


def part_name(index: int) -> str:
    return "the non-layer shard" if index == NON_LAYER else f"layer {index}"


@dataclass
class Slot:
    """One worker position: the device its workers see, and the worker it has now."""

    id: int
    device: str  # the supervisor's name for it: "cpu" or "cuda:N"
    worker: Worker | None = None
    reserved: int | None = None  # the part this slot will take next (its read-ahead hint)
    died_at: float | None = None  # when its last worker was lost, for the restart-latency event
    planner: bool = False  # the export plan's worker (Scheduler.judge_beside): it exports no part
    optional: bool = False  # added by the default count beyond one per GPU: left out when its GPU has no room (NoRoom)
    elastic: bool = False  # a cluster slot: left out while its node is gone, back once Ray has room for it again
    parked: bool = False  # an elastic slot waiting for room (its worker starts ask Ray briefly, not for long)
    holds: int | None = None  # sequential (calibrated): the layer whose inputs its worker holds in memory


@dataclass
class _Queue:
    """Parts waiting, attempts per part; guarded by Scheduler._cond.

    Layers in ascending order. The non-layer part (embeddings, lm_head: often the biggest part, several layers'
    bytes) comes first when several slots share the queue, so it runs beside the layers instead of alone after
    them (measured on one H200, 8B FP8: 2.2 s alone at the end); with one slot it comes last."""

    non_layer_first: bool = False
    waiting: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    again: set[int] = field(default_factory=set)  # written already, exported again for their outputs: not charged

    def put(self, index: int) -> None:
        if index not in self.waiting:
            self.waiting.append(index)
            self.waiting.sort(key=self._order)

    def take(self) -> int | None:
        return self.waiting.pop(0) if self.waiting else None

    def _order(self, index: int) -> int:
        if index != NON_LAYER:
            return index
        return -1 if self.non_layer_first else 1 << 62


class Scheduler:
    """Runs parts on a pool of slots until every part is written, one fails for good, or the run is cancelled.

    `start_worker(slot, on_hello)` returns a ready Worker for the slot (its checks may raise SupervisorError: fatal),
    calling `on_hello()` once the child exists, before its Ready.
    `on_written(reply, worker, retries)` journals a part (retries: its failed attempts before this one; worker: the
    one that wrote it, None for a part the caller wrote itself, see hand_off); it is called under one lock, from the
    slot's thread, or the planner's for parts written ahead of the plan's verdict. `place(reply)` gives the shard the
    replying attempt staged its name, on the slot's thread, as soon as the reply is taken (before any journaling): the
    only attempt whose files are placed is the one the slot waited on. `recycle(worker)` is asked after each part the
    worker wrote (its layers_done and rss updated then); `settle(worker)` runs before a worker is recycled.
    """

    def __init__(self, slots: list[Slot], *, max_attempts: int, part_timeout: float, retry_delay: float,
                 sequential: bool, cancel: threading.Event, emit: Callable[[ev.Event], None],
                 start_worker: Callable[[Slot, Callable[[], None]], Worker],
                 on_written: Callable[[LayerWritten, Worker | None, int], None],
                 on_heartbeat: Callable[[Heartbeat], None], recycle: Callable[[Worker], bool],
                 place: Callable[[LayerWritten], None] = lambda reply: None,
                 settle: Callable[[Worker], None] = lambda worker: None,
                 boundary: Callable[[int], list[Boundary] | None] = lambda index: None,
                 restart: Callable[[int], int] = lambda index: index, room_timeout: float = 0.0):
        if sequential and len(slots) != 1:
            raise ValueError("a sequential export runs on exactly one slot")
        self.slots = slots
        self.max_attempts, self.part_timeout, self.retry_delay = max_attempts, part_timeout, retry_delay
        self.sequential = sequential
        self.cancel = cancel
        self.emit, self.start_worker, self.on_written = emit, start_worker, on_written
        self.on_heartbeat, self.recycle, self.place, self.settle = on_heartbeat, recycle, place, settle
        self.boundary = boundary  # calibrated: the journaled inputs of a layer, for workers without them
        self.restart = restart  # calibrated: where to start again when a layer's inputs are neither journaled nor held
        self.room_timeout = room_timeout  # elastic slots: how long all of them may wait for room before the run fails
        self._cond = threading.Condition()
        self._record = threading.Lock()
        self._q = _Queue(non_layer_first=len(slots) > 1 and not sequential)
        self._abort = threading.Event()
        self._error: BaseException | None = None
        self.planner = Slot(id=len(slots), device=slots[0].device, planner=True)
        self._beside: _JudgedBeside | None = None  # the export plan judged while the first parts run
        self._handed: set[int] = set()  # parts handed off to the caller (hand_off)

    # ---- the export plan, judged while the first parts run --------------------------------------------------
    def judge_beside(self, judge: Callable[[Slot], None]) -> None:
        """Run `judge(slot)` while run() exports the first parts: requests about the whole export (the export plan,
        Describe: every part predicted and transformers' loader run on the prediction) on the slot's worker, one
        of its own (`request(..., slot=slot)`); it raises to refuse the export.
        Until the verdict, parts are exported (LayerStarted, Retrying) but none is journaled: on_written (and with
        it LayerWritten) comes after it, from the planner's thread. A refusal ends the run with it (the shards
        written ahead are the caller's to remove), and a part's own failure waits for the verdict, so that a
        refusal is always what the run reports. The parts' workers start once the planner's child exists (forked,
        its Hello sent) and while it finishes starting; a failure to start it is retried as the export plan's.
        run() returns after the verdict."""
        self._beside = _JudgedBeside(self, judge)
        self._beside.thread.start()
        while not self._beside.up.wait(0.1):
            if self._stopping():
                break

    def _hold(self, reply: LayerWritten, w: Worker, retries: int) -> bool:
        """Whether a written part is not to be journaled now: kept to be journaled after the verdict (judging), or
        never (the export was refused; its shard is removed with the rest)."""
        with self._cond:
            return self._beside is not None and self._beside.hold(reply, w, retries)

    def _await_verdict(self) -> None:
        """Before a part's failure ends the run: the plan's verdict, so that a refusal of the whole export is what
        the run reports; and before a calibrated export reads the journal's boundaries (a rewind, a recycled worker's
        settle), so that the layers written ahead of the verdict are in it. Returns at once when not judging or when
        the run is cancelled."""
        if self._beside is not None:
            self._beside.wait(self.cancel)

    # ---- a part the caller writes itself (supervisor.run.verbatim: the non-layer part, copied while workers start) --
    def hand_off(self, index: int) -> None:
        """Before run(): part `index` is the caller's to write; no slot takes it unless take_back() returns it. It
        counts as running, so the slots wait for it before they finish."""
        with self._cond:
            self._handed.add(index)
            self._q.running.add(index)

    def landed(self, reply: LayerWritten) -> None:
        """A handed-off part is written and in place: journal it as a slot's part is (on_written, one at a time,
        never while the plan is being judged: the caller settles after the verdict). A run that is stopping does
        not journal it; the next run redoes it."""
        try:
            with self._record:
                if not self._stopping():
                    self.on_written(reply, None, 0)
        except BaseException as exc:  # noqa: BLE001 - fatal, as from a slot (a journal on a full disk)
            self._fail(exc)
        with self._cond:
            self._q.running.discard(reply.index)
            self._cond.notify_all()

    def take_back(self, index: int) -> None:
        """A handed-off part the caller did not write: a slot exports it, with no attempt charged."""
        with self._cond:
            self._q.running.discard(index)
            self._q.put(index)
            self._cond.notify_all()

    @property
    def stopping(self) -> bool:
        """The run is cancelled or ending on an error: nothing more starts."""
        return self._stopping()

    # ---- the parts -----------------------------------------------------------------------------------------
    def run(self, todo: list[int]) -> None:
        """Export every part in `todo` (those handed off are the caller's); raises the first fatal error, Cancelled,
        or ExportFailed."""
        with self._cond:
            for i in todo:
                if i not in self._handed:  # landed already, or the caller's still, or back in the queue
                    self._q.put(i)
        threads = [threading.Thread(target=self._slot_main, args=(s,), name=f"slot-{s.id}", daemon=True)
                   for s in self.slots]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # bounded: every slot's request has the part timeout
        if self._beside is not None:
            self._beside.thread.join()  # bounded: the planner's request has the part timeout
        if self._error is not None:
            raise self._error
        if self.cancel.is_set():
            raise Cancelled()

    def _stopping(self) -> bool:
        return self.cancel.is_set() or self._abort.is_set()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._abort.set()
            self._cond.notify_all()

    def _next(self, slot: Slot) -> int | None:
        """The part this slot exports next (its reserved one first), reserving the one after; None: no more."""
        with self._cond:
            while True:
                if self._stopping():
                    return None
                index = slot.reserved if slot.reserved is not None else self._q.take()
                slot.reserved = None
                if index is not None:
                    self._q.running.add(index)
                    slot.reserved = self._q.take()
                    return index
                if not self._q.running:
                    return None  # nothing waiting, nothing that could come back
                self._cond.wait(0.2)  # another slot's part may fail and come back

    def _done(self, slot: Slot, index: int, requeue: bool) -> None:
        with self._cond:
            self._q.running.discard(index)
            if requeue:
                self._q.put(index)
            if slot.reserved is not None and (requeue or self.sequential):
                # the reserved part must not run before a failed one in order (calibration); and a slot that
                # backs off should not sit on work another slot could do
                self._q.put(slot.reserved)
                slot.reserved = None
            self._cond.notify_all()

    def _slot_main(self, slot: Slot) -> None:
        try:
            while True:
                try:
                    while (index := self._next(slot)) is not None:
                        self._export_one(slot, index)
                    return
                except NoRoom as exc:
                    if not slot.optional:
                        raise
                    # an extra worker its GPU cannot hold, or a cluster slot whose node is gone: the others go on;
                    # its part is back in the queue already
                    self._drop(slot, kill=True)
                    self.emit(ev.WorkerLeftOut(worker=slot.id, device=slot.device, reason=str(exc)))
                    if not (slot.elastic and self._await_room(slot)):
                        return
        except Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - fatal: stop every slot, raise it from run()
            self._await_verdict()  # a refusal of the whole export comes first
            self._fail(exc)
        finally:
            with self._cond:
                if slot.reserved is not None:
                    self._q.put(slot.reserved)
                    slot.reserved = None
                self._cond.notify_all()
            if slot.id != 0 or self._stopping():
                self._drop(slot, kill=self._stopping())

    def _await_room(self, slot: Slot) -> bool:
        """An elastic slot left out (its node gone): start its worker again once there is room (a node came back),
        while parts remain; False when the run ends first or its starts keep failing."""
        slot.parked = True
        failures = 0
        all_parked_since = None
        try:
            while not self._stopping():
                with self._cond:
                    if not self._q.waiting and not self._q.running:
                        return False  # nothing left that it could take
                if all(s.parked for s in self.slots):
                    all_parked_since = all_parked_since or time.monotonic()
                    if time.monotonic() - all_parked_since > self.room_timeout:
                        raise NoRoom(f"no node of the cluster has had room for any worker for "
                                     f"{self.room_timeout:.0f}s; add nodes and run the same job again to resume")
                else:
                    all_parked_since = None
                try:
                    slot.worker = self.start_worker(slot, lambda: None)
                    return True
                except NoRoom:
                    pass  # not yet: the start asked Ray briefly
                except (WorkerLost, CancelledWait):
                    self._drop(slot, kill=True)
                    failures += 1
                    if failures >= self.max_attempts:
                        return False
                    if self._wait(min(self.retry_delay * 2 ** failures, MAX_BACKOFF)):
                        return False
            return False
        finally:
            slot.parked = False

    def _rewinds(self, slot: Slot, index: int) -> bool:
        """Calibrated: layer `index`'s inputs are neither journaled (their file was still being made durable) nor
        held by this slot's worker (a fresh one): the layers from the newest journaled boundary go first, again
        (their shards are rewritten with the same bytes, no attempt charged). True: requeued, nothing sent. Parts
        written ahead of the plan's verdict are journaled with it: it is awaited first, so the layers redone are those
        a plan judged before the parts would redo."""
        if not self.sequential or index <= 0 or (slot.worker is not None and slot.holds == index):
            return False
        self._await_verdict()
        if self.boundary(index):
            return False
        start = self.restart(index)
        if start >= index:
            return False
        with self._cond:
            for j in range(start, index):
                self._q.put(j)
                self._q.again.add(j)
        self._done(slot, index, requeue=True)
        return True

    def _export_one(self, slot: Slot, index: int) -> None:
        if self._rewinds(slot, index):
            return
        with self._cond:
            if index in self._q.again:  # written already, exported once more for its outputs: not a retry
                self._q.again.discard(index)
                attempt = self._q.attempts.get(index, 1)
            else:
                attempt = self._q.attempts.get(index, 0) + 1
                self._q.attempts[index] = attempt
        inputs = self.boundary(index) or []  # calibrated: one file, or one per rank of a group
        # a fence of its own per attempt: the names of every file it writes, so only this attempt's can land
        msg = ExportLayer(index=index, attempt=attempt, fence=secrets.token_hex(8), prefetch=slot.reserved,
                          boundary=inputs[0] if len(inputs) == 1 else None, boundaries=inputs if len(inputs) > 1 else [])
        try:
            reply, w = self._request(slot, msg, LayerWritten, index, attempt)
            if reply is not None:
                if reply.fence != msg.fence:  # a protocol bug, never a late writer: it has no pipe to us
                    raise ExportFailed(f"worker answered {part_name(index)}'s attempt {msg.fence} with attempt "
                                       f"{reply.fence!r}'s shard", index=index)
                self.place(reply)  # this attempt's staged shard to its name (journaled now or after the verdict)
        except BaseException as exc:
            if isinstance(exc, NoRoom):  # its worker could not start there: the part was not attempted
                with self._cond:
                    self._q.attempts[index] = attempt - 1
            self._done(slot, index, requeue=True)
            raise
        if reply is None:  # failed, charged, announced; back to the queue
            self._done(slot, index, requeue=True)
            return
        w.layers_done += 1  # counted when written, journaled now or after the plan's verdict: recycling (by
        w.rss = reply.rss  # count or by RSS) applies to the parts written ahead of the verdict too
        slot.holds = index + 1 if self.sequential and index >= 0 else None
        if not self._hold(reply, w, attempt - 1):  # else journaled once the plan is judged; the slot goes on
            with self._record:
                self.on_written(reply, w, attempt - 1)
        self._done(slot, index, requeue=False)
        if self.recycle(w):
            if self.sequential:  # a calibrated worker's pending inputs follow its layers into the journal
                self._await_verdict()
            with self._record:  # what it journals (a calibrated worker's pending inputs) is journaled as a part is
                self.settle(w)
            self._drop(slot, kill=False)

    # ---- one request on a slot's worker, failures classified ---------------------------------------------
    def _request(self, slot: Slot, msg, success: type, index: int | None, attempt: int, what: str | None = None):
        """Send msg (about part `index`, None: the whole export, `what` names it) to the slot's worker, started if
        needed. Returns (reply, worker) on success, (None, None) after a retryable failure (announced, backed off);
        raises when the failure is final: out of attempts, a full disk, or one the child says would repeat."""
        what = what or part_name(index)  # a request about the whole export (index None) names itself
        try:
            w = self._worker(slot)
            if index is not None:
                self.emit(ev.LayerStarted(index=index, attempt=attempt, worker=slot.id))
            timeout = self.part_timeout if index is not None else 0.0
            reply = w.request(msg, self._stopping, self.on_heartbeat, timeout=timeout)
            if isinstance(reply, success):
                return reply, w
            if isinstance(reply, Failed):
                if reply.errno == errno.ENOSPC:
                    raise ExportFailed(f"disk full while writing {what}: free some space and run again to resume",
                                       index=index, traceback=reply.traceback)
                if not reply.retry or reply.refused:
                    self._drop(slot, kill=True)
                    raise for_good(reply, what)
                reason, trace = f"{reply.kind}: {reply.message}", reply.traceback
            else:
                reason, trace = f"unexpected reply {type(reply).__name__}", ""
        except WorkerLost as exc:
            if exc.failed is not None and (not exc.failed.retry or exc.failed.refused):
                self._drop(slot, kill=True)
                raise for_good(exc.failed, "starting the worker") from None
            reason, trace = exc.reason, exc.log_tail
        except CancelledWait:
            raise Cancelled() from None
        # Whatever went wrong, the next attempt gets a fresh process: a failed child's state is suspect.
        self._drop(slot, kill=True)
        slot.died_at = time.monotonic()
        if attempt >= self.max_attempts:
            raise ExportFailed(f"{what} failed {self.max_attempts} times; last error: {reason}", index=index,
                               traceback=trace)
        delay = min(self.retry_delay * 2 ** (attempt - 1), MAX_BACKOFF)
        self.emit(ev.Retrying(index=index, attempt=attempt + 1, reason=reason, delay=delay, what=what))
        if self._wait(delay):
            raise Cancelled()
        return None, None

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the run stops first; True if it did."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._stopping():
                return True
            self.cancel.wait(min(left, 0.1))
        return self._stopping()

    def _worker(self, slot: Slot) -> Worker:
        if slot.worker is None:
            if self._stopping():
                raise CancelledWait()
            # the parts' workers start while the planner's finishes starting (its Ready: a CUDA context, ~0.4 s)
            slot.worker = self.start_worker(slot, self._beside.up.set if slot.planner and self._beside else lambda: None)
        return slot.worker

    def _drop(self, slot: Slot, kill: bool) -> None:
        w, slot.worker, slot.holds = slot.worker, None, None
        if w is not None:
            w.kill() if kill else w.stop()

    # ---- finalize and shutdown -----------------------------------------------------------------------------
    def write_config(self, staging: str) -> ConfigWritten:
        """config.json on slot 0's worker, with the same retries as a part, each attempt into a folder of its own
        under `staging` (a late writer's is never the one placed)."""
        sent: list[WriteConfig] = []

        def attempt() -> WriteConfig:
            sent.append(WriteConfig(dest=os.path.join(staging, secrets.token_hex(8))))
            return sent[-1]

        reply = self.request(attempt, ConfigWritten, "config.json")
        if os.path.dirname(os.path.abspath(reply.path)) != os.path.abspath(sent[-1].dest):
            raise ExportFailed(f"worker wrote config.json at {reply.path!r}, not into {sent[-1].dest!r} as asked")
        return reply

    def request(self, msg, success: type, what: str, slot: Slot | None = None):
        """One request about the whole export (config.json, the plan, the loader check) on slot 0's worker (or
        `slot`'s), with the same retries as a part; returns the `success` reply. `msg`: the message, or a function
        that makes each attempt's."""
        # slot 0's, or (a cluster slot left out while its node is gone) the first slot that has a worker
        slot = slot if slot is not None else next((s for s in self.slots if s.worker is not None and not s.parked),
                                                  self.slots[0])
        for attempt in range(1, self.max_attempts + 1):
            if self.cancel.is_set():
                raise Cancelled()
            reply, _ = self._request(slot, msg() if callable(msg) else msg, success, None, attempt, what)
            if reply is not None:
                return reply
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def close(self) -> None:
        """Stop every worker (idempotent): all are asked first, so they wind down side by side."""
        if self._beside is not None:
            self._beside.thread.join()  # bounded: a stopping run ends it within a poll
        for slot in self.slots:
            if slot.worker is not None:
                slot.worker.ask_to_stop()
        for slot in self.slots:
            self._drop(slot, kill=False)


class _JudgedBeside:
    """The export plan judged on the planner slot's worker while the scheduler exports the first parts
    (Scheduler.judge_beside): the parts written meanwhile are held, and journaled after a good verdict, in order,
    under the scheduler's record lock; after a refusal never (the run fails with the refusal first)."""

    def __init__(self, scheduler: Scheduler, judge: Callable[[Slot], None]):
        self._s = scheduler
        self.verdict = threading.Event()  # set once the plan is judged
        self.up = threading.Event()  # the planner's child exists (or the plan ended)
        self.refused = False
        self._held: list[tuple[LayerWritten, Worker, int]] = []  # parts written, to journal after the verdict
        self.thread = threading.Thread(target=self._run, args=(judge,), name="planner", daemon=True)

    def hold(self, reply: LayerWritten, w: Worker, retries: int) -> bool:
        """Under the scheduler's condition: held for after the verdict (True), or journaled now unless refused."""
        if not self.verdict.is_set():
            self._held.append((reply, w, retries))
            return True
        return self.refused

    def wait(self, cancel: threading.Event) -> None:
        while not self.verdict.wait(0.1):
            if cancel.is_set():
                return

    def _run(self, judge: Callable[[Slot], None]) -> None:
        s = self._s
        refusal = None
        try:
            judge(s.planner)
        except BaseException as exc:  # noqa: BLE001 - the run's error, raised from run()
            refusal = exc
        try:
            if refusal is not None:
                s._fail(refusal)  # first: the run reports the refusal, not what it stops
            # the record lock across the verdict and the held parts: a part written after the verdict is journaled
            # after them (a calibrated layer's record names the inputs the one before it left pending)
            with s._record:
                with s._cond:
                    written, self._held = self._held, []
                    self.refused = refusal is not None
                    self.verdict.set()
                    s._cond.notify_all()
                if refusal is None:
                    for reply, w, retries in written:
                        s.on_written(reply, w, retries)
        except BaseException as exc:  # noqa: BLE001 - fatal, as from a slot
            s._fail(exc)
        finally:
            self.up.set()  # a planner that never came up: after _fail, so that no part starts
            s._drop(s.planner, kill=refusal is not None)  # after the verdict: its exit is no one's wait
