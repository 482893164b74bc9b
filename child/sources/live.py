"""The live model's pool as a Source: layer i's tensors read straight from the supervisor's shared memory.

    supervisor: release(live) ─▶ PinnedPool chunks (memfds) ─▶ Hello.pool: fds + {name: chunk, offset, dtype,
                                                                          shape, stride} + LoRA pairs
    child:      mmap(fd, ACCESS_COPY) per chunk ─▶ read(names): tensors over the mapping, no copy

Each chunk is mapped copy-on-write: the child sees the supervisor's bytes, and a stray in-place write in a library
lands in a private page of the child, never in the live model. Tensors are views of the mapping (the page cache
of the shared memory), so reading a layer costs no copy and the child's memory holds only what it touches;
`trim()` after each part unmaps what it touched, so the child's RSS stays one layer's.
`digest(names)` hashes a part's tensors (and its LoRA pairs) so the journal can tell a changed live model from the
one the shards came from. A QLoRA model's pool holds LoRA pairs only (supervisor/live/qlora.py): `pairs` and
`pairs_digest` serve them, merged over the checkpoint on disk (child/sources/__init__.py's open_source). Owns reading the
mapping only; it never writes to it and never closes the supervisor's memory (closing the fds here closes only the
child's copies).
"""
from __future__ import annotations

import mmap

import torch

from child.sources.adapter import LoraPair
from child.sources.checkpoint import NamedTensors
from shared.durable import tensor_digest
from shared.messages import Pool, PoolTensor


class PoolSource(NamedTensors):
    def __init__(self, pool: Pool, *, autocast: bool = False):
        # autocast: merge the pairs as PeftModel.from_pretrained would (fp16/bf16 A and B upcast to fp32), the
        # reference of a QLoRA model's export; False: as the live model's own merge_and_unload() would
        self._autocast = autocast
        self._maps = [mmap.mmap(fd, size, access=mmap.ACCESS_COPY) for fd, size in zip(pool.fds, pool.sizes)]
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._entries = {t.name: t for t in pool.tensors}
        self._names = self._entries.keys()
        self._loras = {lora.weight: lora for lora in pool.loras}

    def _tensor(self, e: PoolTensor) -> torch.Tensor:
        dtype = getattr(torch, e.dtype)
        storage = self._bytes[e.chunk].untyped_storage()
        # offsets come from data_ptr() differences, so they are multiples of the dtype's size
        return torch.empty(0, dtype=dtype).set_(storage, e.offset // dtype.itemsize, e.shape, e.stride)

    def read(self, names: list[str]) -> dict:
        return {n: self._tensor(self._entries[n]) for n in names}

    def meta(self, names: list[str]) -> dict:
        return {n: torch.empty(self._entries[n].shape, dtype=getattr(torch, self._entries[n].dtype), device="meta")
                for n in names}

    def pairs(self, weight_names: list[str]) -> dict[str, LoraPair]:
        """The live PEFT model's unmerged LoRA pairs of these weights (its own tensors and scaling)."""
        out = {}
        for name in weight_names:
            lora = self._loras.get(name)
            if lora is not None:
                a, b = self._tensor(lora.a), self._tensor(lora.b)
                out[name] = LoraPair(a, b, r=a.shape[0], lora_alpha=1.0, scaling=lora.scaling,
                                     autocast=self._autocast)
        return out

    def trim(self) -> None:
        # The pages of the pool this child touched count in its RSS (as shared memory) until unmapped: over an
        # export that grows to the whole model (measured: 705 MiB peak RSS per layer vs 445 MiB from disk, on a
        # 305 MiB model), and would trip recycle_above_rss_mb. MADV_DONTNEED drops our mappings of them (the pages
        # stay in the supervisor's memfd; a later read faults them in again), and any private copy-on-write page.
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED)

    @property
    def has_loras(self) -> bool:
        return bool(self._loras)

    def digest(self, names: list[str]) -> str:
        entries = [self._entries[n] for n in names]
        entries += [t for n in names if n in self._loras for t in (self._loras[n].a, self._loras[n].b)]
        return tensor_digest((e.name, e.dtype, e.shape, _raw(self._tensor(e))) for e in entries)

    def pairs_digest(self, names: list[str]) -> str:
        """The digest of these names' LoRA pairs only (supervisor/live/qlora.py's Shared.digest): "" when none has one."""
        entries = [t for n in names if n in self._loras for t in (self._loras[n].a, self._loras[n].b)]
        if not entries:
            return ""
        return tensor_digest((e.name, e.dtype, e.shape, _raw(self._tensor(e))) for e in entries)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
