"""[source] adapter: a LoRA merged per layer in the child equals PEFT's merge_and_unload, saved, then exported.

The reference is PEFT alone (tests/ref_studio.py): PeftModel.from_pretrained(base, adapter).merge_and_unload()
saved as a plain checkpoint. The cheap cells compare at the child level (the merged source tensors of every part,
then layer 0 quantized with FP8_DYNAMIC and W4A16); one cell runs the real CLI and compares the folders' bytes.
"""
from __future__ import annotations

import os

import pytest
import torch

from child.sources.adapter import AdapterFolder, Merged
from child.backends.quantize import DEFAULT_IGNORE, LayerQuantizer
from child.sources import open_source
from child.sources.checkpoint import Checkpoint
from shared.job import parse_job
from supervisor.checks.adapter import inspect_adapter
from supervisor.api import prepare
from supervisor.errors import SourceError
from tests.models import assert_same_tensors, load_tensors, oneshot_reference
from tests.ref_studio import edit_adapter, make_adapter, merged_checkpoint
from tests.scenarios import cli

VARIANTS = {
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True),
    # rank_pattern/alpha_pattern keys are regexes matched as (.*\.)?(key)$ against the module path
    "rank_pattern": dict(r=8, lora_alpha=16, rank_pattern={"v_proj": 4, "layers.1.mlp.down_proj": 2},
                         alpha_pattern={r"layers\.0\.self_attn\.q_proj": 5}),
}


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """adapters(kind, variant) -> (base, adapter folder, PEFT-merged checkpoint), built once per module."""
    made = {}

    def get(kind: str, variant: str):
        if (kind, variant) not in made:
            base = tiny_models(kind)
            tmp = tmp_path_factory.mktemp(f"lora-{kind}-{variant}")
            adapter = make_adapter(base, str(tmp / "adapter"), **VARIANTS[variant])
            made[kind, variant] = base, adapter, merged_checkpoint(base, adapter, str(tmp / "merged"))
        return made[kind, variant]

    return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_merged_per_layer_equals_peft_merge(kind, variant, adapters, tmp_path):
    """Every part's merged tensors equal PEFT's merged checkpoint, and layer 0 quantized (FP8_DYNAMIC, W4A16) equals
    oneshot's quantization of that checkpoint."""
    base, adapter, merged = adapters(kind, variant)
    job = parse_job({"source": {"path": base, "adapter": adapter}, "export": {"scheme": "W4A16", "output": "x"}})
    ours, ref = open_source(job), Checkpoint(merged)
    assert isinstance(ours, Merged)
    prefix = "model.layers."
    changed = 0
    for names in [ours.layer_names(prefix, 0), ours.layer_names(prefix, 1), ours.non_layer_names(prefix)]:
        got, want = ours.read(names), ref.read(names)
        assert_same_tensors(want, got)
        base_tensors = Checkpoint(base).read(names)
        changed += sum(not torch.equal(base_tensors[n], got[n]) for n in names)
    assert changed == 14, "every targeted Linear of both layers must differ from the base"
    names = ours.layer_names(prefix, 0)
    for scheme in ("FP8_DYNAMIC", "W4A16"):
        want = load_tensors(oneshot_reference(merged, scheme, list(DEFAULT_IGNORE), str(tmp_path / scheme)),
                            prefix="model.layers.0.")
        assert_same_tensors(want, LayerQuantizer(base, scheme, DEFAULT_IGNORE).quantize_layer(0, ours.read(names)))


def test_reads_only_the_layers_slice(adapters):
    """pairs() for layer 1's names returns layer 1's targeted Linears and nothing of layer 0."""
    base, adapter, _ = adapters("llama", "rank_pattern")
    names = Checkpoint(base).layer_names("model.layers.", 1)
    pairs = AdapterFolder(adapter).pairs(names)
    assert sorted(pairs) == sorted(n for n in names if n.endswith("proj.weight"))
    assert pairs["model.layers.1.self_attn.v_proj.weight"].r == 4  # rank_pattern
    assert pairs["model.layers.1.mlp.down_proj.weight"].r == 2


def _bad(adapter: str, tmp_path, **edit) -> str:
    return edit_adapter(adapter, str(tmp_path / "bad"), **edit)


