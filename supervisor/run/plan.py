"""The Plan: a validated job and everything prepare() learnt about it, handed from supervisor.api to the run.

Built once, by api.prepare (the only place that validates a job); read by the run and its helpers. Owns the shape
of that hand-over only; it never validates, reads the source or writes anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.job import Job
from supervisor.checks import calibration
from supervisor.checks.source import SourceInfo
from supervisor.output import journal

if TYPE_CHECKING:  # supervisor.live.model imports torch; a plan for a checkpoint never needs it
    from supervisor.cluster.seats import Cluster
    from supervisor.live.model import Saved
    from supervisor.live.qlora import LiveLora


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
    # saw them (supervisor.live.model.Saved; tensors are looked up again by path after the release moves them)
    live: Saved | None = None
    # a PEFT model over a quantized base: its LoRA pairs, merged over the 16-bit checkpoint job.source names
    # (supervisor.live.qlora.LiveLora; the pairs are copied into a pool of their own at the release)
    lora: LiveLora | None = None
    fresh: bool = False  # the output folder did not exist or was empty: a refused run leaves it that way
    world: int = 1  # calibrated: the ranks of the group that calibrates each layer (calibration.group_size)
    world_note: str = ""  # why it is 1 where more were asked
    cluster: Cluster | None = None  # [resources] cluster = "ray": the joined cluster, one agent per slot

