"""child/loadcheck.py: the meta-device loader check says what transformers' real loader says, without the weights."""
from __future__ import annotations

import pytest

from child.loadcheck import check_folder, header_tensors
from shared.load_verdict import problems
from tests.ref_moe import loading_info, to_checkpoint_names


@pytest.mark.parametrize("kind", ["mixtral", "gptoss", "qwen2moe"])
def test_meta_check_agrees_with_the_real_loader_on_oneshot_outputs(kind, moe_oneshot):
    """oneshot's own outputs: Mixtral (experts renamed gate/up/down_proj) and GPT-OSS (fused experts written per
    expert) load with random experts, Qwen2-MoE loads clean; the meta check reports exactly the real loader's keys."""
    ref = moe_oneshot(kind, "W4A16")
    report = check_folder(ref)
    _, info = loading_info(ref)
    assert report.checked and not report.error
    assert (report.missing, report.unexpected) == (info["missing_keys"], info["unexpected_keys"])
    if kind == "qwen2moe":
        assert problems(report) is None
    else:
        assert report.missing and report.unexpected and "experts" in problems(report)


def test_checkpoint_names_fix_mixtral(moe_oneshot, tmp_path):
    """The same tensors under the checkpoint's own names (w1/w3/w2, what the exporter writes) load with none missing."""
    from safetensors.torch import save_file

    from tests.models import load_tensors

    ref = moe_oneshot("mixtral", "W4A16")
    save_file(to_checkpoint_names("mixtral", load_tensors(ref)), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{ref}/config.json").read())
    report = check_folder(str(tmp_path))
    assert report.checked and problems(report) is None, problems(report)
    assert any(".w1.weight_packed" in k for k in header_tensors(str(tmp_path)))


def test_unknown_architecture_is_not_checked(moe_models):
    """A model_type transformers does not know: not checked (a reason, no verdict), never a false failure."""
    report = check_folder(moe_models("unknown"))
    assert not report.checked and "cannot build this architecture" in report.reason and problems(report) is None


def test_a_known_verdict_answers_only_for_the_same_config_and_tensors(moe_oneshot, tmp_path, monkeypatch):
    """The check at the end of an export is answered by the verdict on the prediction checked before its first part
    when the files have that verdict's key (config.json bytes, every tensor's name, dtype and shape), and only then:
    other tensor names or another config.json get the loader's own verdict."""
    import json
    import shutil

    from safetensors.torch import save_file

    from child import loadcheck
    from tests.models import load_tensors

    ref = moe_oneshot("mixtral", "W4A16")
    oneshot_names, own_names, more_layers = (tmp_path / d for d in ("a", "b", "c"))
    for d in (oneshot_names, own_names, more_layers):
        d.mkdir()
        shutil.copy(f"{ref}/config.json", d / "config.json")
    tensors = load_tensors(ref)
    save_file(tensors, str(oneshot_names / "model.safetensors"), metadata={"format": "pt"})
    save_file(to_checkpoint_names("mixtral", tensors), str(own_names / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(own_names / "model.safetensors", more_layers / "model.safetensors")
    config = json.loads((more_layers / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (more_layers / "config.json").write_text(json.dumps(config))
    built = []
    real = loadcheck._check
    monkeypatch.setattr(loadcheck, "_check", lambda *a: built.append(a[0]) or real(*a))

    first = check_folder(str(oneshot_names))
    assert "experts" in problems(first) and first.key
    own = check_folder(str(own_names), known=first)  # same config, other names: not the known verdict
    assert problems(own) is None and own.key != first.key
    assert check_folder(str(oneshot_names), known=first) is first
    grown = check_folder(str(more_layers), known=own)  # the same tensors as own_names, another config.json
    assert any(".layers." in k for k in grown.missing), grown
    assert built == [str(oneshot_names), str(own_names), str(more_layers)]  # the match was not built again
