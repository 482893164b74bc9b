"""child/backends/name_only.py: an architecture transformers does not know, exported by tensor names, equals model_free_ptq."""
from __future__ import annotations

import json

import pytest
import torch

from child.backends.backend import make_backend
from child.backends.name_only import NameOnlyQuantizer
from child.backends.quantize import LayerQuantizer
from shared.job import DEFAULT_IGNORE, effective_ignore, parse_job
from tests.models import assert_same_tensors, load_tensors
from tests.ref_moe import model_free_reference

IGNORE = ["lm_head", "re:.*embed_tokens$"]


def _export(model: str, scheme: str, ignore: list[str], dest) -> dict:
    source = load_tensors(model)
    q = NameOnlyQuantizer(model, scheme, ignore, list(source))
    got = {}
    for i in range(q.num_layers):
        got.update(q.quantize_layer(i, {k: v for k, v in source.items() if k.startswith(f"{q.layer_prefix}{i}.")}))
    outside = {k: v for k, v in source.items() if not k.startswith(q.layer_prefix)}
    got.update(q.quantize_non_layer(outside))
    q.write_config(f"{model}/config.json", str(dest))
    return got


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16", "NVFP4A16"])
def test_by_names_equals_model_free_ptq(scheme, moe_models, tmp_path):
    """Layer by layer by names: every tensor and config.json's bytes equal model_free_ptq's, same scheme and ignore."""
    model = moe_models("unknown")
    ref = model_free_reference(model, scheme, IGNORE, str(tmp_path / "ref"))
    (tmp_path / "ours").mkdir()
    got = _export(model, scheme, IGNORE, tmp_path / "ours")
    assert_same_tensors(load_tensors(ref), got)
    assert (tmp_path / "ours" / "config.json").read_bytes() == (tmp_path / "ref" / "config.json").read_bytes()


def test_layers_found_by_names_and_embeddings_dense_by_default(moe_models):
    """`backbone.blocks.N` is the layer stack; the default ignore list by names keeps embeddings dense (model_free_ptq
    with only lm_head ignored quantizes them)."""
    model = moe_models("unknown")
    job = parse_job({"source": {"path": model}, "export": {"scheme": "W4A16", "output": "o"}})
    backend = make_backend(job, model, "cpu")
    assert isinstance(backend, NameOnlyQuantizer)
    assert (backend.layer_prefix, backend.num_layers) == ("backbone.blocks.", 2)
    assert backend.ignore == effective_ignore(job, by_names=True) and len(backend.ignore) > len(DEFAULT_IGNORE)
    source = load_tensors(model)
    out = backend.quantize_non_layer({k: v for k, v in source.items() if not k.startswith("backbone.blocks.")})
    assert torch.equal(out["backbone.embed_tokens.weight"], source["backbone.embed_tokens.weight"])


def test_remote_code_not_allowed_goes_by_names(moe_models, tmp_path):
    """auto_map with an unknown model_type: never imported; by names unless allow_remote_code. A known model_type
    with auto_map uses transformers' own class."""
    import shutil

    model = str(tmp_path / "m")
    shutil.copytree(moe_models("unknown"), model)
    cfg = json.load(open(f"{model}/config.json"))
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_mystery.MysteryForCausalLM"}
    json.dump(cfg, open(f"{model}/config.json", "w"))
    job = parse_job({"source": {"path": model}, "export": {"scheme": "W4A16", "output": "o"}})
    backend = make_backend(job, model, "cpu")
    assert isinstance(backend, NameOnlyQuantizer) and "allow_remote_code" in backend.describe()
    known = moe_models("qwen3moe")
    cfg = json.load(open(f"{known}/config.json"))
    shutil.copytree(known, tmp_path / "k")
    json.dump(dict(cfg, auto_map={"AutoModelForCausalLM": "x.Y"}), open(tmp_path / "k" / "config.json", "w"))
    job = parse_job({"source": {"path": str(tmp_path / "k")}, "export": {"scheme": "W4A16", "output": "o"}})
    backend = make_backend(job, str(tmp_path / "k"), "cpu")
    assert isinstance(backend, LayerQuantizer)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16_ASYM"])
def test_preview_on_meta_predicts_the_real_output(scheme, moe_models):
    """Meta tensors in give the real output's names, shapes and dtypes (the plan and its loader check use them)."""
    model = moe_models("unknown")
    source = load_tensors(model)
    q = NameOnlyQuantizer(model, scheme, IGNORE, list(source))
    layer = {k: v for k, v in source.items() if k.startswith("backbone.blocks.1.")}
    real = q.quantize_layer(1, layer)
    meta = q.quantize_layer(1, {k: torch.empty_like(v, device="meta") for k, v in layer.items()})
    assert {k: (v.dtype, v.shape) for k, v in meta.items()} == {k: (v.dtype, v.shape) for k, v in real.items()}
