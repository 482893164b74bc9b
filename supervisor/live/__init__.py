"""The studio's live model, `Supervisor(job, model=...)`: the only part of the supervisor that imports torch.

    model.py     what the child reads of a live model, named as save_pretrained() would write it
    qlora.py     a PEFT model over a quantized base: its 16-bit checkpoint plus the LoRA pairs in memory
    offload.py   release / restore: the model's accelerator memory moved into pinned host memory and back
    hostpool.py  that pinned memory (PinnedPool: memfd chunks, shared with the child, reused across releases)
    lease.py     one run's release, share with the workers, restore, free (what Run does with a live model)

Public names stay where a studio imports them: `supervisor.offload` re-exports release/restore, PinnedPool,
Released. Never starts a worker, never writes the output folder (the config folder a live source needs aside).
"""
