"""The name-only Backend: a data-free export of a checkpoint transformers does not know, on tensor names alone.

    config.json (any model_type) ─▶ layers from tensor names (shared/tensor_names.py), no model class
    {name: tensor} of layer i ─────▶ llm-compressor's ModelFreePtqConverter.process (what `model_free_ptq` runs
                                     on each shard file: every targeted, non-ignored `*.weight` whose module name
                                     does not end in "norm" becomes a quantized Linear; NVFP4 fuses q/k/v and
                                     gate/up (w1/w3) global scales by name; fused 3D experts are split first)
    config.json ───────────────────▶ the source config + model_free_ptq's quantization_config (its update_config)

Used when transformers cannot build the model (an unknown `model_type`, or remote code the job did not allow):
the same crash safety, one layer per part and resume as any export, output equal to `model_free_ptq`'s for the same
scheme and ignore list. Calibrated schemes need a forward pass, hence the architecture: refused. By name alone the
embeddings look like any other weight; the default ignore list adds them (shared.job.NAME_ONLY_IGNORE), so they stay
dense as in an export of a known architecture.

Owns that arithmetic path only; it never reads the source (the Exporter hands it tensors) and writes only config.json.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import torch

from child.backends.data_free import DataFree
from child.errors import Refused
from child.staging import plain_to_host
from shared import tensor_names
from shared.layout import SHARD_METADATA

__all__ = ["NameOnlyQuantizer"]


class NameOnlyQuantizer(DataFree):
    """Backend over llm-compressor's model_free_ptq converter, one layer (or the non-layer part) at a time."""

    previews = True
    checks_loading = True  # it reports "not checked" when transformers cannot build the architecture
    reads_to_device = True  # the read-ahead's copy to the GPU overlaps the previous layer's work

    def __init__(self, config_dir: str, scheme: str, ignore: list[str], names: list[str], device: str = "cpu",
                 why: str = "transformers does not know this architecture", to_host=None):
        from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter
        from llmcompressor.entrypoints.model_free.validate import validate_config

        self.scheme, self.ignore, self.device, self.why = scheme, list(ignore), torch.device(device), why
        self._to_host = to_host or plain_to_host
        with open(os.path.join(config_dir, "config.json")) as f:
            config = json.load(f)
        found = tensor_names.find_layers(names, config)
        if found is None:
            raise Refused(f"{why}, and no tensor name holds a layer number to export it layer by layer")
        self.layer_prefix, indices = found
        self.num_layers = tensor_names.config_layers(config) or len(indices)
        try:
            self._config = validate_config(None, scheme, self.ignore)
        except ValueError as exc:  # model_free_ptq's own refusal: activations it cannot calibrate
            raise Refused(f"scheme {scheme} cannot be exported by tensor names ({why}): {exc}") from exc
        self._converter = ModelFreePtqConverter(self._config)
        self._probes: dict = {}

    def quantize_layer(self, index: int, tensors: dict) -> dict:
        return self._process(tensors)

    def quantize_non_layer(self, tensors: dict) -> dict:
        return self._process(tensors)

    def serialize(self, tensors: dict) -> tuple[dict, dict[str, str]]:
        return tensors, dict(SHARD_METADATA)

    def write_config(self, source_config_json: str, dest_dir: str) -> str:
        """The source config.json with model_free_ptq's quantization_config (its own update_config writes it)."""
        from llmcompressor.entrypoints.model_free.save_utils import update_config

        path = os.path.join(dest_dir, "config.json")
        shutil.copyfile(source_config_json, path)
        update_config(dest_dir, self._config)
        return path

    def describe(self) -> str:
        return f"tensor names, as llm-compressor's model_free_ptq ({self.why})"

    def _process(self, tensors: dict) -> dict:
        if any(t.is_meta for t in tensors.values()):
            return self._preview(tensors)
        moved = {k: v.to(self.device) for k, v in tensors.items()}
        return self._to_host(self._converter.process(moved))

    def _preview(self, tensors: dict) -> dict:
        """The output's names, shapes and dtypes on meta: each quantized tensor's compressed twin is computed once per
        (shape, dtype) on random CPU data (model_free's meta path is slow and packs no W4A16_ASYM zero point)."""
        from compressed_tensors.utils import match_quantizable_tensors
        from llmcompressor.entrypoints.model_free.converter import split_fused_moe_experts
        from llmcompressor.entrypoints.model_free.lifecycle import validate_weight_for_quantization

        tensors = split_fused_moe_experts(dict(tensors))
        out = dict(tensors)
        matched: set[str] = set()
        for group, scheme in self._config.config_groups.items():
            for module, name in match_quantizable_tensors(tensors, self._config.ignore, scheme.targets):
                if name in matched:
                    continue
                matched.add(name)
                validate_weight_for_quantization(tensors[name], scheme, name)  # model_free's error, with the name
                del out[name]
                for param, t in self._probe(group, tensors[name]).items():
                    out[f"{module}.{param}"] = t
        return out

    def _probe(self, group: str, weight: torch.Tensor) -> dict:
        key = (group, tuple(weight.shape), weight.dtype)
        if key not in self._probes:
            real = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            done = self._converter.process({"probe.weight": real})
            self._probes[key] = {k.split(".", 1)[1]: torch.empty_like(v, device="meta") for k, v in done.items()}
        return copy.copy(self._probes[key])
