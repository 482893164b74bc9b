"""The Backend: one per output format and method; how a layer is quantized, how its shard is serialized, what
config.json says, and (calibrated methods) the activations that cross from one layer to the next.

    Exporter (child/exporter.py)          Backend (one per job, built once per worker)
      ExportLayer(i, boundary, fence) ───▶ begin(i, boundary, fence)  calibrated: layer i's inputs at hand
      tensors of part i ─────────────────▶ quantize_layer(i, tensors) | quantize_non_layer(tensors)
      ◀──────────────────────── {name: tensor}  (the format's own objects, e.g. torchao tensor subclasses)
      that dict ─────────────────────────▶ serialize(tensors)
      ◀──────────────────────── ({name: plain CPU tensor}, __metadata__)   written by child/writer.py
      shard durable ─────────────────────▶ settle() -> Boundary | None   calibrated: layer i's inputs, durable now
                                           commit(i) -> Boundary | None  calibrated: next layer's inputs (durable,
                                                                         or `pending`: made durable beside i + 1)
      WriteConfig(dest) ─────────────────▶ write_config(dest): dest/config.json

The worker loop, the journal, resume and finalize never branch on the format or the method: everything that
differs lives behind this interface. Data-free backends keep no state across layers (begin/commit do nothing).
`make_backend` is the one place that picks an implementation from the job and the source: for data-free
compressed-tensors, child/backends/quantize.py (LayerQuantizer) when transformers knows the architecture (a meta model gives
modules, their names and the layer list), child/backends/name_only.py (NameOnlyQuantizer: llm-compressor's model_free_ptq
rules on tensor names) when it does not or when the checkpoint asks for remote code the job did not allow;
child/backends/calibrate.py for calibrated methods (they need the architecture); child/backends/torchao_backend.py for torchao.
A backend with `previews = True` also takes meta tensors and returns meta tensors: the output's names, shapes and
dtypes without reading a weight (child/preview.py: `supervisor plan` and the pre-export loader check).
Owns that choice only; it never reads the source or writes shards itself.
"""
from __future__ import annotations

from typing import Callable, Protocol

from child.errors import Refused
from shared.job import Job, is_calibrated
from shared.messages import Boundary


class Backend(Protocol):
    layer_prefix: str  # e.g. "model.layers."
    num_layers: int
    ignore: list[str]  # the ignore list in effect
    # a GPU worker's read-ahead copies the next layer to the device (False: it stays on the host until used); the
    # part's tensors then come as a ReadAhead, the host tensors they were copied from in its `host`
    reads_to_device: bool
    previews: bool  # quantize_* accept meta tensors (shapes and dtypes only) and return meta tensors
    checks_loading: bool  # transformers' loader check (child/loadcheck.py) applies to this format's output

    def begin(self, index: int, boundary: Boundary | None, fence: str = "") -> None:
        """Before part `index` (NON_LAYER included): `boundary` is the journaled input of layer `index` when the
        supervisor knows one (calibrated methods); a backend that keeps it in memory may ignore it. `fence`: the
        attempt's token (ExportLayer.fence), in the name of every file the backend writes for this part."""

    def quantize_layer(self, index: int, tensors: dict) -> dict:
        """Layer `index`'s checkpoint tensors (full names) in, the tensors of its output shard out (host memory;
        views of the worker's staging buffer are valid until the next part). A calibrated backend also has
        `inputs_ahead(index)` and takes `inputs=`: the worker may start layer `index` before its request, beside the
        previous layer's write (child/ahead.py)."""

    def quantize_non_layer(self, tensors: dict) -> dict:
        """Everything outside the decoder layers (embeddings, final norm, lm_head) in, its shard's tensors out."""

    def serialize(self, tensors: dict) -> tuple[dict, dict[str, str]]:
        """A part's quantized tensors as a shard stores them: plain CPU tensors and the safetensors `__metadata__`
        (the writer stores its keys in sorted order)."""

    # the last commit left the next layer's inputs being made durable in the background (named by the next settle)
    pending: bool

    def settle(self) -> Boundary | None:
        """After part `index`'s shard is durable, before commit: the inputs of part `index`, if an earlier commit
        left them pending, once durable (calibrated methods); None otherwise."""

    def commit(self, index: int) -> Boundary | None:
        """After settle(): whatever the next layer needs, named; None when there is nothing, or when it is being made
        durable in the background (`pending`)."""

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        """Write dest_dir/config.json (the source's config plus this format's quantization_config); its path."""

    def describe(self) -> str:
        """What drives the export, for `supervisor plan`: the model class, or the tensor-name rules."""


