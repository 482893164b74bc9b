"""The Backend: one per output format; how a layer is quantized, how its shard is serialized, what config.json says.

    Exporter (child/__main__.py)          Backend (one per job, built once per worker)
      tensors of part i ─────────────────▶ quantize_layer(i, tensors) | quantize_non_layer(tensors)
      ◀──────────────────────── {name: tensor}  (the format's own objects, e.g. torchao tensor subclasses)
      that dict ─────────────────────────▶ serialize(tensors)
      ◀──────────────────────── ({name: plain CPU tensor}, __metadata__)   written by child/writer.py
      WriteConfig(dest) ─────────────────▶ write_config(dest): dest/config.json

The worker loop, the journal, resume and finalize never branch on the format: everything that differs between
compressed-tensors and another stack lives behind this interface. `make_backend` is the one place that picks an
implementation from the job. Owns that choice only; it never reads the source or writes shards itself.
"""
from __future__ import annotations

from typing import Protocol

from shared.job import Job


class Backend(Protocol):
    layer_prefix: str  # e.g. "model.layers."
    num_layers: int

    def quantize_layer(self, index: int, tensors: dict) -> dict:
        """Layer `index`'s checkpoint tensors (full names) in, the tensors of its output shard out (CPU)."""

    def quantize_non_layer(self, tensors: dict) -> dict:
        """Everything outside the decoder layers (embeddings, final norm, lm_head) in, its shard's tensors out."""

    def serialize(self, tensors: dict) -> tuple[dict, dict[str, str]]:
        """A part's quantized tensors as a shard stores them: plain CPU tensors and the safetensors `__metadata__`
        (the writer stores its keys in sorted order)."""

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        """Write dest_dir/config.json (the source's config plus this format's quantization_config); its path."""


# The modules each format's backend imports: the warm parent (child.zygote) imports them once, before forking.
_MODULES: dict[str, tuple[str, ...]] = {
    "compressed-tensors": ("child.quantize",),
    "torchao": ("child.torchao_backend",),
}


def preload(fmt: str) -> None:
    """Import what a worker for `fmt` will need (never touching CUDA), so forked workers start warm."""
    import importlib

    import child.source  # noqa: F401 - safetensors
    import child.writer  # noqa: F401 - torch, safetensors

    for name in _MODULES.get(fmt, ()):
        importlib.import_module(name)


def make_backend(job: Job, config_dir: str, device: str) -> Backend:
    """The backend for job.export.format, ready for its first layer."""
    from shared.job import effective_ignore

    if job.export.format == "compressed-tensors":
        from child.quantize import LayerQuantizer

        return LayerQuantizer(config_dir, job.export.scheme, effective_ignore(job), device=device)
    if job.export.format == "torchao":
        from child.source import open_source
        from child.torchao_backend import TorchaoBackend

        return TorchaoBackend(config_dir, job.export.scheme, job.export.torchao or {}, effective_ignore(job),
                              device=device, tensor_names=open_source(job).all_names())
    raise ValueError(f"unknown export format {job.export.format!r}")
