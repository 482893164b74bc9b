"""Reading what a worker exports: a checkpoint on disk, the studio's live model in shared memory, a LoRA adapter.

    open_source(job, hello.pool)
      [source] path                      Checkpoint (checkpoint.py): safetensors files, mapped, read by name
      [source] adapter                   Merged(Checkpoint, AdapterFolder.pairs) (adapter.py): LoRA merged per layer
      a live model (Hello.pool)          PoolSource (live.py): the supervisor's memfds, mapped read-only
      a live QLoRA model                 Merged(Checkpoint, PoolSource.pairs): the 16-bit base, the live pairs

Every source answers the same Source protocol (checkpoint.py), so the exporter never branches on where the tensors
come from. Owns reading only: it never quantizes, writes a file or talks to the supervisor.
"""
from __future__ import annotations

from child.sources.checkpoint import Checkpoint, Source


def open_source(job, pool=None) -> Source:
    """The Source the job names: a live model's pool (Hello.pool) or the checkpoint on disk, with its LoRA
    adapter (a [source] adapter folder, or the live PEFT model's own pairs) merged on top. A pool with a [source]
    holds only a live QLoRA model's pairs, merged over that checkpoint."""
    from child.sources.adapter import Merged

    if pool is not None and job.source is not None:
        from child.sources.live import PoolSource

        # a live PEFT model over a quantized base (supervisor/live/qlora.py): the 16-bit checkpoint, and the live
        # pairs from the pool merged as PeftModel.from_pretrained(base, <the adapter saved>) would (upcast)
        pairs = PoolSource(pool, autocast=True)
        return Merged(Checkpoint(job.source.path), pairs.pairs, digest=pairs.pairs_digest)
    if pool is not None:
        from child.sources.live import PoolSource

        live = PoolSource(pool)
        return Merged(live, live.pairs) if live.has_loras else live
    disk = Checkpoint(job.source.path)
    if job.source.adapter:
        from child.sources.adapter import AdapterFolder

        return Merged(disk, AdapterFolder(job.source.adapter).pairs)
    return disk