class ReadAhead(dict):
    """A part's tensors copied to the device by the worker's read-ahead (name -> device tensor), and in `host` the
    tensors they were copied from, as the source read them. A backend whose layer changes its parameters in place
    (calibration) measures errors against `host` instead of keeping a device copy of the source beside the layer."""

    def __init__(self, tensors: dict, host: dict) -> None:
        super().__init__(tensors)
        self.host = host


def make_backend(job: Job, config_dir: str, device: str, *, output: str = "", source=None,
                 stage: Callable[[str], None] = lambda name: None, calibration_sha256: str = "",
                 to_host: Callable[[dict], dict] | None = None,
                 sources_released: Callable[[], None] = lambda: None) -> Backend:
    """The backend for the job's format and method, ready for its first layer. `stage(name)` reports progress
    inside a part (calibrated methods: forward, calibrate, propagate, quantize). `to_host` brings a part's output
    tensors from the device to the host (the worker's pinned buffer, child/staging.py); data-free backends use it.
    `sources_released()`: a calibrated layer read ahead no longer holds its source tensors on the host, nor its
    calibration state on the device (the worker may copy the next layer onto the device now)."""
    from child.sources import open_source
    from shared.job import effective_ignore

    src = source if source is not None else open_source(job)
    names = src.all_names()
    if job.export.format == "torchao":
        from child.backends.torchao_backend import TorchaoBackend

        return TorchaoBackend(config_dir, job.export.scheme, job.export.torchao or {}, effective_ignore(job),
                              device=device, source_meta=src.meta(names))
    if job.export.format != "compressed-tensors":
        raise ValueError(f"unknown export format {job.export.format!r}")
    allow = job.source is not None and job.source.allow_remote_code  # a live model (no [source]) runs no code
    why = unknown_architecture(config_dir, allow)
    if is_calibrated(job):
        if why is not None:
            raise Refused(f"method {job.export.method!r} calibrates through the model's forward, which needs the "
                          f"architecture: {why}")
        from child.backends.calibrate import Calibrator

        return Calibrator(job, config_dir, device, output=output, source=source, stage=stage,
                          calibration_sha256=calibration_sha256, sources_released=sources_released)
    if why is None:
        from child.backends.quantize import LayerQuantizer

        return LayerQuantizer(config_dir, job.export.scheme, effective_ignore(job), device=device,
                              trust_remote_code=allow, tensor_names=names, to_host=to_host)
    from child.backends.name_only import NameOnlyQuantizer

    return NameOnlyQuantizer(config_dir, job.export.scheme, effective_ignore(job, by_names=True), names, device, why,
                             to_host=to_host)


def unknown_architecture(config_dir: str, allow_remote_code: bool) -> str | None:
    """None when transformers can build this checkpoint's causal LM, else why not (one line)."""
    import json
    import os

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with open(os.path.join(config_dir, "config.json")) as f:
        config = json.load(f)
    model_type = config.get("model_type")
    remote = "AutoModelForCausalLM" in (config.get("auto_map") or {})
    if remote and allow_remote_code:
        return None
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None  # remote code or not, transformers' own class is used (trust_remote_code=False)
    if remote:
        return (f"the checkpoint's model_type {model_type!r} needs its own code, which the job does not allow "
                "([source] allow_remote_code = false)")
    return f"transformers {_version()} has no causal-LM class for model_type {model_type!r}"


def _version() -> str:
    from shared.versions import installed

    return installed(("transformers",))["transformers"]