EMBEDDING_LORA = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 256)}
REFUSED = {
    "dora": (dict(config={"use_dora": True}), "DoRA"),
    "lora_bias": (dict(config={"lora_bias": True}), "lora_bias"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "layer_replication": (dict(config={"layer_replication": [[0, 2]]}), "layer_replication"),
    "target_parameters": (dict(config={"target_parameters": ["mlp.experts.gate_up_proj"]}), "target_parameters"),
    "trainable_tokens": (dict(config={"trainable_token_indices": [1, 2]}), "trainable_token_indices"),
    "bias_all": (dict(config={"bias": "all"}), "trained biases"),
    "not_lora": (dict(config={"peft_type": "IA3"}), "not LoRA"),
    "embedding": (dict(extra_tensors=EMBEDDING_LORA), "not a LoRA A/B weight"),
    "half_pair": (dict(drop="layers.0.mlp.up_proj.lora_B"), "incomplete"),
    "wrong_rank": (dict(config={"rank_pattern": {"q_proj": 3}}), "do not fit"),
    "other_model": (dict(extra_tensors={"base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": torch.zeros(8, 128),
                                        "base_model.model.model.layers.7.mlp.up_proj.lora_B.weight": torch.zeros(256, 8)}),
                    "not a weight of the base checkpoint"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unmergeable_adapters_are_refused_before_anything_is_written(case, adapters, tmp_path):
    """An adapter that cannot be merged exactly is a one-line SourceError from prepare(); no output is created."""
    base, adapter, _ = adapters("llama", "rank_pattern")
    edit, words = REFUSED[case]
    bad = _bad(adapter, tmp_path, **edit)
    out = tmp_path / "out"
    job = parse_job({"source": {"path": base, "adapter": bad}, "export": {"scheme": "W4A16", "output": str(out)}})
    with pytest.raises(SourceError, match=words) as info:
        prepare(job)
    assert "\n" not in str(info.value)
    assert not out.exists()


def test_fingerprint_covers_the_adapter_files(adapters, tmp_path):
    """Changing one byte of the adapter's weights changes its fingerprint part."""
    base, adapter, _ = adapters("llama", "rank_pattern")
    before = inspect_adapter(adapter, base, ["model.safetensors"])
    changed = edit_adapter(adapter, str(tmp_path / "changed"))
    from safetensors.torch import load_file, save_file

    path = os.path.join(changed, "adapter_model.safetensors")
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, path)
    assert inspect_adapter(changed, base, ["model.safetensors"])["adapter_model.safetensors"] != \
        before["adapter_model.safetensors"]


def test_cli_adapter_job_equals_merged_checkpoint_export(adapters, tmp_path):
    """`supervisor run` with [source] adapter writes the same bytes as exporting PEFT's merged checkpoint; a changed
    adapter is then refused for that output (exit 2), and a DoRA adapter is refused with exit 2 and one line."""
    base, adapter, merged = adapters("qwen3", "rank_pattern")
    out, ref = tmp_path / "out", tmp_path / "ref"
    job = cli.write_job(tmp_path / "job.toml", base, out, "W4A16")
    text = open(job).read().replace("[export]", f'adapter = "{adapter}"\n[export]', 1)
    open(job, "w").write(text)
    cli.run("run", job, "--json")
    cli.run("run", cli.write_job(tmp_path / "ref.toml", merged, ref, "W4A16"), "--json")
    got, want = cli.output_bytes(out), cli.output_bytes(ref)
    for side_file in ("tokenizer.json", "tokenizer_config.json"):  # the base has a tokenizer, PEFT's save does not
        got.pop(side_file)
    assert got == want

    changed = edit_adapter(adapter, str(tmp_path / "changed"), config={"alpha_pattern": {"q_proj": 3}})
    open(job, "w").write(text.replace(adapter, changed))
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2 and "different job" in proc.stderr

    dora = edit_adapter(adapter, str(tmp_path / "dora"), config={"use_dora": True})
    open(job, "w").write(text.replace(adapter, dora).replace(str(out), str(tmp_path / "out-dora")))
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "DoRA" in proc.stderr
    assert not (tmp_path / "out-dora").exists()


def test_cli_refuses_a_job_without_source(tmp_path):
    """A job.toml without [source] exits 2 with one line: only the Python API exports a live model."""
    job = tmp_path / "job.toml"
    job.write_text(f'[export]\nscheme = "W4A16"\noutput = "{tmp_path / "out"}"\n')
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2 and "[source]" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
