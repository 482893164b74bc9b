"""Events the supervisor reports to its caller (a GUI backend, the CLI): typed, JSON-serializable.

A Union separate from the wire protocol, so the embedding API never exposes it. Every event carries `t`, seconds
since the run started. `Finished`, `Failed` and `Cancelled` are terminal: exactly one of them ends every run.
Owns the event types only.
"""
from __future__ import annotations

from typing import Union

import msgspec


class Event(msgspec.Struct, tag=True, kw_only=True):
    t: float = 0.0


class Started(Event):
    output: str
    total: int  # parts: decoder layers + the non-layer shard
    todo: int
    resumed: int  # parts verified from an earlier run
    redo: list[int] = []  # journaled parts that failed verification and are redone
    world: int = 1  # calibrated: the ranks that calibrate each layer together (a group when above 1)
    world_note: str = ""  # why it is 1 where more were asked (a method without a distributed path...)
    # what the supervisor chose of the source, or could not check: a QLoRA base (supervisor/live/qlora.py) taken from two
    # folders the live model names, or one whose quantized weights are of a form not compared with the checkpoint's
    source_note: str = ""


class MemoryReleased(Event):
    released: bool
    reason: str = ""  # why nothing was released, when released is False
    freed: dict[str, int] = {}  # device -> bytes freed, from the CUDA allocator
    moved_bytes: int = 0
    seconds: float = 0.0


class PoolStarted(Event):
    """The warm parent that forks workers has imported its libraries."""

    pid: int
    seconds: float  # from spawn to ready
    imports: float = 0.0  # of which importing torch, transformers and the backend's libraries
    forking: bool = True  # False: the imports touched CUDA here, so workers are spawned fresh instead of forked
    reused: bool = False  # an earlier run's warm parent, kept warm (resources.keep_warm): nothing imported now
    kept: float = 0.0  # seconds this warm parent stays after the run (0: it ends with the run)


class WorkerStarted(Event):
    pid: int
    device: str
    seconds: float  # from spawn (or fork) to Ready
    worker: int = 0  # the slot it serves
    since_death: float | None = None  # seconds from the loss of this slot's previous worker to this one's Ready
    gpu_free: int = 0  # free bytes on the worker's GPU, measured by the worker after its start (0 on CPU)
    gpu_total: int = 0
    where: str = ""  # on a cluster: the node (host, address, Ray node id) and GPU it runs on; "" on this host


class ClusterJoined(Event):
    """`[resources] cluster = "ray"`: the Ray cluster joined, a seat (GPU or CPU) per worker slot, every node's view of
    the source and output checked; workers connect to `host:port` (the run's port, per-run secret)."""

    address: str  # the Ray cluster's
    host: str
    port: int
    nodes: int = 0  # the nodes the workers are on
    agents: list[str] = []  # per worker slot: its node (host, address, node id) and GPU
    left_out: list[str] = []  # seats given back: their node's free memory holds no more workers of this model


class ConnectionRefused(Event):
    """A connection to the run's port closed before any frame was read (no handshake within its deadline, a wrong
    secret, an unknown worker, too many handshakes at once): the run goes on. Reported at a bounded rate: past the
    first few of a window, one event counts the others (its reason says how many)."""

    peer: str
    reason: str


class WorkerLeftOut(Event):
    """A worker the default count added beyond one per GPU found too little free memory there (resources.workers =
    0): the run goes on without it. Its slot exports nothing; the part it had taken goes back to the queue."""

    worker: int
    device: str
    reason: str


class CopyDeclined(Event):
    """The part the supervisor copied ahead (the non-layer part, supervisor/run/verbatim.py) is not used: the export plan
    changes some of it, or the copy failed. A worker exports the part instead, as with no copy; only time is lost."""

    index: int
    reason: str


class LayerStarted(Event):
    index: int  # -1 is the non-layer shard
    attempt: int
    worker: int = 0  # the slot (worker position) that exports it


class LayerWritten(Event):
    index: int
    file: str
    nbytes: int
    seconds: float
    peak_rss: int
    peak_gpu: int = 0
    retries: int = 0  # failed attempts before the one that wrote it
    quant_error: dict[str, float] = {}  # module -> relative error of its dequantized weight vs the source
    stages: dict[str, float] = {}  # seconds per stage in the worker: read, inputs, quantize, error, save, hash, sync,
    # boundary, cleanup (inputs, boundary: a calibrated layer's activations in and out); copy, hash, sync: the
    # non-layer part written by the supervisor itself during the workers' imports (supervisor/run/verbatim.py; it has
    # no LayerStarted)
    # calibrated: per rank ("0"; a group's "0".."W-1") its seconds per calibration stage: forward, calibrate, and
    # a group's reduce, solve, broadcast; propagate, quantize (rank 0: the compression of the shard's modules)
    ranks: dict[str, dict[str, float]] = {}
    losses: dict[str, float] = {}  # calibrated: module -> the method's own loss (GPTQ's)
    where: str = ""  # on a cluster: the node and GPU of the worker that wrote it (a group's: every rank's)


class Progress(Event):
    done: int
    total: int
    bytes_written: int
    mb_per_s: float  # source bytes processed per second in this run
    eta_s: float | None
    worker_rss: int = 0
    stage: str = ""
    index: int | None = None
    ranks: int = 0  # a calibrated group's ranks alive (0: no group)


class Retrying(Event):
    index: int | None  # the part about to be retried; None: a request about the whole export (`what` names it)
    attempt: int  # the attempt about to start
    reason: str
    delay: float
    what: str = ""  # what is retried, in words: "layer 3", "config.json", "the loader check"


class ModelRestored(Event):
    seconds: float
    restored: bool = True


class LogLine(Event):
    """A line the child printed (its libraries' warnings, progress bars, tracebacks); also in the worker log."""

    stream: str  # "stdout" | "stderr"
    text: str
    pid: int


class Finished(Event):
    output: str
    parts: int
    nbytes: int
    seconds: float
    already_complete: bool = False
    # seconds of the steps after the last part: config (written by a worker), files (config.json, the index and the
    # side files made durable), load (the loader check), workers (stopped and gone), journal (Finalized, DONE);
    # quality ([evaluate])
    stages: dict[str, float] = msgspec.field(default_factory=dict)


class Failed(Event):
    kind: str
    message: str
    index: int | None = None
    traceback: str = ""
    exit_code: int = 1


class QualityLayer(Event):
    """`verify --quality` (or [evaluate]): decoder layer `index` of the source and the export ran over the held-out
    samples; the export's hidden states at its output against the source's (docs/quality.md)."""

    index: int
    rel_error: float
    cosine: float
    total: int = 0  # decoder layers


class QualityMeasured(Event):
    """How much the export lost against its source, over the held-out samples (docs/quality.md)."""

    kl: float
    top1: float
    ppl_source: float
    ppl_export: float
    samples: int
    tokens: int
    rel_error: list[float] = []  # per decoder layer
    cosine: list[float] = []


class Cancelled(Event):
    message: str = "cancelled; run the same job again to resume"


AnyEvent = Union[Started, MemoryReleased, PoolStarted, ClusterJoined, ConnectionRefused, WorkerStarted, WorkerLeftOut,
                 CopyDeclined, LayerStarted,
                 LayerWritten, Progress, Retrying, ModelRestored, LogLine, QualityLayer, QualityMeasured, Finished, Failed,
                 Cancelled]
TERMINAL = (Finished, Failed, Cancelled)

_json = msgspec.json.Encoder()


def to_json(ev: Event) -> bytes:
    return _json.encode(ev)
