"""The public name of the live model's release and restore, for a studio that frees its GPU around an export or
its own work: `from supervisor import offload` (examples/studio_backend.py, docs/studio.md).

The code is supervisor/live/offload.py (with the pinned host memory, supervisor/live/hostpool.py); this module
only re-exports its public names, and imports torch as that module does.
"""
from supervisor.live.hostpool import PinnedPool
from supervisor.live.offload import NotReleased, OffloadError, Released, map_refusal, release, restore

__all__ = ["NotReleased", "OffloadError", "PinnedPool", "Released", "map_refusal", "release", "restore"]
