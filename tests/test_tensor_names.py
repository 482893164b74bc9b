"""shared/tensor_names.py and layers not named `*.layers.N`: Falcon, GPT-2, BLOOM, GPT-J (`transformer.h.N`)."""
from __future__ import annotations

import json

import pytest

from child.loadcheck import check_folder
from child.backends.quantize import LayerQuantizer
from shared import tensor_names
from shared.job import DEFAULT_IGNORE
from shared.load_verdict import problems
from supervisor.checks.source import inspect
from tests.models import assert_same_tensors, load_tensors
from tests.ref_moe import loading_info
from tests.test_moe_families import export_in_process


@pytest.mark.parametrize("names,config,expected", [
    (["model.layers.0.a.weight", "model.layers.1.mlp.experts.7.w1.weight", "model.norm.weight"],
     {"num_hidden_layers": 2}, ("model.layers.", {0, 1})),
    (["transformer.h.0.attn.c_attn.weight", "transformer.h.1.ln_1.weight", "transformer.wte.weight"],
     {"n_layer": 2}, ("transformer.h.", {0, 1})),
    # a vision tower with more blocks than the text model has layers: the config's count decides
    (["vision.blocks.0.w", "vision.blocks.1.w", "vision.blocks.2.w", "language_model.layers.0.w",
      "language_model.layers.1.w"], {"text_config": {"num_hidden_layers": 2}}, ("language_model.layers.", {0, 1})),
    # DeepSeek-V3's multi-token-prediction layer sits past num_hidden_layers
    (["model.layers.0.w", "model.layers.1.w", "model.layers.2.w"], {"num_hidden_layers": 2},
     ("model.layers.", {0, 1, 2})),
    (["backbone.blocks.0.w", "backbone.blocks.1.w"], {}, ("backbone.blocks.", {0, 1})),
    (["embed.weight", "head.weight"], {}, None),
])
def test_find_layers(names, config, expected):
    """The layer stack is the first integer path segment's prefix; the config's layer count picks among stacks."""
    assert tensor_names.find_layers(names, config) == expected


@pytest.mark.parametrize("kind", ["gpt2", "bloom", "gptj"])
def test_transformer_h_layers_equal_oneshot_and_load(kind, moe_models, moe_oneshot, tmp_path):
    """The supervisor finds `transformer.h.` from names, the model class agrees, the output equals oneshot's and
    transformers loads every weight (GPT-2's Conv1D is no Linear: nothing quantized there, as in oneshot)."""
    model = moe_models(kind)
    info = inspect(model)
    q = LayerQuantizer(model, "W4A16", DEFAULT_IGNORE)
    assert (info.layer_prefix, info.num_layers) == (q.layer_prefix, q.num_layers) == ("transformer.h.", 2)
    got = export_in_process(model, "W4A16", DEFAULT_IGNORE, str(tmp_path / "out"))
    ref = moe_oneshot(kind, "W4A16")
    assert_same_tensors(load_tensors(ref), got)
    assert (tmp_path / "out" / "config.json").read_text() == open(f"{ref}/config.json").read()
    report = check_folder(str(tmp_path / "out"))
    assert report.checked and problems(report) is None, problems(report)
    _, info = loading_info(str(tmp_path / "out"))  # and transformers' real loader, weights read
    assert not any(info.values()), info


def test_falcon_layers_found_but_refused_as_compressed_tensors_writes_it_dense(moe_models, moe_oneshot):
    """Falcon's layers are found (`transformer.h.`), but FalconLinear subclasses nn.Linear and compressed-tensors
    picks formats by exact class: oneshot's output is 'dense' and loads wrong (the loader check shows it), so the
    layer quantizer refuses up front, saying why."""
    from child.errors import Refused

    model = moe_models("falcon")
    assert inspect(model).layer_prefix == "transformer.h."
    ref = moe_oneshot("falcon", "W4A16")
    assert json.load(open(f"{ref}/config.json"))["quantization_config"]["format"] == "dense"
    assert "lm_head.weight_scale" in check_folder(ref).missing
    with pytest.raises(Refused, match="FalconLinear uncompressed"):
        LayerQuantizer(model, "W4A16", DEFAULT_IGNORE)


def test_layers_past_the_config_count_go_with_the_non_layer_part(tmp_path):
    """A checkpoint with one more layer than num_hidden_layers (an MTP layer): the count is the config's, the extra
    layer's tensors are outside the layers (exported with the non-layer part)."""
    import numpy as np
    from safetensors.numpy import save_file

    from child.sources.checkpoint import Checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    save_file({f"model.layers.{i}.w.weight": np.zeros((2, 2), np.float32) for i in range(3)}
              | {"model.norm.weight": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    info = inspect(str(tmp_path))
    assert (info.layer_prefix, info.num_layers) == ("model.layers.", 2)
    assert Checkpoint(str(tmp_path)).non_layer_names("model.layers.", 2) == ["model.layers.2.w.weight",
                                                                              "model.norm.weight"]


def test_the_supervisor_names_a_live_models_parts_as_the_child_reads_them():
    """A live model's part digests are compared by name lists the supervisor builds: a layer past the config's
    count (DeepSeek's multi-token-prediction layer) belongs to the non-layer part on both sides."""
    from child.sources.checkpoint import NamedTensors
    from shared.messages import NON_LAYER
    from supervisor.live.model import part_names

    names = sorted(["model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight",
                    "model.layers.2.eh_proj.weight", "model.norm.weight", "lm_head.weight"])

    class Child(NamedTensors):
        _names = names

    child = Child()
    assert part_names(names, "model.layers.", NON_LAYER, 2) == child.non_layer_names("model.layers.", 2) == [
        "lm_head.weight", "model.embed_tokens.weight", "model.layers.2.eh_proj.weight", "model.norm.weight"]
    for i in (0, 1):
        assert part_names(names, "model.layers.", i, 2) == child.layer_names("model.layers.", i) == [
            f"model.layers.{i}.mlp.weight"]
