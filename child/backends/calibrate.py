"""Calibrated quantization, one decoder layer at a time: GPTQ, AWQ and static activation scales, equal to oneshot.

The Backend for jobs that run calibration data through the model (child/backends/backend.py picks it). Per layer it
replays exactly what llm-compressor's sequential pipeline does for that layer's subgraph, with the library's own
session, modifiers, hooks and contexts, so the result is oneshot's by construction:

    begin(i, boundary)   inputs of layer i: kept in memory from layer i-1, or read from the journaled boundary file
                         (hash checked), or for layer 0 computed from the samples through the model's own forward
    quantize_layer(i)    in timed stages (layer 0's begin has two before them: embed-read, the embedding table onto
                         the device; embed, every sample through it into host memory)
      setup              layer i materialised on the device, rooted at its checkpoint path ("model.layers.i"), from
                         the copy the worker's read-ahead made there once layer i-1 let go of its sources (a GPU
                         worker's); with setup and forward run ahead, beside layer i-1's write, by a worker that
                         calibrates alone (inputs_ahead, child/ahead.py)
      forward            a fresh llm-compressor session on that layer (the recipe oneshot builds, initialized on it);
                         every sample through the layer with the modifiers' hooks (Hessians, observers, AWQ stats;
                         GPTQ's Hessians once per distinct input, child/backends/hessians.py)
      calibrate          sequential_epoch_end: GPTQ's solve, AWQ's smoothing, activation/weight qparams
      propagate          every sample through the calibrated layer, hooks off ─▶ BoundaryWriter (next layer's inputs)
      quantize           calibration_end, finalize, compress_module ─▶ the shard's tensors
    settle()             the file of layer i's inputs, written beside layer i, durable: named for the journal
    commit(i)            the inputs of i+1: one worker keeps them in RAM and writes their file while i+1 computes
                         (pending); a group's rank, or inputs on disk: made durable now (fsync, rename) and named

    what oneshot does                              here
    load the model (bf16), linearize MoE experts   meta skeleton from config.json, experts linearized (quantize.py)
    LengthAwareSampler order, truncation           child/backends/samples.py (the library's sampler)
    moe_calibration_context, norm context          entered around each layer's session
    calibration_forward_context, DisableQuant      no_grad, eval, eager attention (match_oneshot = false: SDPA;
                                                   AWQ on a GPU: its work between the products fused, same bits,
                                                   child/backends/eager_attention.py), use_cache off,
                                                   DisableQuantization
    trace: kwargs each layer receives              the model's own forward with stub layers records them

Memory: one layer on the device plus one sample's activations; the samples' hidden states live on the host
(boundary.Activations) or, above `resources.activation_ram_gb`, on disk. It must never import `supervisor`, never
change torch's thread count (the Exporter does), and keep nothing of a layer after its shard is returned.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
from concurrent.futures import Future
from typing import Callable

import psutil
import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from compressed_tensors.compressors import compress_module
from compressed_tensors.quantization.utils import is_module_quantized
from compressed_tensors.utils import match_named_modules, patch_attr
from llmcompressor.core import LifecycleCallbacks
from llmcompressor.core.session_functions import create_session
from llmcompressor.modeling.moe.context import moe_calibration_context
# _is_registered: the check norm_calibration_context itself makes, so the same norms are converted
from llmcompressor.modeling.offset_norm import NormCalibrationModule, _is_registered, norm_calibration_context
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier, get_layer_mappings_from_model
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor.modifiers.utils.pytorch_helpers import is_moe_model
from llmcompressor.pipelines.cache import IntermediatesCache
from llmcompressor.utils import helpers as llmcompressor_helpers
from llmcompressor.utils.helpers import DisableQuantization, eval_context
from llmcompressor.utils.metric_logging import CompressionLogger
from torch import nn
from transformers import AutoModelForCausalLM

from child import faults
from child.errors import Refused

from child.backends import awq_search, eager_attention, factorize, group, quant_error
from child.backends.awq_capture import AWQCapture
from child.backends.hessians import SharedHessians
from child.backends.boundary import Activations, BoundaryWriter, PendingWrite, host_buffer_meanwhile
from child.backends.naming import LayerStub, find_decoder_layers
from child.backends.quantize import LayerQuantizer, linearize_meta_experts, load_config, materialise, rooted
from child.backends.samples import calibration_ids
from child.staging import plain_to_host
from shared import layout
from shared.job import Job, effective_ignore
from shared.messages import Boundary

__all__ = ["Calibrator", "recipe"]


def recipe(method: str, scheme: str, ignore: list[str], awq_mappings=None, awq_offload=None) -> list:
    """The modifiers oneshot runs for this job, fresh (they hold per-layer state)."""
    if method == "gptq":
        return [GPTQModifier(targets="Linear", scheme=scheme, ignore=list(ignore))]
    quantize = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    if method == "awq":
        return [AWQModifier(mappings=awq_mappings, offload_device=awq_offload), quantize]
    return [quantize]


class Calibrator:
    """Backend for calibrated jobs: holds the activations crossing layers; see the module docstring."""

    # the next layer is copied to the GPU beside this layer's shard write, after its calibration state is gone
    # (child/exporter.py, _prefetch_onto_device): the GPU never holds two layers' calibration at once, and setup
    # no longer copies the layer from pageable memory on the layer's path (0.07-0.13 s of an 8B layer, measured)
    reads_to_device = True
    # meta tensors in, meta tensors out through the data-free quantizer of the same scheme: calibration changes
    # values, never which tensors a layer writes or their shapes, so `supervisor plan` and the loader check
    # before the first layer see the calibrated output's layout
    previews = True
    checks_loading = True  # its output is compressed-tensors: transformers' loader check applies at the end

    def __init__(self, job: Job, config_dir: str, device: str, *, output: str, source,
                 stage: Callable[[str], None] = lambda name: None, calibration_sha256: str = "",
                 sources_released: Callable[[], None] = lambda: None):
        self.job, self.output, self.source, self._stage = job, output, source, stage
        self._sources_released = sources_released  # see make_backend
        self.device = torch.device(device)
        self.method, self.scheme, self.ignore = job.export.method, job.export.scheme, effective_ignore(job)
        self._calibration_sha256 = calibration_sha256
        self.rank, self.world = group.rank(), group.world()  # a group's rank calibrates its own samples (child.backends.group)
        self.config = load_config(config_dir)
        # match_oneshot = false on a GPU: SDPA where the model has it (rounding only; docs/fidelity.md), else eager as
        # oneshot. Not on the CPU: there it moved a tiny model's o_proj loss by up to 1% (its input is the attention's
        # output), where the opt-in's other changes move the losses in their 7th digit
        sdpa = not job.calibration.match_oneshot and self.device.type == "cuda"
        self._model = _calibration_skeleton(self.config, sdpa=sdpa)
        self.layer_prefix, layers = find_decoder_layers(self._model, self.config)
        self.num_layers = len(layers)
        self._layers = list(layers)  # the real (meta) layers; the ModuleList gets stubs below
        self._awq_mappings = get_layer_mappings_from_model(self._model) if self.method == "awq" else None
        if self._awq_mappings is not None:
            _check_awq_mappings(type(self._model).__name__, self.layer_prefix, self._layers, self._awq_mappings)
        self._awq_offload = torch.device("cpu") if self.method == "awq" and is_moe_model(self._model) else None
        # AWQ's grid search runs the eager attention 21 times a layer: its work between the products fused where that
        # keeps every bit (child/backends/eager_attention.py; eager's chain as it is elsewhere)
        self._fused_attention = self.method == "awq" and eager_attention.applies(self._model, self.device) is None
        if self._fused_attention:
            print(f"{eager_attention.LOG_PREFIX} on (eager attention's work between its products fused, bit for bit)",
                  file=sys.stderr, flush=True)
        self._trunk_name = self.layer_prefix[:-1].rsplit(".", 1)[0] if "." in self.layer_prefix[:-1] else ""
        self._trunk = self._model.get_submodule(self._trunk_name)
        self._sink: dict[int, tuple] = {}
        self._stop_at = [0]
        for i in range(self.num_layers):
            layers[i] = LayerStub(self._layers[i], i, self._record_layer_call)
        _buffers_to(self._trunk, self.device)  # rotary frequencies etc.; parameters stay on meta
        # the non-layer shard and config.json: the data-free quantizer, configured by the recipe's quantizer
        # (its name map also turns the checkpoint's tensor names into the model's for each layer)
        self._plain = LayerQuantizer(config_dir, self.scheme, self.ignore, device=device,
                                     modifier=recipe(self.method, self.scheme, self.ignore)[-1],
                                     tensor_names=source.all_names() if source is not None else None)
        self._inputs: Activations | None = None  # the activations entering the next layer to export
        self._writer: BoundaryWriter | None = None  # the activations leaving the layer in progress
        # the file of self._inputs being written while they are used (commit_later): its name and its write
        self._pending: tuple[str, PendingWrite] | None = None
        self.pending = False  # the last commit left the next layer's inputs to be made durable (see commit)
        # the RAM of the last released inputs, reused by the next outputs; before layer 0's outputs, a Future of
        # their pinned memory, made while layer 0 calibrates (BoundaryWriter takes either)
        self._spare: torch.Tensor | Future | None = None
        self._pin = self.device.type == "cuda"
        self._args_key = None
        self._args = None
        self._fence = ""  # the current attempt's (begin)
        r = job.resources
        self._ram_budget = int(r.activation_ram_gb * 2**30) if r.activation_ram_gb else \
            psutil.virtual_memory().total // 4
        # the last layer's inputs need no file (_next_writer) where one worker calibrates and is never recycled (its
        # successor would find no inputs: shared.messages' Settle could name none)
        self._last_inputs_in_ram = self.world == 1 and not (r.recycle_after_layers or r.recycle_above_rss_mb)

    # ---- Backend -------------------------------------------------------------------------------------------
    def begin(self, index: int, boundary: Boundary | None, fence: str = "") -> None:
        """Make sure the inputs of layer `index` are at hand (the non-layer part needs none); every file this
        attempt writes carries `fence` in its name."""
        self._fence = fence
        if index < 0 or (self._inputs is not None and self._inputs.feeds == index):
            return
        self._drop_inputs()
        if index == 0:
            self._inputs = self._first_inputs()
        elif boundary is not None and boundary.feeds == index:
            size = boundary.nbytes
            self._inputs = Activations.load(os.path.join(self.output, boundary.file), boundary.digest, index,
                                            in_ram=2 * size <= self._ram_budget, pin=self._pin)
        else:
            raise RuntimeError(f"layer {index} needs the calibration inputs left by layer {index - 1}, "
                               "and no boundary was named for it")

    def inputs_ahead(self, index: int) -> Activations | None:
        """Layer `index`'s inputs while the layer before it is still being written (the outputs it propagated), for
        the worker to start layer `index` ahead (child/ahead.py): when one worker calibrates, holding them whole in
        RAM; None otherwise. Read-only: commit() of the layer before makes them its inputs, over the same memory."""
        writer = self._writer
        if self.world > 1 or writer is None or writer.feeds != index:
            return None
        return writer.peek()

    def quantize_layer(self, index: int, tensors: dict, inputs: Activations | None = None) -> dict:
        """`inputs`: layer `index`'s (inputs_ahead), for a layer started before begin(); else begin()'s."""
        if any(t.is_meta for t in tensors.values()):
            return self._plain.quantize_layer(index, tensors)  # a preview (see `previews`)
        inputs = inputs if inputs is not None else self._inputs
        if inputs is None or inputs.feeds != index:
            raise RuntimeError(f"layer {index}: begin() did not prepare its inputs")
        path = f"{self.layer_prefix}{index}"
        self._stage("setup")  # its weights onto the device, the library's session and hooks on it
        # loaded as the data-free quantizer loads a layer (checkpoint names mapped to the model's)
        mapped, layer, root = self._plain.materialise(path, self._layers[index], tensors, self.device)
        root.config = self.config  # norm_calibration_context reads model.config
        # the source weights each module's error is measured against, under the model's names: those the source
        # read (on the host, where the read-ahead copied the layer to the GPU), and where the layer's parameters are
        # those tensors themselves (the CPU), a copy, since calibration changes them in place (GPTQ's updates, AWQ's
        # scaling)
        read_ahead = getattr(tensors, "host", None) is not None  # a ReadAhead (child/backends/backend.py)
        host = tensors.host if read_ahead else tensors
        measured = quant_error.enabled and self.rank == 0
        sources = {m.key: host[k] for k, m in mapped.items() if m.fused is None} if measured else {}
        if measured:
            held = {_storage(p) for p in root.parameters()}
            sources = {k: t.clone() if _storage(t) in held else t for k, t in sources.items()}
        del host
        if read_ahead:
            # from here only `sources` holds the host tensors the source read (mapped file pages, counted in the
            # worker's RSS): once measured (or now, unmeasured) they are let go before the next layer's are read
            # onto the device, so the worker never maps two layers' weights at once
            tensors.host = {}
        # the next layer's copy onto the device (child/exporter.py): once the Hessians are gone (after the solve,
        # where the layer's peak GPU memory is) and this layer's sources too
        released = self._sources_released if read_ahead else (lambda: None)
        try:
            self._calibrate(index, layer, root, inputs, released if not measured else (lambda: None))
            if self.rank > 0:
                return None  # rank 0 writes the shard: after the broadcasts every rank holds the same layer
            self._stage("quantize")
            with torch.no_grad():
                quantized = [(n, m) for n, m in match_named_modules(root, self._plain._targets, self.ignore)
                             if is_module_quantized(m)]
                for _, m in quantized:
                    compress_module(m)
                # against the source weights (AWQ's scaling included); beside the shard's write it was no faster
                # (docs/performance.md, "Quantization error")
                quant_error.measure(quantized, sources)
                if measured:
                    sources.clear()
                    released()
                # off the device into fresh host memory, not the worker's pinned staging buffer (child/staging.py):
                # measured on an H200 (docs/benchmarks.md, 2026-12-02), that buffer took the quantize stage from
                # 0.22 to 0.18 s but, kept across layers, raised the worker's peak RSS per layer by 0.07 GiB
                return plain_to_host(_back_to_checkpoint_names(root.state_dict(), mapped))
        except BaseException:
            # this layer's outputs, if it got that far (not those of the layer before, which a layer started ahead
            # finds still being written)
            if self._writer is not None and self._writer.feeds == index + 1:
                self._writer.abort()
                self._writer = None
            raise

    def settle(self) -> Boundary | None:
        """The inputs of the layer in progress, whose file an earlier commit left being written, once durable
        (None: there was no such file: they came from a journaled file, the samples, or a synchronous commit)."""
        if self._pending is None:
            return None
        (name, write), self._pending = self._pending, None
        digest, size = write.wait()  # bounded: PendingWrite.wait (one file's write)
        return Boundary(feeds=self._inputs.feeds, file=name, digest=digest, nbytes=size)

    def commit(self, index: int) -> Boundary | None:
        """After layer `index`'s shard is durable (and settle()): the next layer's inputs, named. One worker holding
        them in RAM makes them durable in the background while the next layer computes (`pending` set; the next
        settle() names them); otherwise (a group's rank, inputs on disk) they are durable when this returns."""
        self.pending = False
        if index < 0:
            return None
        self.settle()  # a caller that did not ask still gets these inputs' file made durable before they go
        writer, self._writer = self._writer, None
        self._drop_inputs()
        if writer is None:  # the last layer: nothing follows it
            self._spare = None
            return None
        if not writer.has_file:  # the last layer's inputs, in RAM only (see _next_writer): no boundary named
            self._inputs, _, _ = writer.commit(None)
            return None
        name = self._boundary_name(index + 1)
        dest = os.path.join(self.output, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if writer.later:
            self._inputs, write = writer.commit_later(dest, lambda: faults.hit("boundary_sync", index + 1))
            self._pending, self.pending = (name, write), True
            return None
        self._inputs, digest, size = writer.commit(dest)
        return Boundary(feeds=index + 1, file=name, digest=digest, nbytes=size)

    def quantize_non_layer(self, tensors: dict) -> dict:
        if self._plain.non_layer_targets:
            raise NotImplementedError(f"calibrated exports quantize decoder layers only; ignore "
                                      f"{self._plain.non_layer_targets} (e.g. keep lm_head in [export] ignore)")
        if any(t.is_meta for t in tensors.values()):
            return self._plain.quantize_non_layer(tensors)  # a preview: the norms' round trip changes no shape
        return self._plain.quantize_non_layer(self._offset_norms_round_trip(tensors))

    def rewritten(self, names: list[str]) -> list[str]:
        """Of the non-layer part's source tensors, those this export writes with other values under the same name,
        dtype and shape: the offset norms' (see _offset_norms_round_trip). The supervisor copies the part ahead
        only when there are none (supervisor/run/verbatim.py)."""
        norms = [n + "." for n, m in self._model.named_modules() if _is_registered(type(m).__name__, NormCalibrationModule)]
        return [k for k in names if any(k.startswith(n) for n in norms)]

    def _offset_norms_round_trip(self, tensors: dict) -> dict:
        """oneshot converts every offset norm of the model ("(1 + weight)": Gemma, Qwen3-Next) to a standard one
        for calibration and back (norm_calibration_context), which rounds the weights; the final norm, outside
        the layers, goes through it too (measured on Gemma: 121 of 128 weights change by up to 0.0039)."""
        out = dict(tensors)
        for name, meta in self._model.named_modules():
            if not _is_registered(type(meta).__name__, NormCalibrationModule):
                continue
            own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
            module = materialise(meta, own, torch.device("cpu"), name)
            root = rooted(name, module)
            root.config = self.config
            with torch.no_grad(), norm_calibration_context(root):
                pass
            out.update({f"{name}.{k}": v for k, v in root.get_submodule(name).state_dict().items()})
        return out

    def serialize(self, tensors: dict) -> tuple[dict, dict[str, str]]:
        return self._plain.serialize(tensors)

    def describe(self) -> str:
        return f"{self._plain.describe()}, calibrated ({self.method})"

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        return self._plain.write_config(source_config_json, dest_dir)

    # ---- one layer's calibration ---------------------------------------------------------------------------
    def _calibrate(self, index: int, layer: nn.Module, root: nn.Module, inputs: Activations,
                   solved: Callable[[], None]) -> None:
        """`solved()`: called once the solve is over (its calibration state gone), as propagation starts."""
        with contextlib.ExitStack() as outer:
            outer.enter_context(group.collectives())  # a group's ranks: the library's own reductions and broadcasts
            outer.enter_context(_recorded_losses(root))
            outer.enter_context(_library_stages(self._stage))
            if not torch.accelerator.is_available():
                outer.enter_context(_no_pinning())
            if self.method == "awq" and self._model.config._attn_implementation != "eager":
                outer.enter_context(_attention_as_built())
            if self._fused_attention:
                outer.enter_context(eager_attention.installed(layer))  # its rotary embedding too
            # AWQ: its activation sums kept on the device, and each parent's unscaled outputs from this forward, not from
            # one more pass, where its cached arguments stay on the device (child/backends/awq_capture.py)
            if self.method == "awq":
                # its grid search without a wait for the GPU per candidate (child/backends/awq_search.py), wrapped by
                # the capture's bookkeeping
                # the library's own steps instead with SUPERVISOR_TEST_KERNELS=nosearch / nocapture (benches), its
                # passes as the library holds them with nosamplewise; each candidate's pass replayed from a CUDA graph
                # where its cached arguments stay on the device (child/backends/graphed_pass.py; nograph: eager)
                if faults.switched("search", True):
                    outer.enter_context(awq_search.installed(
                        samplewise=faults.switched("samplewise", True),
                        graphs=faults.switched("graph", True) and self._awq_offload is None))
                if faults.switched("capture", True):
                    outer.enter_context(AWQCapture(keep_outputs=self._awq_offload is None).installed())
            # GPTQ: one Hessian per distinct input (q/k/v, gate/up, ...), each module handed the one the library
            # would have computed for it, bit for bit (child/backends/hessians.py)
            fast = not self.job.calibration.match_oneshot  # [calibration] match_oneshot = false: tensor cores
            hessians = outer.enter_context(SharedHessians(copies=self.world > 1, fast=fast).installed()) \
                if self.method == "gptq" else None
            if fast and self.method == "gptq":  # GPTQ's update factor in half the flops (child/backends/factorize.py)
                outer.enter_context(factorize.installed())
            session = outer.enter_context(create_session())
            # oneshot.apply_recipe_modifiers: these contexts wrap initialize + the pipeline; finalize comes after
            with norm_calibration_context(root), moe_calibration_context():
                session.initialize(model=root, recipe=recipe(self.method, self.scheme, self.ignore,
                                                             self._awq_mappings, self._awq_offload), start=-1)
                LifecycleCallbacks.calibration_start()
                # the sequential pipeline: calibration_forward_context + DisableQuantization around every pass
                with torch.no_grad(), eval_context(root), DisableQuantization(root):
                    self._stage("forward")
                    # the next sample's copy to the device runs beside this one's forward (Activations.to_device)
                    for j, hidden in enumerate(inputs.to_device(self.device)):
                        session.state.current_batch_idx = j
                        self._forward(layer, index, hidden)
                        if hessians is not None:
                            hessians.end_sample()
                    # the last sample's copy on the device would outlive the loop into the solve, where the layer's
                    # peak is (16 MiB of an 8B layer's: measured with bench/calib_bench.py --stage-peaks)
                    hidden = None
                    if hessians is not None:
                        hessians.finish()
                    self._stage("calibrate")
                    LifecycleCallbacks.sequential_epoch_end(list(layer.modules()))
                    self._stage("propagate")
                    solved()
                    self._writer = self._next_writer(index, inputs)
                    with HooksMixin.disable_hooks():
                        for j, hidden in enumerate(inputs.to_device(self.device)):
                            out = self._forward(layer, index, hidden)
                            if self._writer is not None:
                                self._writer.put(j, out)
                    LifecycleCallbacks.calibration_end()
            session.finalize()

    def _forward(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self._layer_args(index, hidden.shape[1], hidden.dtype)
        # on the device already (Activations.to_device: its copy ran beside the previous sample)
        out = layer(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _next_writer(self, index: int, inputs: Activations) -> BoundaryWriter | None:
        if index + 1 >= self.num_layers:
            return None
        # the inputs are still held while the outputs are built: both count against the budget
        in_ram = 2 * inputs.nbytes <= self._ram_budget
        # the host memory of the inputs released a layer ago, or (layer 0) the one made meanwhile
        spare, self._spare = self._spare, None
        if in_ram and self._last_inputs_in_ram and index + 1 == self.num_layers - 1:
            # the last layer's inputs, held by the one worker that calibrates and is never recycled: in RAM only.
            # Their file would be made durable beside the last layer only to be unlinked once it is journaled (~0.45
            # s for a 2 GB file, after the last layer); without it a crash in the last layer redoes the one before
            # it too (whose inputs are then the newest durable boundary): the one more layer any crash may cost
            # (later: no file comes while the samples do, so each is copied into pinned memory without a wait)
            return BoundaryWriter(index + 1, inputs.shapes, inputs.dtype, tmp_path=None, keep_in_ram=True,
                                  buffer=spare, pin=self._pin, later=True)
        tmp = layout.state_path(self.output, layout.TMP, os.path.basename(self._boundary_name(index + 1)) + ".tmp")
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        # One worker writes the file after the layer (commit_later), beside the next one; a group's ranks commit in
        # step with each other, each as it propagates
        # the file: a spent one the supervisor left in the temp folder rewritten in place, where there is one
        # (supervisor/run/boundaries.py keeps them)
        return BoundaryWriter(index + 1, inputs.shapes, inputs.dtype, tmp_path=tmp, keep_in_ram=in_ram,
                              buffer=spare, pin=self._pin, later=self.world == 1, spares=os.path.dirname(tmp))

    def _boundary_name(self, feeds: int) -> str:
        return layout.boundary_name(feeds, self.rank if self.world > 1 else None, self._fence)

    def _drop_inputs(self) -> None:
        if self._pending is not None:  # inputs dropped before settle(): their file is not wanted (never named)
            (_, write), self._pending = self._pending, None
            write.abort()
        if self._inputs is not None:
            self._spare = self._inputs.close()
            self._inputs = None

    # ---- what the model feeds its decoder layers -----------------------------------------------------------
    def _record_layer_call(self, index: int, hidden_states, args, kwargs):
        """A stub layer's call (child.backends.naming.LayerStub): what the model passes decoder layer `index` is
        recorded, and the forward ends at the layer whose inputs were wanted."""
        self._sink[index] = (hidden_states, args, kwargs)
        if index >= self._stop_at[0]:
            raise _Reached()
        return hidden_states

    def _run_trunk(self, stop_at: int, **inputs) -> dict[int, tuple]:
        """Run the model's own forward up to decoder layer `stop_at` (stubs record their inputs) with the skeleton's
        attention (eager as llm-compressor's calibration context forces; SDPA with match_oneshot = false), no KV cache."""
        self._sink.clear()
        self._stop_at[0] = stop_at
        try:
            with torch.no_grad():
                self._trunk(**inputs)
        except _Reached:
            return dict(self._sink)
        raise RuntimeError("the model's forward never reached its decoder layers")

    def _layer_args(self, index: int, length: int, dtype: torch.dtype) -> tuple[tuple, dict]:
        """The arguments (besides hidden states) the model passes layer `index` for a sample of `length` tokens:
        causal mask, rotary embeddings, position ids... They depend on the length only, so samples (sorted by
        length) share them; they are recomputed on the device when the length changes, as oneshot computes them
        there once per sample."""
        key = (index, length)
        if self._args_key != key:
            self._args = None
            hidden = self.config.get_text_config().hidden_size
            sink = self._run_trunk(index, inputs_embeds=torch.zeros(1, length, hidden, dtype=dtype, device=self.device),
                                   attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device))
            _, args, kwargs = sink[index]
            self._args_key, self._args = key, (args, kwargs)
        return self._args

    def _first_inputs(self) -> Activations:
        """Layer 0's inputs: every sample's embeddings, computed by the model's own forward on the device."""
        c = self.job.calibration
        ids = calibration_ids(c.dataset, c.samples, c.seq_len, self.job.source.path, self._calibration_sha256,
                              self.config.get_text_config().vocab_size, rank=self.rank, world=self.world)
        self._stage("embed-read")  # the embedding table (and whatever else precedes the layers) onto the device
        names = [n for n, _ in self._trunk.named_parameters()]
        full = {f"{self._trunk_name}.{n}" if self._trunk_name else n: n for n in names}
        tensors = self.source.read(sorted(full))
        try:
            for key, value in tensors.items():
                # the checkpoint's dtype, as oneshot loads it (accelerate would cast to the skeleton's otherwise)
                set_module_tensor_to_device(self._trunk, full[key], self.device, value=value, dtype=value.dtype)
            self._stage("embed")  # every sample through it, into host memory (layer 0's, made here)
            writer = None
            for j, x in enumerate(ids):
                sink = self._run_trunk(0, input_ids=x.to(self.device),
                                       attention_mask=torch.ones_like(x, device=self.device))
                hidden = sink[0][0]
                if writer is None:
                    shapes = [(1, int(s.shape[1]), *hidden.shape[2:]) for s in ids]
                    size = sum(torch.Size(s).numel() for s in shapes) * hidden.dtype.itemsize
                    fits = 2 * size <= self._ram_budget
                    tmp = None if fits else layout.state_path(
                        self.output, layout.TMP, os.path.basename(self._boundary_name(0)) + ".tmp")
                    # in RAM: each sample copied into pinned memory without a wait (later: no file while they come)
                    writer = BoundaryWriter(0, shapes, hidden.dtype, tmp_path=tmp, keep_in_ram=fits, pin=self._pin,
                                            later=fits)
                    if fits and self._pin and self.num_layers > 1 and self._spare is None:
                        # layer 0's outputs: as much pinned memory, made meanwhile
                        self._spare = host_buffer_meanwhile(size // hidden.dtype.itemsize, hidden.dtype, self.device)
                writer.put(j, hidden)
            acts, _, _ = writer.commit(None)
            return acts
        finally:
            self._sink.clear()
            for n in names:  # the embedding table is needed for layer 0's inputs only
                set_module_tensor_to_device(self._trunk, n, "meta")


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's memory starts (views of one tensor share it)."""
    return t.untyped_storage().data_ptr()


class _Reached(Exception):
    """Raised by the stub of the layer whose inputs were wanted: the rest of the forward is not needed."""


def _back_to_checkpoint_names(state: dict, mapped: dict) -> dict:
    """The calibrated layer's tensors (every one: AWQ also rescales norms) under the checkpoint's names: a tensor
    the checkpoint holds keeps its name, a quantized module's tensors take its checkpoint module name, and fused
    experts are written per expert under their linearized names (as the data-free quantizer writes them)."""
    to_ckpt = {m.key: k for k, m in mapped.items() if m.fused is None}
    modules = {m.rsplit(".", 1)[0]: k.rsplit(".", 1)[0] for m, k in to_ckpt.items() if m.endswith(".weight")}
    out = {}
    for key, value in state.items():
        if key in to_ckpt:
            name = to_ckpt[key]
        else:
            module, param = key.rsplit(".", 1)
            name = f"{modules.get(module, module)}.{param}"
        out[name] = value
    return out


def _calibration_skeleton(config, sdpa: bool = False) -> nn.Module:
    """The model with parameters on meta but real buffers (rotary frequencies...), no KV cache, and eager attention
    as llm-compressor's calibration forces; with `sdpa` (match_oneshot = false) PyTorch's fused attention where the
    architecture supports it: the same softmax(QK^T)V without the [heads, tokens, tokens] matrices in memory, a change
    of rounding only."""
    config = copy.deepcopy(config)
    config.use_cache = False
    text = config.get_text_config()
    text.use_cache = False
    with init_empty_weights(include_buffers=False):
        try:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False,
                                                     attn_implementation="sdpa" if sdpa else "eager")
        except ValueError:  # transformers: "does not support an attention implementation through sdpa"
            if not sdpa:
                raise
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, attn_implementation="eager")
    linearize_meta_experts(model)
    model.eval()
    return model


def _check_awq_mappings(arch: str, prefix: str, layers: list, mappings: list) -> None:
    """Refuse (before anything is written) an AWQ job whose layers llm-compressor's AWQ cannot smooth: the mappings it
    picks for the architecture (its registry, else Llama's) match a layer's modules in an incomplete set, which oneshot
    fails on at its first layer, or match nothing in any layer, which would make AWQ a silent round-to-nearest. The
    check is the library's own matching (match_modules_set, as AWQModifier resolves its mappings at each layer's
    calibration start), on each distinct kind of meta layer rooted at its path (a 48-layer, 128-expert MoE has one
    kind, or two with a dense first layer: checking the whole model took 0.9 s there)."""
    import llmcompressor
    from compressed_tensors.utils import match_modules_set
    from llmcompressor.modifiers.transform.awq import AWQ_DYNAMIC_MAPPING_REGISTRY, AWQ_MAPPING_REGISTRY

    which = "registered for it" if arch in AWQ_MAPPING_REGISTRY or arch in AWQ_DYNAMIC_MAPPING_REGISTRY else \
        "Llama's, the default: none are registered for it"
    lib = f"llm-compressor {llmcompressor.__version__}"
    found, kinds = 0, set()
    for index, layer in enumerate(layers):
        kind = tuple((name, type(m).__name__) for name, m in layer.named_modules())
        if kind in kinds:
            continue
        kinds.add(kind)
        root = rooted(f"{prefix}{index}", layer)
        for m in mappings:
            try:
                for smooth, *_ in match_modules_set(root, (m.smooth_layer, *m.balance_layers)):
                    if len(smooth) > 1:  # as AWQModifier._set_resolved_mappings refuses it
                        raise ValueError(f"{len(smooth)} modules match the smooth layer {m.smooth_layer!r} in one set")
                    found += 1
            except ValueError as exc:
                why = " ".join(str(exc).split())
                raise Refused(f"method \"awq\" cannot calibrate {arch}: {lib}'s AWQ mappings for it ({which}) do "
                              f"not fit the modules of layer {index} ({why}); use method = \"gptq\"") from None
    if not found:
        raise Refused(f"method \"awq\" would change nothing in {arch}: none of {lib}'s AWQ mappings for it "
                      f"({which}) matches its layers' modules; use method = \"gptq\"")


def _buffers_to(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


@contextlib.contextmanager
def _no_pinning():
    # llm-compressor 0.14.0.1's AWQ pins its cached activations before each grid search, which raises
    # "Cannot access accelerator device when none is available" on a machine without one (measured). Pinning
    # only speeds up host->device copies and never changes a value, so without an accelerator it is skipped.
    with patch_attr(IntermediatesCache, "_pin_intermediate", classmethod(lambda cls, value: None)):
        yield


@contextlib.contextmanager
def _attention_as_built():
    # match_oneshot = false on a GPU builds the layers with SDPA (_calibration_skeleton). AWQ's grid search enters
    # calibration_forward_context, whose use_eager_attention would switch the model back to eager attention for it,
    # where 64% of an 8B layer's search goes (bench/awq_probe.py) and where the cached SDPA arguments (no causal mask
    # tensor) would not fit: so the attention the layers were built with stays (rounding only, docs/fidelity.md).
    with patch_attr(llmcompressor_helpers, "use_eager_attention", lambda model: contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _recorded_losses(root: nn.Module):
    # GPTQ hands each module's loss to its CompressionLogger (which logs it rounded to two decimals); kept here as
    # the library computed it, for `supervisor report` and the group's fidelity checks (in a group, each module's
    # owner rank computes it)
    names = {m: n for n, m in root.named_modules()}
    original = CompressionLogger.set_results

    def set_results(self, name=None, loss=None):
        if loss is not None and self.module in names:
            quant_error.record_loss(names[self.module], loss)
        return original(self, name=name, loss=loss)

    with patch_attr(CompressionLogger, "set_results", set_results):
        yield


@contextlib.contextmanager
def _library_stages(stage: Callable[[str], None]):
    # the steps of GPTQ's sequential_epoch_end, as stages (timed, shown, fault points): a group's ranks reduce each
    # Hessian to its owner, solve their own modules, broadcast the results (the broadcast of a static-scale
    # QuantizationModifier too); one worker only solves
    from llmcompressor.modifiers.gptq import base as gptq
    from llmcompressor.modifiers.quantization.quantization import base as quantization

    def staged(name: str, fn):
        def run(*args, **kwargs):
            stage(name)
            try:
                return fn(*args, **kwargs)
            finally:
                stage("calibrate")
        return run

    with patch_attr(GPTQModifier, "_reduce_hessian_to_target_rank",
                    staged("reduce", GPTQModifier._reduce_hessian_to_target_rank)), \
            patch_attr(GPTQModifier, "compress_module_list", staged("solve", GPTQModifier.compress_module_list)), \
            patch_attr(gptq, "broadcast_qparams_and_cleanup", staged("broadcast", gptq.broadcast_qparams_and_cleanup)), \
            patch_attr(quantization, "broadcast_qparams_and_cleanup",
                       staged("broadcast", quantization.broadcast_qparams_and_cleanup)):
        yield
