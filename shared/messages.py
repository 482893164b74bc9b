"""The pipe protocol between the supervisor and a child worker: every message, in one file.

Data flow (one worker)::

    supervisor                                   child (python -m child)
      Hello(version, job, device) ────────────▶  imports torch/llm-compressor, builds the meta skeleton
      ◀──────────── Ready(pid, versions, layer_prefix, num_layers)   (Heartbeat while importing)
      ExportLayer(index, attempt, fence, …) ──▶  read (mmap) → quantize → write the attempt's temp file → fsync
        (+ boundary: calibrated jobs)            (calibrated: forward → calibrate → propagate → quantize → write)
      ◀──────────── Heartbeat(index, stage) …  then  LayerWritten(index, file, fence, digest, …) | Failed(…)
                                                 (calibrated: + boundary, the next layer's inputs, durable; or
                                                 pending, and the previous reply's named in `settled`)
      the supervisor moves the staged shard (layout.staged_name(index, fence)) to its name, then journals it
      Describe() ─────────────────────────────▶  every part's output on meta tensors (no weight read) + the loader
      ◀──────────── Described(parts, load)          check of that predicted output (before the first part; on GPUs
                                                    on a worker of its own while the first parts run, none
                                                    journaled before the verdict)
      WriteConfig(dest) ──────────────────────▶  config.json with quantization_config into dest
      ◀──────────── ConfigWritten(path) | Failed(…)
      CheckLoad(folder) ──────────────────────▶  transformers' loader on the finished folder (meta device)
      ◀──────────── LoadChecked(load) | Failed(…)
      Stop() ─────────────────────────────────▶  exits 0

    quality (`supervisor verify OUT --quality FILE`; a worker whose Hello carries `evaluate`, child/backends/evaluate.py)
      EvaluateLayer(index, fence, boundary) ──▶  source layer i and export layer i over every held-out sample's
                                                 two hidden states (boundary: the journaled inputs of layer i)
      ◀──────────── LayerEvaluated(index, rel_error, cosine, boundary | pending, settled)   (the next layer's
                                                 inputs: durable, or made durable beside the next layer)
      EvaluateLayer(index = num_layers) ──────▶  final norm + head of each model over the last layer's outputs
      ◀──────────── QualityMeasured(kl, top1, ppl_source, ppl_export, samples, tokens)

Rules: Structs with `tag=True`, one Union per direction, one typed Decoder per direction made once; failures
travel as data (`Failed.kind/message/traceback` text), never pickled; `Failed.retry` is False for a failure that
would repeat (same input, same code), which the supervisor then does not retry. New fields get defaults. Bump
PROTOCOL_VERSION on any incompatible change; the child refuses a Hello with another version.

Boundary durability: a calibrated worker on its own keeps the next layer's inputs in memory and writes their file
while the next layer computes. Its LayerWritten(i) says `pending` (no boundary named); its LayerWritten(i + 1), from
the same process, names that file in `settled` once it is durable (written, fsynced, renamed under attempt i's
fence). The supervisor journals a boundary only once it is named durable, so a crash between the two replies costs
the layer before it once more (resume starts from the newest durable boundary); a worker that does not hold the
inputs of the next layer (a fresh one) is first given the layer after that boundary again.

Fencing: every attempt at a part carries a fence of its own (ExportLayer.fence, fresh random per request). A worker
writes only files named by it (its staged shard, its boundary files) and never the shard's final name; the
supervisor places the staged shard of the attempt it is waiting for and no other. A worker that outlives its
attempt (a node back from a partition, after its part was redone elsewhere) can therefore never replace or
corrupt a committed shard or boundary: what it writes has a name nothing reads.
"""
from __future__ import annotations

from typing import Union

import msgspec

from shared.job import Job

# 9: `verify --quality` (Hello.evaluate, EvaluateLayer, LayerEvaluated, QualityMeasured); 8: PartPlan.rewritten (a
# calibrated non-layer part copied ahead unless it names one); 7: a calibrated layer's next inputs made durable beside
# the next layer (pending, settled)
PROTOCOL_VERSION = 9

NON_LAYER = -1  # the index used for the non-layer shard (embeddings, final norm, lm_head)


class Boundary(msgspec.Struct, kw_only=True):
    """A calibrated export's activations entering layer `feeds` (every sample's hidden states), on disk."""

    feeds: int  # the layer whose inputs these are
    file: str  # relative to the output folder (under .export/)
    digest: str  # "algo:hex" of the file's bytes (shared.durable)
    nbytes: int


