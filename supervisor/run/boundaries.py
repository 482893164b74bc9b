"""A calibrated export's boundaries: a layer's input activations, crossing from one layer to the next on disk.

    layer i's LayerWritten ── check(reply) ──▶ layer i+1's inputs under this attempt's fence (or `pending`: made
                                               durable beside layer i+1, named by the next reply's `settled`; or,
                                               the last layer's, none: in the one worker's RAM only)
    journaled with layer i ─▶ recorded(rec): the newest boundary; the one before is spent: kept in the temp folder
                                               as a spare while a boundary is still to be written (the workers
                                               rewrite it in place: durable.take_spare), else unlinked off the
                                               critical path, a thread of its own
    a worker recycled ─────▶ settle_before_stop(w): Settle, so its successor starts from the pending inputs
    resume(state) ─────────▶ after the last layer whose outputs are durable and good (journal.calibrated_resume)
    settle_arithmetic(w) ──▶ thread counts and device models, as the workers report them, held to the journal's

Owns these checks and records only; data-free exports never reach them (each method returns at once). It never
starts a worker (supervisor.run.launch) or decides about retries (supervisor.run.scheduler).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec

from shared import durable, layout
from shared.messages import Boundary, LayerWritten, Settle, Settled
from supervisor.checks import calibration
from supervisor.errors import ExportFailed
from supervisor.output import journal
from supervisor.run.plan import Plan
from supervisor.workers.group import Group
from supervisor.workers.worker import CancelledWait, Worker, WorkerLost


class Boundaries:
    def __init__(self, plan: Plan, done: dict[int, journal.Shard], cancel: threading.Event):
        """`done`: the run's journaled parts (shared: the run adds to it, this adds boundaries to its records)."""
        self.plan, self.done, self._cancel = plan, done, cancel
        self.journal: journal.Journal | None = None  # the run's, once open
        self.newest: list[Boundary] | None = None  # the newest journaled (durable) boundary: the next layer's inputs
        # one worker: (the layer whose inputs the last reply left pending, that reply's fence)
        self._pending: tuple[int, str] | None = None
        self._last_in_ram = False  # the last layer's inputs were kept in the worker's RAM, no file (check)
        self._arithmetic: journal.Arithmetic | None = None  # what the layers were computed with
        self._had_layers = False  # the journal held a layer when the run began
        self._deleter: ThreadPoolExecutor | None = None  # unlinks spent boundary files off the critical path

    @property
    def calibrated(self) -> bool:
        return self.plan.calibration is not None

    def begin(self, st: journal.State) -> None:
        self._arithmetic, self._had_layers = st.arithmetic, any(i >= 0 for i in st.shards)

    def resume(self, st: journal.State, done: dict[int, journal.Shard],
               redo: list[int]) -> tuple[dict[int, journal.Shard], list[int]]:
        """Continue after the last layer whose outputs (the boundary) are durable and good: every layer from there
        is redone, in order, starting from that boundary (journal.calibrated_resume)."""
        if not self.calibrated:
            return done, redo
        out, n = self.plan.output, self.plan.source.num_layers
        start, self.newest = journal.calibrated_resume(out, st, n, done, self.plan.world)
        redo = sorted(set(redo) | {i for i in done if i >= start})
        done = {i: r for i, r in done.items() if i < start}  # NON_LAYER (-1) stays when good
        journal.prune_boundaries(out, self.newest)
        return done, redo

    def boundary_for(self, index: int) -> list[Boundary] | None:
        """The journaled inputs of layer `index` (one file, or one per rank of a group), for workers that do not hold
        them in memory (None: none)."""
        bs = self.newest
        return bs if bs and all(b.feeds == index for b in bs) else None

    def restart_for(self, index: int) -> int:
        """The first layer to export again before layer `index` when no worker holds its inputs and none are
        durable: the one the newest durable boundary feeds (0: its inputs come from the samples)."""
        bs = self.newest
        return bs[0].feeds if bs and bs[0].feeds <= index else 0

    def check(self, reply: LayerWritten) -> Boundary | None:
        """Hold a calibrated reply's boundaries to what was asked: the next layer's inputs on disk under this
        attempt's fence, or pending; and a settled one (returned) under the fence of the reply that left it."""
        n, world = self.plan.source.num_layers, self.plan.world
        if not self.calibrated or reply.index < 0:
            return None
        settled, pending, self._pending = reply.settled, self._pending, None
        if settled is not None:
            self._check_settled(settled, pending, reply.index)
        if reply.index >= n - 1:
            return settled
        if reply.pending and world == 1 and reply.boundary is None:
            self._pending = (reply.index + 1, reply.fence)
            return settled
        if reply.index == n - 2 and world == 1 and reply.boundary is None:
            # the last layer's inputs, kept in the worker's RAM only (child/backends/calibrate.py): the newest
            # boundary stays the one that fed this layer, and no more files will be written
            self._last_in_ram = True
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

    def settle_before_stop(self, w: Worker) -> None:
        """Before a calibrated worker is recycled: have it finish the inputs its last reply left pending and journal
        them, so that its successor starts from them rather than one layer back. A worker that cannot (dies, hangs
        past the heartbeat timeout) costs that layer, as any worker's loss does."""
        pending = self._pending
        if not self.calibrated or pending is None:
            return
        try:
            reply = w.request(Settle(), self._cancel.is_set, lambda hb: None,
                              timeout=self.plan.job.resources.heartbeat_timeout)
        except (WorkerLost, CancelledWait):
            return
        if not isinstance(reply, Settled) or reply.boundary is None:
            return
        self._pending = None
        self._check_settled(reply.boundary, pending, pending[0])
        self.journal_boundary(pending[0] - 1, [reply.boundary])

    def _on_disk(self, b: Boundary) -> bool:
        path = os.path.join(self.plan.output, b.file)
        return os.path.isfile(path) and os.path.getsize(path) == b.nbytes

    def journal_boundary(self, index: int, bs: list[Boundary]) -> None:
        """Layer `index`'s record again, now naming the boundaries its outputs made (durable), and they become the
        newest: the one before them is spent."""
        rec = self.done.get(index)
        if rec is None:
            raise ExportFailed(f"worker named layer {index + 1}'s calibration inputs durable before layer {index} "
                               "was journaled", index=index + 1)
        rec = msgspec.structs.replace(rec, boundary=bs[0] if len(bs) == 1 else None,
                                      boundaries=bs if len(bs) > 1 else [])
        self.journal.append(rec)
        self.done[index] = rec
        spent, self.newest = self.newest, bs
        self._spent(spent)  # it fed an earlier layer; the new one was held to its layer's name

    def recorded(self, rec: journal.Shard) -> None:
        """A layer just journaled: its boundary is the only one the next layer needs, so the one before it is spent
        (the last layer needs none; a pending one stays the newest until it is named durable)."""
        last = rec.index == self.plan.source.num_layers - 1
        if self.calibrated and rec.index >= 0 and (journal.boundaries(rec) or last):
            spent, self.newest = self.newest, journal.boundaries(rec)
            self._spent(spent)  # it fed this layer; check() held the new one to the next layer's name

    def settle_arithmetic(self, w: Worker | Group) -> None:
        """What the calibrated workers compute with, as they report it: refused when the journal holds layers computed
        otherwise (before they export one), journaled when it is new."""
        if not self.calibrated:
            return
        ranks = w.ranks if isinstance(w, Group) else [w]
        rec = journal.Arithmetic(threads=[x.ready.threads for x in ranks],
                                 devices=[x.ready.device_model for x in ranks])
        calibration.check_arithmetic(self.plan.output, self._arithmetic,
                                     self._had_layers or any(i >= 0 for i in self.done), rec.threads, rec.devices)
        if rec != self._arithmetic:
            self.journal.append(rec)
            self._arithmetic = rec

    def _spent(self, spent: list[Boundary] | None) -> None:
        """Spent boundary files (each fed a layer that is journaled; no worker reads them again): while another
        boundary is still to be written (the newest feeds a layer before the last), each is kept as a spare in the
        temp folder, up to one per rank (the files a group writes at once), for a worker to rewrite in place
        (child/backends/boundary.py, about twice as fast to make durable as a fresh file); the rest, and every spare
        once none is to be written, are unlinked. Only these files are named, never a newer one a worker is
        writing; one left behind by a crash is pruned when the export resumes (resume), a spare when the next run
        clears the temp folder."""
        more = bool(self.newest) and self.newest[0].feeds < self.plan.source.num_layers - 1 and not self._last_in_ram
        for b in spent or []:
            path = os.path.join(self.plan.output, b.file)
            if more and len(durable.spares(self._tmp)) < self.plan.world:
                try:
                    durable.keep_spare(path, self._tmp)  # a rename: no data moves
                    continue
                except OSError:
                    pass  # gone already, or the folder cannot take it: unlinked as before
            self._discard(path)
        if not more:
            self._drain_spares()

    @property
    def _tmp(self) -> str:
        """The temp folder, where the spares wait (the workers' temp files are there too: one filesystem)."""
        return layout.state_path(self.plan.output, layout.TMP)

    def _drain_spares(self) -> None:
        for fn in durable.spares(self._tmp):
            self._discard(os.path.join(self._tmp, fn))

    def _discard(self, path: str) -> None:
        """Unlink a file in the background: freeing a 2 GB file's blocks takes ~0.45 s, which would otherwise sit
        between one calibrated layer and the next."""
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deleter")
        self._deleter.submit(durable.unlink_quietly, path)

    def close(self) -> None:
        """Unlink the spares left (a run that stopped early), then wait for the unlinks: they finish before the lock
        on the output is released."""
        if self.calibrated:
            self._drain_spares()
        if self._deleter is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = None
