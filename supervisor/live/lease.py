"""One run's lease of the live model: released into pinned host memory at the start, restored at the end.

    Lease(plan, model, tokenizer, pinned, emit)
      release()   offload.release(model): a live source's tensors into `pinned` (memfds, shared with the workers:
                  `manifest`, the shared.messages.Pool every Hello carries, and its fds `memfds`); a QLoRA model's
                  LoRA pairs copied into pinned memory of their own (supervisor.live.qlora) before its release
      restore()   offload.restore: the model back where it was (ModelRestored)
      close()     the pinned memory this lease made, freed (a caller's PinnedPool is left to the caller)

Also what the run asks of the live source: a part's tensor names and whether a journaled part still matches it.
Owns the release, the restore and the pinned memory of one run; it never starts a worker or writes the output.
Imports torch only through supervisor.live.offload, when a model is handed to it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from supervisor import events as ev
from supervisor.errors import SourceError

if TYPE_CHECKING:
    from supervisor.output import journal
    from supervisor.run.plan import Plan


class Lease:
    def __init__(self, plan: Plan, model, tokenizer, pinned, emit: Callable[[ev.Event], None]):
        """`pinned`: the PinnedPool handed to Supervisor (None: the lease makes one and frees it)."""
        self.plan, self.model, self.tokenizer, self._emit = plan, model, tokenizer, emit
        self.pinned, self._own_pinned = pinned, False
        self.live = None  # live.Saved while a live model is the source: its tensors, now in `pinned`
        self.manifest = None  # shared.messages.Pool sent to every worker
        self.pairs = None  # plan.lora's pairs (supervisor.live.qlora.Shared), copied into self._pairs_pinned
        self._pairs_pinned = None
        self._handle = None  # offload handle while the live model is released

    @property
    def memfds(self) -> tuple[int, ...]:
        """A live model's memfds, inherited by the warm parent (so by every worker it forks) or a spawned worker."""
        return tuple(self.manifest.fds) if self.manifest is not None else ()

    def release(self) -> None:
        if self.model is None:
            return
        from supervisor.live import offload

        if self.plan.live is not None:
            self.live = self.plan.live  # named before the release: after it all tensors share a chunk
            if self.pinned is None:
                self.pinned, self._own_pinned = offload.PinnedPool(), True
            result = offload.release(self.model, buffers=self.pinned, share_host=True)
            if isinstance(result, offload.NotReleased):
                raise SourceError(f"the live model cannot be exported: {result.reason}")
            self._handle = result
            self._share_live_model()
        else:
            if self.plan.lora is not None:
                self._share_pairs()  # before the release: a failed copy leaves the model as it was
            result = offload.release(self.model, buffers=self.pinned)
        if isinstance(result, offload.NotReleased):
            self._emit(ev.MemoryReleased(released=False, reason=result.reason))
            return
        self._handle = result
        self._emit(ev.MemoryReleased(released=True, freed=dict(result.freed), moved_bytes=result.moved_bytes,
                                     seconds=result.seconds))

    def _share_live_model(self) -> None:
        """The released live model as the child's source: the memfds' manifest and the config folder."""
        from supervisor.live import model as live

        config_dir = self.plan.source.path
        self.manifest = live.manifest(self.live, self.pinned, config_dir)
        live.write_config_dir(self.live, self.tokenizer, config_dir)

    def _share_pairs(self) -> None:
        """A QLoRA model's pairs, copied into pinned memory of their own that the child maps (supervisor.live.qlora)."""
        from supervisor.live import offload, qlora

        self._pairs_pinned = offload.PinnedPool()
        self.pairs = qlora.share(self.plan.lora, self._pairs_pinned, self.plan.source.path)
        self.manifest = self.pairs.spec

    def close(self) -> None:
        self.live = self.manifest = self.pairs = None
        if self._pairs_pinned is not None:
            self._pairs_pinned.end_lease()
            self._pairs_pinned.close()
            self._pairs_pinned = None
        if self._own_pinned and self.pinned is not None and not self.pinned.leased:
            self.pinned.close()
            self.pinned, self._own_pinned = None, False

    def restore(self) -> None:
        if self._handle is None:
            return
        from supervisor.live import offload

        t = time.monotonic()
        handle, self._handle = self._handle, None
        offload.restore(handle)
        self._emit(ev.ModelRestored(seconds=round(time.monotonic() - t, 4)))

    def part_names(self, index: int) -> list[str]:
        from supervisor.live import model as live  # the rule the child reads a part's names with

        src = self.plan.source
        return live.part_names(src.tensor_names, src.layer_prefix, index, src.num_layers)

    def source_changed(self, index: int, rec: journal.Shard) -> str | None:
        """A live model's part whose tensors differ from those its shard was made from (a re-run after a crash
        with a changed model): redone, never mixed in."""
        if self.live is None and self.pairs is None:
            return None
        from supervisor.live import model as live

        names = self.part_names(index)
        if self.pairs is not None:
            return None if self.pairs.digest(names) == rec.source_digest else "the live adapter changed"
        return None if live.part_digest(self.live, names) == rec.source_digest else "the live model changed"