# ---- a live model's pool (shared memory the supervisor owns; the child maps it read-only) ---------------------
class PoolTensor(msgspec.Struct, array_like=True):
    name: str  # checkpoint name, as live.save_pretrained() would write it
    chunk: int  # index into Pool.fds
    offset: int  # bytes from the chunk's start
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]
    stride: list[int]  # in elements


class PoolLora(msgspec.Struct, array_like=True):
    weight: str  # checkpoint name of the Linear weight this pair merges into
    a: PoolTensor  # [r, in]
    b: PoolTensor  # [out, r]
    scaling: float  # the live PEFT layer's own scaling


class Pool(msgspec.Struct, kw_only=True):
    fds: list[int]  # memfds inherited by the child (same numbers), one per chunk
    sizes: list[int]  # bytes of each chunk
    tensors: list[PoolTensor]
    loras: list[PoolLora] = []
    config_dir: str  # config.json (+ generation config, tokenizer) of the live model, written by the supervisor


class Group(msgspec.Struct, kw_only=True):
    """A calibrated export's ranks: W workers that calibrate every decoder layer together as one torch.distributed
    process group (gloo on the CPU, NCCL on GPUs). Rank 0 hosts the rendezvous (a TCPStore on `host:port`, on the
    socket bound there for it: LISTEN_FD_ENV); every value the ranks put there is signed under `secret` (child.backends.group),
    so a process that reaches the port cannot feed a rank a value of its own. Rank 0 writes each layer's shard;
    every rank writes the boundary of its own samples."""

    rank: int
    world: int
    host: str  # the rendezvous' address: 127.0.0.1 for a one-host group, rank 0's node's Ray IP on a cluster
    port: int
    secret: str  # per group start: the key of the store's values' HMAC (never in the store itself)
    timeout: float  # seconds a collective may wait for the slowest rank before it fails the layer
    backend: str = "gloo"  # "gloo" | "nccl"


# Failed.kind of a rank whose collective waited past Group.timeout for another rank (child.backends.group's exception class)
COLLECTIVE_TIMEOUT = "CollectiveTimeout"
# How a group's rank 0 gets its store's listening socket: bound by whoever picked the port (the supervisor, on a
# cluster rank 0's node host) and handed to the worker as an inherited file descriptor, whose number the worker's
# environment holds (child.backends.group passes it to TCPStore as master_listen_fd): no other process can take the port
# between its choice and rank 0's listen, and the store listens on `Group.host` alone, never on every interface.
LISTEN_FD_ENV = "SUPERVISOR_LISTEN_FD"
# On a cluster: the port of the socket the node's host holds for the worker it starts (supervisor.cluster.node_agent)
LISTEN_PORT_ENV = "SUPERVISOR_LISTEN_PORT"


# ---- supervisor → child -------------------------------------------------------------------------------------
class Evaluate(msgspec.Struct, kw_only=True):
    """`verify --quality`: the held-out samples run through the export's source and the export, layer by layer."""

    dataset: str  # local JSONL, the calibration file's form
    samples: int = 64
    seq_len: int = 2048
    sha256: str = ""  # of the dataset lines the supervisor validated; the child checks it


class Hello(msgspec.Struct, tag=True, kw_only=True):
    version: int
    job: Job
    output: str  # absolute output folder
    device: str  # "cpu" or "cuda:N" as the child sees it
    worker: int = 0
    heartbeat_seconds: float = 1.0
    calibration_sha256: str = ""  # of the dataset lines the supervisor validated; the child checks it
    pool: Pool | None = None  # set when the source is a live model (job.source is None)
    # a file whose flock the worker holds while a part is on its device (from the copy onto the GPU to the
    # quantized tensors back on the host): set when several workers share a GPU whose layers are too big for two
    # at once, so one quantizes while the other reads or writes; empty: no lock
    device_lock: str = ""
    group: Group | None = None  # set for the ranks of a calibrated group (W > 1); None: a worker of its own
    evaluate: Evaluate | None = None  # set: a quality worker (child/backends/evaluate.py) for the finished export in `output`


class ExportLayer(msgspec.Struct, tag=True, kw_only=True):
    index: int  # decoder layer index, or NON_LAYER
    attempt: int = 1
    fence: str = ""  # this attempt's own token (hex): the names of every file it writes (layout.staged_name, boundary_name)
    prefetch: int | None = None  # the index the supervisor will ask for next (read ahead)
    boundary: Boundary | None = None  # calibrated: the journaled inputs of layer `index` (None: compute layer 0's)
    # a group's journaled inputs of layer `index`, one per rank (supervisor side only: the group sends each rank
    # its own as `boundary`)
    boundaries: list[Boundary] = []


