"""`supervisor run` with calibration (GPTQ, static activation scales, MoE) equals llm-compressor's oneshot, tensor for
tensor and config.json, and transformers loads the output and gives oneshot's logits.

Both sides run one torch thread (GPTQ's arithmetic depends on the count). More than 16 samples of mixed lengths:
oneshot's order (longest first, torch's unstable argsort) matters to GPTQ. The other presets are checked layer by
layer in tests/test_calibrate.py; AWQ and the kill/resume scenarios are in test_calibrated_resume.py.
"""
import json

import pytest
import torch

from tests.models import assert_same_tensors, load_tensors, loaded_logits
from tests.ref_calib import oneshot_calibrated, text_rows, token_rows, write_jsonl
from tests.scenarios import cli

N, SEQ = 20, 40

CASES = [
    # (model, scheme, method, dataset kind)
    ("llama", "W4A16", "gptq", "text"),  # text through the source's tokenizer; some lines longer than seq_len
    ("qwen3", "NVFP4", "gptq", "ids"),  # W4A4: GPTQ weights + calibrated input global scales (fused q/k/v)
    ("qwen3moe", "W4A16", "gptq", "ids"),  # every expert sees every token; routers dense
]


@pytest.fixture(scope="module")
def logits_input():
    return torch.randint(4, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind,scheme,method,data", CASES, ids=["-".join(c) for c in CASES])
def test_cli_calibrated_export_equals_oneshot(kind, scheme, method, data, tiny_models, tmp_path, logits_input):
    """Every tensor, config.json and the transformers logits equal oneshot's; progress shows the calibration stages."""
    source = tiny_models(kind)
    samples = text_rows(N) if data == "text" else token_rows(N)
    dataset = write_jsonl(tmp_path / "calib.jsonl", samples)
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", source, out, scheme, method=method, torch_threads=1,
                        calibration={"dataset": dataset, "samples": N, "seq_len": SEQ})
    events = cli.events(cli.run("run", job, "--json"))
    assert events[0]["type"] == "Started" and events[-1]["type"] == "Finished", events[-1]
    # fix_masks: oneshot's tracer drops the causal mask for Qwen3-MoE (tests/ref_calib.py, docs/fidelity.md)
    ref = oneshot_calibrated(source, scheme, method, samples, SEQ, str(tmp_path / "ref"), fix_masks=kind == "qwen3moe")

    assert_same_tensors(load_tensors(ref), load_tensors(str(out)))
    with open(f"{ref}/config.json") as a, open(out / "config.json") as b:
        assert json.load(b) == json.load(a)
    assert torch.equal(loaded_logits(str(out), logits_input), loaded_logits(ref, logits_input))
    boundary = out / ".export" / "boundary"  # no calibration state left once finished (none made at all with two
    assert not boundary.exists() or not list(boundary.iterdir())  # layers: the last one's inputs stay in RAM)
    # the non-layer part was the supervisor's copy, made while the worker imported (supervisor/run/verbatim.py)
    assert not [e for e in events if e["type"] == "CopyDeclined"]
    with open(out / ".export" / "journal.jsonl") as f:
        shard = [r for r in map(json.loads, f) if r.get("type") == "Shard" and r["index"] == -1][-1]
    assert set(shard["stages"]) == {"copy", "hash", "sync"}, shard


def test_cli_calibrated_mixtral_keeps_the_checkpoints_expert_names(tmp_path, logits_input):
    """Mixtral (experts stored as block_sparse_moe.experts.N.w1/w3/w2) calibrates with GPTQ per layer through
    transformers' name mapping: every tensor equals oneshot's once oneshot's gate/up/down_proj names are mapped
    back to w1/w3/w2, config.json equals oneshot's, and the output loads with its own names (the finalize check)."""
    from tests.ref_moe import make_family_model, to_checkpoint_names

    source = make_family_model("mixtral", str(tmp_path / "model"))
    samples = token_rows(N)
    dataset = write_jsonl(tmp_path / "calib.jsonl", samples)
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", source, out, "W4A16", method="gptq", torch_threads=1,
                        calibration={"dataset": dataset, "samples": N, "seq_len": SEQ})
    events = cli.events(cli.run("run", job, "--json"))
    assert events[-1]["type"] == "Finished", events[-1]
    # fix_masks: oneshot's tracer drops Mixtral's causal mask too (docs/fidelity.md)
    ref = oneshot_calibrated(source, "W4A16", "gptq", samples, SEQ, str(tmp_path / "ref"), fix_masks=True)
    ours = load_tensors(str(out))
    assert any(".block_sparse_moe.experts.0.w1." in k for k in ours)
    assert_same_tensors(to_checkpoint_names("mixtral", load_tensors(ref)), ours)
    with open(f"{ref}/config.json") as a, open(out / "config.json") as b:
        assert json.load(b) == json.load(a)


def test_calibrated_nvfp4_moe_is_refused_before_the_first_layer(tiny_models, tmp_path):
    """A calibrated export is previewed like a data-free one (same layout): NVFP4 on MoE experts, which transformers
    5.17 would load wrong, is refused before any layer is calibrated: exit 2, one line, no output folder left."""
    dataset = write_jsonl(tmp_path / "calib.jsonl", token_rows(N))
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", tiny_models("qwen3moe"), out, "NVFP4", method="gptq", torch_threads=1,
                        calibration={"dataset": dataset, "samples": N, "seq_len": SEQ})
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: NVFP4 export of")
    assert "would not load in transformers" in proc.stderr and not out.exists()
