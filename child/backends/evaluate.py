"""`verify --quality` in a worker: held-out samples through the source and the export, one decoder layer of each.

    Evaluator (a worker whose Hello carries `evaluate`)
      two Streams, one per model, each built the way transformers' from_pretrained builds that folder:
        source   the export's own source checkpoint, read through child.sources.open_source (the job's LoRA
                 adapter merged exactly as the export merged it), loaded into a model without a quantizer
        export   the finished folder: its config.json's quantization_config through transformers' own
                 HfQuantizer (compressed-tensors: apply_quantization_config + compress_model before the weights,
                 every quantized module decompressed after them, activations quantized where the scheme says;
                 torchao: its own tensor subclasses, run as torchao runs them)
        per layer: a meta skeleton with real buffers; transformers' convert_and_load_state_dict_in_model puts the
        layer's tensors in (its weight conversions: fused MoE experts, renames), the layer runs, and goes back to meta
      EvaluateLayer(0)      the samples' embeddings, through each model's own forward (stub layers record them)
      EvaluateLayer(i)      inputs (host RAM, or the journaled boundary file) ─▶ source layer i, export layer i
                            ─▶ per-layer error of the outputs ─▶ BoundaryWriter (both streams interleaved:
                            sample j's source states at 2j, its export states at 2j + 1), written (not
                            fsynced: see "Crash safety" below) before the reply names it
      EvaluateLayer(L)      each model's own forward with every layer a stub (layer 0's hands over the last
                            layer's outputs): final norm, head (and any softcapping) ─▶ kl, top1, ppl (float32)

The arguments every layer receives (causal mask, rotary embeddings, position ids) come from the model's own
forward with stub layers, per sample length, as child/backends/calibrate.py gets them. Memory: one layer of each model on the
device, the non-layer tensors (embeddings, final norm, head) of both, and one sample's activations; the samples'
hidden states on the host or, past `resources.activation_ram_gb`, on disk (child.backends.boundary). It must never import
`supervisor`, never write outside OUT/.export, and keeps nothing of a layer after its reply.

Crash safety: a boundary file is written and renamed but not fsynced (BoundaryWriter sync=False). A file in the
page cache survives the death of any process (a worker or the supervisor SIGKILLed costs at most the layer being
measured); only the machine's own crash can lose it, and then the resume re-hashes it against its journaled digest
(supervisor/run/quality.py `_start_at`) and measures from the samples again. Waiting for the disk instead would set
the pace: the 8B shape's two streams are 2 GiB a layer, 1.5-2 s at the H200 machine's ~1.2 GB/s, against ~0.7 s of
compute (docs/benchmarks.md).
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
from concurrent.futures import Future
from typing import Callable

import psutil
import torch
from torch import nn

from child import faults
from child.backends.boundary import Activations, BoundaryWriter, host_buffer_meanwhile
from child.errors import Refused
from child.process import peak_rss
from child.backends.naming import LayerStub, find_decoder_layers
from shared import calibdata, layout
from shared.messages import Boundary, EvaluateLayer, Hello, LayerEvaluated, QualityMeasured

QUALITY = "quality"  # .export/quality/: the quality journal and its boundary files


def boundary_name(feeds: int, fence: str) -> str:
    return f"{layout.STATE_DIR}/{QUALITY}/inputs-layer-{feeds:05d}.{fence or 'x'}.bin"


class _Reached(Exception):
    pass


def _stub_call(box: dict):
    """What a stub layer (child.backends.naming.LayerStub) does here: records what it is passed; the one at
    `stop_at` ends the forward; `substitute` (layer 0's) replaces the hidden states it is handed."""
    def call(index: int, hidden_states, args, kwargs):
        box[index] = (hidden_states, args, kwargs)
        if index == box.get("stop_at"):
            raise _Reached()
        if index == 0 and "substitute" in box:
            return box["substitute"]
        return hidden_states
    return call


class Stream:
    """One model (the source or the export), built as transformers' from_pretrained builds its folder, whose
    tensors come in one decoder layer at a time."""

    def __init__(self, folder: str, reader, device: torch.device, quantized: bool):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.quantizers.auto import get_hf_quantizer

        self.reader, self.device, self.folder = reader, device, folder
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        config._attn_implementation = "eager"  # as the calibrated export runs its layers (child/backends/calibrate.py)
        config.use_cache = False
        config.get_text_config().use_cache = False
        if not quantized and getattr(config, "quantization_config", None) is not None:
            raise Refused(f"the export's source {folder!r} is itself quantized; quality needs a 16-bit source")
        self.hf_quantizer, config, _ = get_hf_quantizer(config, None, None, True, {})
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or
                                                                                             "bfloat16"))
        self.config, self.dtype = config, dtype
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        files = _checkpoint_files(folder)  # torchao's quantizer reads its tensors' metadata from them
        with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary frequencies) real
            model = cls._from_config(copy.deepcopy(config), dtype=dtype)
            if self.hf_quantizer is not None:
                self.hf_quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": device},
                                                   checkpoint_files=files, use_kernels=False)
        model.eval()
        for sub in model.modules():  # buffers to the device
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)
        self.model = model
        self.prefix, self.layers = find_decoder_layers(model, config)
        self.num_layers = len(self.layers)
        trunk = self.prefix[:-1].rsplit(".", 1)[0] if "." in self.prefix[:-1] else ""
        self.trunk = model.get_submodule(trunk)
        self._load_config = LoadStateDictConfig(
            pretrained_model_name_or_path=folder, dtype=dtype, dtype_plan=model._get_dtype_plan(dtype),
            device_map={"": device}, hf_quantizer=self.hf_quantizer,
            weight_mapping=get_model_conversion_mapping(model, None, self.hf_quantizer))
        self._args_key = None
        self._args = None
        self._decompressed: set[int] = set()

    # ---- tensors in and out ---------------------------------------------------------------------------------
    def load(self, names: list[str]) -> None:
        """The named tensors into the model, through transformers' loader (conversions, quantizer), then the
        quantized modules among them decompressed as the HfQuantizer does after loading."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        tensors = self.reader.read(names)
        convert_and_load_state_dict_in_model(model=self.model, state_dict=dict(tensors), load_config=self._load_config)
        del tensors
        q = self.hf_quantizer
        if q is not None and type(q).__name__ == "CompressedTensorsHfQuantizer" \
                and q.quantization_config.is_quantization_compressed:
            # what compressor.decompress_model does (after loading with dequantize=True, or by its hook on the first
            # forward by default), here over the modules just loaded
            from compressed_tensors.compressors import decompress_module
            from compressed_tensors.quantization.utils import is_module_quantized

            for m in self.model.modules():
                if id(m) not in self._decompressed and is_module_quantized(m) \
                        and any(not p.is_meta for p in m.parameters(recurse=False)):
                    decompress_module(m, q.compressor.force_compression_format)
                    self._decompressed.add(id(m))
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    def unload(self, module: nn.Module) -> None:
        module.to("meta")

    def layer(self, index: int) -> nn.Module:
        return self.layers[index]

    # ---- the model's own forward around the layers ----------------------------------------------------------
    def _forward_with_stubs(self, box: dict, fn: Callable):
        real, call = list(self.layers), _stub_call(box)
        for k in range(len(real)):
            self.layers[k] = LayerStub(real[k], k, call)
        try:
            with torch.no_grad():
                return fn()
        except _Reached:
            return None
        finally:
            for k in range(len(real)):
                self.layers[k] = real[k]

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        box = {"stop_at": 0}
        self._forward_with_stubs(box, lambda: self.trunk(input_ids=ids.to(self.device),
                                                         attention_mask=torch.ones_like(ids, device=self.device)))
        return box[0][0]

    def layer_args(self, index: int, length: int) -> tuple[tuple, dict]:
        key = (index, length)
        if self._args_key != key:
            hidden = self.config.get_text_config().hidden_size
            box = {"stop_at": index}
            self._forward_with_stubs(box, lambda: self.trunk(
                inputs_embeds=torch.zeros(1, length, hidden, dtype=self.dtype, device=self.device),
                attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device)))
            _, args, kwargs = box[index]
            self._args_key, self._args = key, (args, kwargs)
        return self._args

    def run_layer(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.layer_args(index, hidden.shape[1])
        with torch.no_grad():  # from pinned host memory without a wait (the stream orders the layer after it)
            out = self.layers[index](hidden.to(self.device, non_blocking=True), *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, last: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        box = {"substitute": last.to(self.device, non_blocking=True)}
        out = self._forward_with_stubs(box, lambda: self.model(input_ids=ids.to(self.device),
                                                               attention_mask=torch.ones_like(ids, device=self.device),
                                                               use_cache=False))
        return out.logits[0].float()


def _checkpoint_files(folder: str) -> list[str]:
    import json

    index = os.path.join(folder, layout.INDEX)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    return [os.path.join(folder, n) for n in names]


def held_out_ids(spec, tokenizer_dir: str, vocab_size: int, max_positions: int | None) -> list[torch.Tensor]:
    """The held-out samples as token ids [1, L] (file order), as [calibration] reads and tokenizes them."""
    from child.backends.samples import tokenize  # the calibration path's tokenizer handling (truncation to seq_len)

    try:
        rows = calibdata.read_rows(spec.dataset, spec.samples, vocab_size)
    except calibdata.CalibrationDataError as exc:
        raise Refused(str(exc).replace("calibration dataset", "held-out file")) from None
    if spec.sha256 and rows.sha256 != spec.sha256:
        raise Refused(f"held-out file {spec.dataset!r} changed since the run started; run again")
    tokens = tokenize(rows.samples, spec.seq_len, tokenizer_dir) if rows.has_text else rows.samples
    out = []
    for number, t in enumerate(tokens, start=1):
        t = list(t)[:spec.seq_len]
        if max_positions and len(t) > max_positions:
            raise Refused(f"held-out file {spec.dataset!r} line {number} has {len(t)} tokens, more than the "
                          f"model's {max_positions} positions; lower --seq-len to {max_positions} or shorten it")
        out.append(torch.tensor([t], dtype=torch.long))
    return out


class Evaluator:
    """What a quality worker does with EvaluateLayer; see the module docstring."""

    def __init__(self, hello: Hello, beat, stage: Callable[[int | None, str], None]):
        from child.sources import open_source
        from child.sources.checkpoint import Checkpoint

        job, self.spec, self.output = hello.job, hello.evaluate, hello.output
        if job.resources.torch_threads:
            torch.set_num_threads(job.resources.torch_threads)
        self.device = torch.device(hello.device)
        self._stage = stage
        self.source = Stream(job.source.path, open_source(job), self.device, quantized=False)
        self.export = Stream(hello.output, Checkpoint(hello.output), self.device, quantized=True)
        if self.source.num_layers != self.export.num_layers:
            raise Refused(f"the export has {self.export.num_layers} decoder layers, its source "
                          f"{self.source.num_layers}")
        self.prefix, self.num_layers = self.export.prefix, self.export.num_layers
        for s in (self.source, self.export):  # embeddings, final norm, head: on the device for the whole run
            s.load(s.reader.non_layer_names(s.prefix, s.num_layers))
        text = self.export.config.get_text_config()
        self.ids = held_out_ids(self.spec, job.source.path, text.vocab_size,
                                getattr(text, "max_position_embeddings", None))
        self._inputs: Activations | None = None
        self._pending = None  # (the boundary being written, its PendingWrite)
        # the host memory of the last released inputs, for the next outputs; before layer 0's outputs, a Future of
        # theirs, made while the embeddings are computed (BoundaryWriter takes either)
        self._spare: torch.Tensor | Future | None = None
        self._pin = self.device.type == "cuda"
        r = job.resources
        self._ram_budget = int(r.activation_ram_gb * 2**30) if r.activation_ram_gb else \
            psutil.virtual_memory().total // 4

    def _gpu(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        return False

    def evaluate(self, msg: EvaluateLayer):
        t0 = time.monotonic()
        index = msg.index
        gpu = self._gpu()
        self._begin(index, msg.boundary)
        if index == self.num_layers:
            return self._figures(t0)
        self._stage(index, "read")
        t_read = time.monotonic()
        for s in (self.source, self.export):
            s.load(s.reader.layer_names(s.prefix, index))
            unloaded = [n for n, p in s.layer(index).named_parameters() if p.is_meta]
            if unloaded:  # transformers would initialise these at random: no figure of that is worth reporting
                raise Refused(f"transformers' loader leaves {len(unloaded)} weights of layer {index} unloaded in "
                              f"{s.folder} (e.g. {unloaded[0]}); see `supervisor verify` without --quality")
        faults.hit("evaluate", index)
        self._stage(index, "forward")
        t_forward = time.monotonic()
        inputs = self._inputs
        n = len(self.ids)
        dest = os.path.join(self.output, boundary_name(index + 1, msg.fence))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fits = 2 * inputs.nbytes <= self._ram_budget
        # in RAM: the file is written while the next layer computes (commit_later), named in the next reply
        # the host memory of the inputs released a layer ago, or (layer 0) the one made meanwhile
        spare, self._spare = self._spare, None
        # each sample's states go to the file as soon as they are in host memory (stream): the write runs beside
        # this layer and the next, and the next reply waits for it (_settle) only where the disk is slower than both
        writer = BoundaryWriter(index + 1, inputs.shapes, inputs.dtype, tmp_path=dest + ".tmp", keep_in_ram=fits,
                                buffer=spare, pin=self._pin, later=True, sync=False, stream=True)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # squared error, squared source, cosines
        positions = 0
        try:
            for j in range(n):  # no host sync per sample: the device runs ahead of the loop (one .tolist() below)
                hs = self.source.run_layer(index, inputs.get(2 * j))
                he = self.export.run_layer(index, inputs.get(2 * j + 1))
                a, b = hs.float().reshape(-1, hs.shape[-1]), he.float().reshape(-1, he.shape[-1])
                sums[0] += ((b - a) ** 2).sum(dtype=torch.float64)
                sums[1] += (a ** 2).sum(dtype=torch.float64)
                sums[2] += torch.nn.functional.cosine_similarity(b, a, dim=-1).sum(dtype=torch.float64)
                positions += a.shape[0]
                writer.put(2 * j, hs.to(inputs.dtype))
                writer.put(2 * j + 1, he.to(inputs.dtype))
            diff2, ref2, cos = sums.tolist()
            self._stage(index, "write")
            t_write = time.monotonic()  # the device's work is done (sums.tolist() waited for it)
            settled = self._settle()  # the inputs of this layer, written meanwhile
            print(f"quality: layer {index}: inputs {t_read - t0:.2f} s, load {t_forward - t_read:.2f} s, forward "
                  f"{t_write - t_forward:.2f} s, waited {time.monotonic() - t_write:.2f} s for its inputs' file",
                  file=sys.stderr, flush=True)  # the worker's log (bench/quality_bench.py prints it)
            boundary, pending = None, None
            if writer.later:
                acts, pending = writer.commit_later(dest)
            else:
                acts, digest, size = writer.commit(dest)
                boundary = Boundary(feeds=index + 1, file=boundary_name(index + 1, msg.fence), digest=digest,
                                    nbytes=size)
        except BaseException:
            writer.abort()
            raise
        for s in (self.source, self.export):
            s.unload(s.layer(index))
        self._drop_inputs()
        self._inputs = acts
        if pending is not None:
            self._pending = (Boundary(feeds=index + 1, file=boundary_name(index + 1, msg.fence), digest="",
                                      nbytes=0), pending)
        return LayerEvaluated(index=index, rel_error=math.sqrt(diff2 / ref2) if ref2 else 0.0,
                              cosine=cos / max(positions, 1), boundary=boundary, pending=pending is not None,
                              settled=settled,
                              seconds=round(time.monotonic() - t0, 3), peak_rss=peak_rss(),
                              peak_gpu=int(torch.cuda.max_memory_allocated(self.device)) if gpu else 0)

    def _settle(self) -> Boundary | None:
        """The boundary the previous reply left pending, once written (None: none was)."""
        if self._pending is None:
            return None
        (b, write), self._pending = self._pending, None
        digest, size = write.wait()  # bounded: PendingWrite.wait (one file's write)
        return Boundary(feeds=b.feeds, file=b.file, digest=digest, nbytes=size)

    def _begin(self, index: int, boundary: Boundary | None) -> None:
        if self._inputs is not None and self._inputs.feeds == index:
            return
        self._drop_inputs(abort=True)
        if index == 0:
            self._inputs = self._first_inputs()
        elif boundary is not None and boundary.feeds == index:
            self._inputs = Activations.load(os.path.join(self.output, boundary.file), boundary.digest, index,
                                            in_ram=2 * boundary.nbytes <= self._ram_budget, pin=self._pin)
        else:
            raise RuntimeError(f"quality: layer {index} needs the inputs left by layer {index - 1}, and none "
                               "were named")

    def _first_inputs(self) -> Activations:
        self._stage(0, "embed")
        writer = None
        for j, x in enumerate(self.ids):
            hs, he = self.source.embeddings(x), self.export.embeddings(x)
            if writer is None:
                shapes = []
                for y in self.ids:
                    shapes += [(1, int(y.shape[1]), *hs.shape[2:])] * 2
                size = sum(math.prod(s) for s in shapes) * hs.dtype.itemsize
                fits = 2 * size <= self._ram_budget
                tmp = None if fits else os.path.join(self.output, boundary_name(0, "first")) + ".tmp"
                if tmp:
                    os.makedirs(os.path.dirname(tmp), exist_ok=True)
                writer = BoundaryWriter(0, shapes, hs.dtype, tmp_path=tmp, keep_in_ram=fits, pin=self._pin)
                if fits and self._pin and self._spare is None:
                    # layer 0's outputs need as much page-locked memory: made meanwhile
                    self._spare = host_buffer_meanwhile(sum(map(math.prod, shapes)), hs.dtype, self.device)
            writer.put(2 * j, hs)
            writer.put(2 * j + 1, he.to(hs.dtype))
        acts, _, _ = writer.commit(None)
        return acts

    def _figures(self, t0: float) -> QualityMeasured:
        self._stage(self.num_layers, "head")
        inputs = self._inputs
        # the sums stay on the device, added in sample order in float64 as Python floats would be (the same
        # figures, bit for bit), and are read once at the end: no host sync per sample stalls the device
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # kl, nll source, nll export
        agree = torch.zeros((), dtype=torch.int64, device=self.device)
        positions = predicted = 0
        for j, x in enumerate(self.ids):
            ls = torch.log_softmax(self.source.logits(inputs.get(2 * j), x), dim=-1)
            le = torch.log_softmax(self.export.logits(inputs.get(2 * j + 1), x), dim=-1)
            sums[0] += torch.nn.functional.kl_div(le, ls, log_target=True, reduction="none").sum(-1) \
                .sum(dtype=torch.float64)
            agree += (ls.argmax(-1) == le.argmax(-1)).sum()
            positions += ls.shape[0]
            nxt = x[0, 1:].to(ls.device)
            if nxt.numel():
                sums[1] -= ls[:-1].gather(-1, nxt[:, None]).sum(dtype=torch.float64)
                sums[2] -= le[:-1].gather(-1, nxt[:, None]).sum(dtype=torch.float64)
                predicted += nxt.numel()
        kl, nll_s, nll_e = sums.tolist()
        top1 = int(agree)
        t_done = time.monotonic()
        self._drop_inputs(abort=True)  # the last layer's file, never to be named: its write ends where it is
        print(f"quality: head: logits and figures {t_done - t0:.2f} s, {time.monotonic() - t_done:.2f} s to drop the "
              "last layer's file", file=sys.stderr, flush=True)  # the worker's log (bench/quality_bench.py)
        return QualityMeasured(kl=kl / positions, top1=top1 / positions,
                               ppl_source=math.exp(nll_s / predicted) if predicted else float("nan"),
                               ppl_export=math.exp(nll_e / predicted) if predicted else float("nan"),
                               samples=len(self.ids), tokens=positions, seconds=round(time.monotonic() - t0, 3))

    def _drop_inputs(self, abort: bool = False) -> None:
        if abort and self._pending is not None:  # its file is not wanted any more (never named)
            (_, write), self._pending = self._pending, None
            write.abort()
        if self._inputs is not None and self._pending is None:
            flat = self._inputs.close()
            self._spare = None if abort else flat
            self._inputs = None