class WriteConfig(msgspec.Struct, tag=True, kw_only=True):
    dest: str  # folder to write config.json into (a staging folder under OUT/.export)


class Describe(msgspec.Struct, tag=True, kw_only=True):
    pass


class CheckLoad(msgspec.Struct, tag=True, kw_only=True):
    folder: str  # a finished export: config.json and every shard in place
    known: LoadReport | None = None  # the verdict on the predicted output: the answer if the folder matches its key


class Settle(msgspec.Struct, tag=True):
    """Before a calibrated worker is stopped on purpose (recycled): finish making the inputs its last reply left
    `pending` durable, and name them (Settled), so that its successor starts from them instead of one layer back."""


class Stop(msgspec.Struct, tag=True):
    pass


class EvaluateLayer(msgspec.Struct, tag=True, kw_only=True):
    """Quality: run layer `index` of the source and of the export (index == num_layers: the final norm and head)."""

    index: int
    fence: str = ""  # this attempt's: the name of the boundary file it writes
    boundary: Boundary | None = None  # the journaled inputs of layer `index` (both streams); None: from the samples


ToChild = Union[Hello, ExportLayer, WriteConfig, Describe, CheckLoad, Settle, Stop, EvaluateLayer]


# ---- child → supervisor -------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, kw_only=True):
    version: int
    pid: int
    device: str
    layer_prefix: str  # e.g. "model.layers."
    num_layers: int
    versions: dict[str, str] = {}
    gpu_free: int = 0  # torch.cuda.mem_get_info on the child's device, measured after its imports (0 on CPU)
    gpu_total: int = 0
    # what a calibrated layer's arithmetic runs with here (its bytes depend on them, docs/fidelity.md): torch's
    # intra-op thread count, and the device's model ("cpu: <model name>" | "cuda: <torch.cuda.get_device_name>")
    threads: int = 0
    device_model: str = ""


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    index: int | None = None  # the part in progress, None while starting
    stage: str = ""  # "starting" | "read" | "quantize" | "write" | "config"; calibrated: "forward" | "calibrate" | "propagate"
    # a group's rank (calibrated, W > 1) also: "rendezvous" while the ranks meet
    rss: int = 0


class LayerWritten(msgspec.Struct, tag=True, kw_only=True):
    index: int
    file: str  # the shard's name relative to the output folder, once the supervisor has placed it
    fence: str = ""  # the request's: the shard is staged at layout.staged_name(index, fence), complete and fsynced
    digest: str  # "algo:hex" of the file's bytes (shared.durable)
    nbytes: int
    seconds: float
    source_bytes: int = 0  # bytes read from the source for this part
    peak_rss: int = 0  # the child's peak RSS while exporting this part (VmHWM reset per part), bytes
    rss: int = 0  # the child's RSS after the layer, bytes
    peak_gpu: int = 0  # torch.cuda.max_memory_allocated during this part, bytes
    ino: int = 0  # the staged shard's inode and mtime (a rename keeps both: resume trusts a matching stat)
    mtime_ns: int = 0
    stages: dict[str, float] = {}  # seconds per stage: read, quantize, error, save, hash, sync, cleanup
    # module name -> ||dequantized - source|| / ||source|| of its weight, measured by the child (child/backends/quant_error.py)
    quant_error: dict[str, float] = {}
    boundary: Boundary | None = None  # calibrated: the next layer's inputs, made durable after the shard
    # calibrated, one worker: the next layer's inputs stay in this worker's memory, their file is being made durable
    # beside the next layer (boundary is None); the worker's next reply names it in `settled` (Boundary durability)
    pending: bool = False
    settled: Boundary | None = None  # the inputs of layer `index` this worker's previous reply left pending, durable
    losses: dict[str, float] = {}  # calibrated: module name -> the method's own loss for it (GPTQ's solver)
    source_digest: str = ""  # a live model's source tensors of this part (shared.durable.tensor_digest); "" on disk
    rank: int = 0  # the group rank that sent it; a rank other than 0 writes no shard (file "") only its boundary
    # a group's boundaries of the next layer, one per rank (the supervisor merges the ranks' replies into rank 0's)
    boundaries: list[Boundary] = []
    # calibrated: per rank ("0", "1", ...; one worker: "0") its seconds per calibration stage (forward, calibrate,
    # and a group's reduce, solve, broadcast; propagate, quantize); a group's reply merges every rank's
    ranks: dict[str, dict[str, float]] = {}


