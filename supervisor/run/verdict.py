"""The export plan's verdict, and the non-layer part copied ahead of it.

    judge(slot)         Describe ─▶ a worker ─▶ Described: every part's output predicted on meta tensors, and
                        transformers' loader run on it; an export that would quantize nothing, or whose output
                        would not load, is refused (SourceError) with the reason
    copy_ahead(todo)    the non-layer part written as it is (supervisor.run.verbatim) while the workers import; it
                        waits for the verdict (await_verdict) and is then settled: landed with the scheduler, or
                        taken back for a worker to export (CopyDeclined)
    lifted(load)        `[export] consumer = "vllm"` and the loader's only problem is transformers' own

Owns the verdict and the copy; the scheduler (attach) runs the request, the run journals what lands. It never
starts a worker itself.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from shared.load_verdict import LIFT_HINT, transformers_only
from shared.load_verdict import problems as load_problems
from shared.messages import NON_LAYER, Describe, Described, LayerWritten
from supervisor import events as ev
from supervisor.errors import SourceError
from supervisor.run import verbatim
from supervisor.run.plan import Plan

if TYPE_CHECKING:
    from supervisor.live.lease import Lease
    from supervisor.run.scheduler import Scheduler, Slot


class Verdict:
    def __init__(self, plan: Plan, emit: Callable[[ev.Event], None], cancel: threading.Event):
        self.plan, self.job, self._emit, self._cancel = plan, plan.job, emit, cancel
        self.scheduler: Scheduler | None = None  # the run's, while it has one
        self.predicted_load = None  # the loader's verdict on the predicted output (shared.messages.LoadReport)
        self.forecast: Described | None = None  # the worker's forecast, once judged good
        self._judged = threading.Event()  # set with it
        self._copy: verbatim.Copy | None = None  # the non-layer part written ahead by this process
        self._closing = threading.Event()  # the run is over: a copy still waiting for the verdict gives up

    def attach(self, scheduler: Scheduler | None) -> None:
        self.scheduler = scheduler

    def lifted(self, load) -> bool:
        """`[export] consumer = "vllm"` and the loader's only problem is transformers' own (README: consumer)."""
        return self.job.export.consumer == "vllm" and transformers_only(load)

    def judge(self, slot: Slot | None = None) -> None:
        """The export plan, on `slot`'s worker (default slot 0's); raises SourceError to refuse the export."""
        described = self.scheduler.request(Describe(), Described, "the export plan", slot=slot)
        self.predicted_load = described.load  # the end-of-export check reuses it when the files match
        what = f"{self.job.export.scheme} export of " + (
            repr(self.job.source.path) if self.job.source is not None else "the live model")
        if described.parts and not any(part.quantized for part in described.parts):
            raise SourceError(f"{what} would quantize nothing: no weight matches the scheme's targets outside the "
                              f"ignore list (by {described.backend}); see `supervisor plan`")
        problem = load_problems(described.load)
        if problem and not self.lifted(described.load):
            raise SourceError(f"{what} would not load in transformers: {problem}{LIFT_HINT(described.load)}")
        self.forecast = described
        self._judged.set()

    @property
    def copying(self) -> bool:
        return self._copy is not None

    def copy_ahead(self, todo: list[int], lease: Lease) -> None:
        part = verbatim.part_to_copy(self.job, self.plan.source) if NON_LAYER in todo else None
        if part is not None and lease.pairs is not None and lease.pairs.touches(lease.part_names(NON_LAYER)):
            part = None  # a live LoRA pair merges into the non-layer part (lm_head): a worker exports it
        if part is not None:
            self._copy = verbatim.Copy(part, self.plan.output, self.await_verdict, self.settle_copy)
            self._copy.start()

    def await_verdict(self) -> Described | None:
        """The forecast once judged good; None when the run stops first (refused, failed, cancelled)."""
        while not self._judged.wait(0.1):
            scheduler = self.scheduler  # the clean-up may drop it meanwhile
            if self._cancel.is_set() or self._closing.is_set() or (scheduler is not None and scheduler.stopping):
                return None
        return self.forecast

    def settle_copy(self, reply: LayerWritten | None, why: str) -> None:
        """The copy's outcome to the scheduler (`why`: the reason a worker exports the part instead). A run that is
        ending meanwhile has no scheduler left, or one that journals nothing more (Scheduler.landed)."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        if reply is not None:
            scheduler.landed(reply)
        else:
            self._emit(ev.CopyDeclined(index=NON_LAYER, reason=why))
            scheduler.take_back(NON_LAYER)

    def end(self) -> Callable[[], None] | None:
        """The run is over: a copy still waiting for the verdict gives up. Returns its join, for the clean-up to
        run in its order (None: no copy)."""
        copy, self._copy = self._copy, None
        if copy is None:
            return None
        self._closing.set()
        return copy.join
