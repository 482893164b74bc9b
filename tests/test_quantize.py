"""child/backends/quantize.py: one layer quantized alone is bit-identical to llm-compressor's whole-model oneshot."""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch

from child.backends.quantize import DEFAULT_IGNORE, LayerQuantizer, quantization_config_dict, write_config
from tests.models import assert_same_tensors, load_tensors

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", "NVFP4A16"]
DENSE = ["llama", "qwen3"]
HEAD_TARGETED = ["re:.*mlp\\.gate$"]  # DEFAULT_IGNORE without lm_head


def _split(tensors: dict, prefix: str) -> tuple[dict, dict]:
    inside = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    return inside, {k: v for k, v in tensors.items() if not k.startswith(prefix)}


def _assert_layers_match(model_dir: str, ref_dir: str, scheme: str, ignore: list[str]) -> None:
    q = LayerQuantizer(model_dir, scheme, ignore)
    source = load_tensors(model_dir)
    for i in range(q.num_layers):
        prefix = f"{q.layer_prefix}{i}."
        got = q.quantize_layer(i, _split(source, prefix)[0])
        assert_same_tensors(load_tensors(ref_dir, prefix), got)


def _assert_non_layer_matches(model_dir: str, ref_dir: str, scheme: str, ignore: list[str]) -> None:
    q = LayerQuantizer(model_dir, scheme, ignore)
    got = q.quantize_non_layer(_split(load_tensors(model_dir), q.layer_prefix)[1])
    assert_same_tensors(_split(load_tensors(ref_dir), q.layer_prefix)[1], got)


def _assert_config_matches(model_dir: str, ref_dir: str, scheme: str, ignore: list[str], dest) -> None:
    with open(f"{ref_dir}/config.json") as f:
        ref_text = f.read()
    ref = json.loads(ref_text)
    assert quantization_config_dict(scheme, ignore, model_dir) == ref["quantization_config"]
    path = write_config(f"{model_dir}/config.json", str(dest), scheme, ignore)
    with open(path) as f:
        text = f.read()
    assert json.loads(text) == ref
    assert text == ref_text, "same JSON, different bytes (key order or indentation)"


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layers_match_oneshot(kind, scheme, tiny_models, oneshot_ref):
    """Each decoder layer quantized alone equals oneshot's tensors for that layer, bit for bit."""
    _assert_layers_match(tiny_models(kind), oneshot_ref(kind, scheme), scheme, DEFAULT_IGNORE)


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_non_layer_matches_oneshot(kind, scheme, tiny_models, oneshot_ref):
    """Embeddings, final norm and the ignored lm_head come out exactly as oneshot writes them."""
    _assert_non_layer_matches(tiny_models(kind), oneshot_ref(kind, scheme), scheme, DEFAULT_IGNORE)


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_config_matches_oneshot(kind, scheme, tiny_models, oneshot_ref, tmp_path):
    """quantization_config_dict and write_config's config.json equal oneshot's, down to the bytes."""
    _assert_config_matches(tiny_models(kind), oneshot_ref(kind, scheme), scheme, DEFAULT_IGNORE, tmp_path)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_lm_head_quantized_like_oneshot_when_not_ignored(scheme, tiny_models, oneshot_ref, tmp_path):
    """A targeted lm_head is quantized in quantize_non_layer exactly as oneshot does, config included."""
    model, ref = tiny_models("llama"), oneshot_ref("llama", scheme, HEAD_TARGETED)
    _assert_non_layer_matches(model, ref, scheme, HEAD_TARGETED)
    assert any(k.startswith("lm_head.weight_") for k in load_tensors(ref)), "lm_head was not quantized"
    _assert_config_matches(model, ref, scheme, HEAD_TARGETED, tmp_path)