class ConfigWritten(msgspec.Struct, tag=True, kw_only=True):
    path: str


class LoadReport(msgspec.Struct, kw_only=True):
    """What transformers' loader makes of an export (child/loadcheck.py): weights it could not place."""

    checked: bool = True  # False: the check could not run (transformers does not know the architecture); see reason
    missing: list[str] = []  # weights the model has and the files lack: transformers would initialise them at random
    unexpected: list[str] = []  # weights in the files the model has no place for: transformers would drop them
    mismatched: list[str] = []  # "name (shape in file) vs (shape in model)"
    error: str = ""  # the loader raised (one line)
    reason: str = ""  # why it was not checked
    key: str = ""  # what the verdict was given on: a digest of config.json and every tensor's name, dtype and shape


class PartPlan(msgspec.Struct, kw_only=True):
    index: int  # decoder layer index, or NON_LAYER
    quantized: list[str] = []  # source tensors replaced by compressed ones
    kept: list[str] = []  # source tensors written as they are
    # source tensors written under their own name, dtype and shape with other values (a calibrated export's offset
    # norms, which oneshot's round trip rounds): neither kept nor quantized
    rewritten: list[str] = []
    out_bytes: int = 0  # bytes of the part's output tensors


class Described(msgspec.Struct, tag=True, kw_only=True):
    backend: str  # e.g. "DeepseekV3ForCausalLM (transformers)" or "tensor names (model_free_ptq rules)"
    layer_prefix: str
    ignore: list[str] = []  # the ignore list in effect
    parts: list[PartPlan] = []
    load: LoadReport = msgspec.field(default_factory=LoadReport)  # the loader's verdict on the predicted output
    # calibrated: the ranks that would calibrate each layer together, and why 1 where more were asked (the
    # supervisor fills these in: they depend on the job and the devices, not on what the worker sees)
    world: int = 0
    world_note: str = ""


class LoadChecked(msgspec.Struct, tag=True, kw_only=True):
    load: LoadReport


class Failed(msgspec.Struct, tag=True, kw_only=True):
    index: int | None = None
    kind: str  # exception class name, e.g. "MemoryError"
    message: str
    traceback: str = ""
    errno: int | None = None  # set for OSError (ENOSPC is not worth retrying)
    retry: bool = True  # False: the same input fails the same way (a bad layout, an unsupported architecture)
    refused: bool = False  # the job asks for something this source cannot give: bad input (exit 2), not a crash


class Settled(msgspec.Struct, tag=True, kw_only=True):
    boundary: Boundary | None = None  # the inputs the last reply left pending, durable now (None: nothing was pending)


class LayerEvaluated(msgspec.Struct, tag=True, kw_only=True):
    """Quality: layer `index` of both models ran; the export's hidden states at its output against the source's."""

    index: int
    rel_error: float  # ||export - source|| / ||source|| over every position of every sample (float32)
    cosine: float  # mean over every position of cos(export, source)
    # the outputs of both models (the inputs of layer index + 1), durable; None while `pending`: one worker keeps them
    # in RAM and makes their file durable while the next layer computes, and its next reply names it in `settled`
    # (as a calibrated export's LayerWritten does: Boundary durability above)
    boundary: Boundary | None = None
    pending: bool = False
    settled: Boundary | None = None  # the inputs of layer `index` the previous reply left pending, durable now
    seconds: float = 0.0
    peak_rss: int = 0
    peak_gpu: int = 0


class QualityMeasured(msgspec.Struct, tag=True, kw_only=True):
    """Quality: the figures over the logits of both models (float32, natural log; docs/quality.md)."""

    kl: float  # mean over positions of KL(softmax(source) || softmax(export))
    top1: float  # fraction of positions whose argmaxes agree
    ppl_source: float  # exp(mean NLL of token t+1 at positions t < n-1)
    ppl_export: float
    samples: int
    tokens: int  # positions the kl and top1 are over (every token of every sample)
    seconds: float = 0.0


ToSupervisor = Union[Ready, Heartbeat, LayerWritten, ConfigWritten, Described, LoadChecked, Settled, Failed,
                     LayerEvaluated, QualityMeasured]
