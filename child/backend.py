"""The Backend: one per output format and method; how a layer is quantized, how its shard is serialized, what
config.json says, and (calibrated methods) the activations that cross from one layer to the next.

    Exporter (child/__main__.py)          Backend (one per job, built once per worker)
      ExportLayer(i, boundary) ──────────▶ begin(i, boundary)       calibrated: layer i's inputs at hand
      tensors of part i ─────────────────▶ quantize_layer(i, tensors) | quantize_non_layer(tensors)
      ◀──────────────────────── {name: tensor}  (the format's own objects, e.g. torchao tensor subclasses)
      that dict ─────────────────────────▶ serialize(tensors)
      ◀──────────────────────── ({name: plain CPU tensor}, __metadata__)   written by child/writer.py
      shard durable ─────────────────────▶ commit(i) -> Boundary | None  calibrated: next layer's inputs durable
      WriteConfig(dest) ─────────────────▶ write_config(dest): dest/config.json

The worker loop, the journal, resume and finalize never branch on the format or the method: everything that
differs lives behind this interface. Data-free backends keep no state across layers (begin/commit do nothing).
`make_backend` is the one place that picks an implementation from the job. Owns that choice only; it never reads
the source or writes shards itself.
"""
from __future__ import annotations

from typing import Callable, Protocol

from shared.job import Job, is_calibrated
from shared.messages import Boundary


class Backend(Protocol):
    layer_prefix: str  # e.g. "model.layers."
    num_layers: int
    # a GPU worker's read-ahead copies the next layer to the device (False: it stays on the host until used)
    reads_to_device: bool

    def begin(self, index: int, boundary: Boundary | None) -> None:
        """Before part `index` (NON_LAYER included): `boundary` is the journaled input of layer `index` when the
        supervisor knows one (calibrated methods); a backend that keeps it in memory may ignore it."""

    def quantize_layer(self, index: int, tensors: dict) -> dict:
        """Layer `index`'s checkpoint tensors (full names) in, the tensors of its output shard out (CPU)."""

    def quantize_non_layer(self, tensors: dict) -> dict:
        """Everything outside the decoder layers (embeddings, final norm, lm_head) in, its shard's tensors out."""

    def serialize(self, tensors: dict) -> tuple[dict, dict[str, str]]:
        """A part's quantized tensors as a shard stores them: plain CPU tensors and the safetensors `__metadata__`
        (the writer stores its keys in sorted order)."""

    def commit(self, index: int) -> Boundary | None:
        """After part `index`'s shard is durable: make whatever the next layer needs durable, and name it."""

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        """Write dest_dir/config.json (the source's config plus this format's quantization_config); its path."""


# The modules each format's backend imports: the warm parent (child.zygote) imports them once, before forking.
_MODULES: dict[str, tuple[str, ...]] = {
    "compressed-tensors": ("child.quantize", "child.calibrate"),
    "torchao": ("child.torchao_backend",),
}


def preload(fmt: str) -> None:
    """Import what a worker for `fmt` will need (never touching CUDA), so forked workers start warm."""
    import importlib

    import child.source  # noqa: F401 - safetensors
    import child.writer  # noqa: F401 - torch, safetensors

    for name in _MODULES.get(fmt, ()):
        importlib.import_module(name)


def make_backend(job: Job, config_dir: str, device: str, *, output: str = "", source=None,
                 stage: Callable[[str], None] = lambda name: None, calibration_sha256: str = "") -> Backend:
    """The backend for the job's format and method, ready for its first layer. `stage(name)` reports progress
    inside a part (calibrated methods: forward, calibrate, propagate, quantize)."""
    from shared.job import effective_ignore

    if job.export.format == "compressed-tensors":
        if is_calibrated(job):
            from child.calibrate import Calibrator

            return Calibrator(job, config_dir, device, output=output, source=source, stage=stage,
                              calibration_sha256=calibration_sha256)
        from child.quantize import LayerQuantizer

        return LayerQuantizer(config_dir, job.export.scheme, effective_ignore(job), device=device)
    if job.export.format == "torchao":
        from child.source import open_source
        from child.torchao_backend import TorchaoBackend

        return TorchaoBackend(config_dir, job.export.scheme, job.export.torchao or {}, effective_ignore(job),
                              device=device, tensor_names=open_source(job).all_names())
    raise ValueError(f"unknown export format {job.export.format!r}")