def test_tied_lm_head_untied_and_quantized_like_oneshot(tiny_models, oneshot_ref, tmp_path):
    """A tied, targeted lm_head is quantized from the embedding table and the config is untied, as oneshot does."""
    model, ref = tiny_models("llama", tied=True), oneshot_ref("llama", "W4A16", HEAD_TARGETED, tied=True)
    assert "lm_head.weight" not in load_tensors(model)
    _assert_layers_match(model, ref, "W4A16", HEAD_TARGETED)
    _assert_non_layer_matches(model, ref, "W4A16", HEAD_TARGETED)
    _assert_config_matches(model, ref, "W4A16", HEAD_TARGETED, tmp_path)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16"])
def test_moe_layers_match_oneshot(scheme, tiny_models, oneshot_ref, tmp_path):
    """Qwen3-MoE layers (experts linearized like oneshot) and the router-listing config match oneshot."""
    model, ref = tiny_models("qwen3moe"), oneshot_ref("qwen3moe", scheme)
    _assert_layers_match(model, ref, scheme, DEFAULT_IGNORE)
    _assert_non_layer_matches(model, ref, scheme, DEFAULT_IGNORE)
    _assert_config_matches(model, ref, scheme, DEFAULT_IGNORE, tmp_path)


def test_layer_prefix_and_count(tiny_models):
    """The decoder layers are found in the skeleton: prefix 'model.layers.' and the config's layer count."""
    q = LayerQuantizer(tiny_models("qwen3"), "FP8_DYNAMIC", DEFAULT_IGNORE)
    assert (q.layer_prefix, q.num_layers) == ("model.layers.", 2)


def test_quantize_layer_keeps_nothing_alive(tiny_models):
    """Repeated quantize_layer calls leave no module or tensor behind (no per-layer leak)."""
    model = tiny_models("qwen3")
    q = LayerQuantizer(model, "NVFP4A16", DEFAULT_IGNORE)
    layer = _split(load_tensors(model), "model.layers.1.")[0]
    q.quantize_layer(1, layer)  # first call may fill one-time caches (registries, logging)

    def live() -> tuple[int, int]:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on torch's deprecated module proxies warns
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            return sum(isinstance(o, torch.nn.Module) for o in objects), sum(torch.is_tensor(o) for o in objects)

    before = live()
    for _ in range(3):
        q.quantize_layer(1, layer)
    assert live() == before


def test_mismatched_tensors_rejected(tiny_models):
    """A missing tensor or one from another layer is refused with the offending names."""
    model = tiny_models("llama")
    q = LayerQuantizer(model, "FP8_DYNAMIC", DEFAULT_IGNORE)
    source = load_tensors(model)
    layer0 = _split(source, "model.layers.0.")[0]
    missing = dict(layer0)
    del missing["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="mlp.down_proj.weight"):
        q.quantize_layer(0, missing)
    with pytest.raises(ValueError, match="outside model.layers.1"):
        q.quantize_layer(1, layer0)
    with pytest.raises(IndexError):
        q.quantize_layer(2, {})


def test_calibrated_scheme_rejected(tiny_models):
    """A scheme that needs calibration data (static activation scales) is refused up front."""
    with pytest.raises(ValueError, match="calibration data"):
        LayerQuantizer(tiny_models("llama"), "NVFP4", DEFAULT_IGNORE)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16", "NVFP4A16"])
def test_cuda_layers_match_oneshot(scheme, tiny_models, oneshot_ref):
    """On a GPU, quantize_layer(device='cuda:0') returns CPU tensors equal to oneshot (which also runs on the GPU)."""
    model, ref = tiny_models("qwen3"), oneshot_ref("qwen3", scheme)
    q = LayerQuantizer(model, scheme, DEFAULT_IGNORE, device="cuda:0")
    source = load_tensors(model)
    for i in range(q.num_layers):
        prefix = f"model.layers.{i}."
        got = q.quantize_layer(i, _split(source, prefix)[0])
        assert all(t.device.type == "cpu" for t in got.values())
        assert_same_tensors(load_tensors(ref, prefix), got)
