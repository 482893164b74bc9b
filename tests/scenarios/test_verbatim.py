"""The non-layer part the supervisor writes itself while the workers' libraries import (supervisor/run/verbatim.py).

Each export here runs twice through the CLI: as users run it, and with the copy switched off
(SUPERVISOR_TEST_NO_COPY_AHEAD=1), so that a worker writes the part through torch and safetensors.torch as before.
The two folders must be byte-identical (the worker's path is itself checked against oneshot in
test_export_matches_oneshot.py). The journal's record of the part says which path wrote it: the copy's stages are
copy/hash/sync, a worker's read/quantize/save/…"""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from tests.scenarios import cli, faultkit

OFF = {"SUPERVISOR_TEST_NO_COPY_AHEAD": "1"}


def _non_layer_record(out) -> dict:
    with open(os.path.join(out, ".export", "journal.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("type") == "Shard" and r["index"] == -1][-1]


def _export_both_ways(tmp_path, source, scheme, **job) -> tuple[str, str]:
    outs = []
    for name, env in (("copied", None), ("worker", OFF)):
        out = str(tmp_path / name)
        job_path = cli.write_job(tmp_path / f"{name}.toml", source, out, scheme, **job)
        _declined[out] = [e for e in cli.events(cli.run("run", job_path, "--json", env=env))
                          if e["type"] == "CopyDeclined"]
        outs.append(out)
    return outs[0], outs[1]


_declined: dict[str, list[dict]] = {}  # output folder -> the CopyDeclined events of the run that wrote it


@pytest.fixture(scope="module")
def sharded_mixed(tiny_models, tmp_path_factory) -> str:
    """A Llama saved in six files with an index, its final norm in float32 beside bf16 embeddings and lm_head: the
    non-layer tensors come from several files and two dtypes (safetensors orders its header by dtype, then name)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = tiny_models("llama", layers=3)
    path = str(tmp_path_factory.mktemp("sharded-mixed"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.model.norm.float()
    model.save_pretrained(path, max_shard_size="200KB")
    for fn in os.listdir(src):
        if fn.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(src, fn), path)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return path


@pytest.mark.parametrize("case", ["sharded-mixed/FP8_DYNAMIC", "qwen3-tied/W4A16"])
def test_the_copied_part_is_the_bytes_a_worker_writes(case, sharded_mixed, tiny_models, tmp_path):
    model, scheme = case.split("/")
    source = sharded_mixed if model == "sharded-mixed" else tiny_models("qwen3", tied=True)
    copied, worker = _export_both_ways(tmp_path, source, scheme)
    assert cli.output_bytes(copied) == cli.output_bytes(worker)
    assert set(_non_layer_record(copied)["stages"]) == {"copy", "hash", "sync"}
    assert "quantize" in _non_layer_record(worker)["stages"]
    assert os.listdir(os.path.join(copied, ".export", "tmp")) == []
    assert _declined[copied] == [] and _declined[worker] == []  # used; and never made with the copy off


def _mystery(tiny_models, tmp_path) -> str:
    """A Llama checkpoint under a model_type transformers does not know: exported by tensor names."""
    source = str(tmp_path / "mystery")
    shutil.copytree(tiny_models("llama"), source)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.update(model_type="mystery", architectures=["MysteryForCausalLM"])
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    return source


def test_an_export_by_tensor_names_copies_the_part_too(tiny_models, tmp_path):
    """By names, the default ignore list keeps the embeddings dense as well as lm_head: the copy stands."""
    copied, worker = _export_both_ways(tmp_path, _mystery(tiny_models, tmp_path), "W4A16")
    assert cli.output_bytes(copied) == cli.output_bytes(worker)
    assert set(_non_layer_record(copied)["stages"]) == {"copy", "hash", "sync"}


def test_a_worker_exports_the_part_when_the_plan_quantizes_any_of_it(tiny_models, tmp_path):
    """An architecture transformers does not know is exported by tensor names; with only lm_head ignored, its
    embedding table is quantized like any Linear weight (model_free_ptq's rule). The copy, made before the plan was
    known, is dropped and a worker writes the part."""
    source = _mystery(tiny_models, tmp_path)
    copied, worker = _export_both_ways(tmp_path, source, "FP8_DYNAMIC", ignore=["lm_head"])
    assert cli.output_bytes(copied) == cli.output_bytes(worker)
    assert "quantize" in _non_layer_record(copied)["stages"]
    # the run said why (the CLI shows the same line)
    assert [(e["index"], e["reason"]) for e in _declined[copied]] == [
        (-1, "the export plan quantizes 'model.embed_tokens.weight'")]
    from safetensors import safe_open

    with safe_open(os.path.join(copied, "model-non-layer.safetensors"), "np") as f:
        assert "model.embed_tokens.weight_scale" in f.keys()
    assert os.listdir(os.path.join(copied, ".export", "tmp")) == []


def test_a_refused_export_leaves_no_copy_behind(tiny_models, tmp_path):
    """The plan refuses the export (nothing left to quantize) after the copy was written: the new output folder is
    removed as a refused run leaves it, copy included."""
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", tiny_models("llama"), out, "W4A16", ignore=["lm_head", "re:.*"])
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2 and "would quantize nothing" in proc.stderr, proc.stderr
    assert not out.exists()


def test_a_run_killed_while_the_copy_waits_for_the_plan_resumes_to_the_same_bytes(tiny_models, tmp_path):
    """SIGKILL the supervisor as soon as it reports Started: the copy starts then and waits for the export plan,
    which needs the workers' imports first. The re-run clears what the killed run left in .export/tmp and ends with
    the bytes of an uninterrupted run."""
    model = tiny_models("llama")
    ref = faultkit.reference(model, str(tmp_path / "ref"))
    out = str(tmp_path / "out")
    job = faultkit.job_file(str(tmp_path), model, out)
    live = faultkit.LiveRun("run", job, "--json")
    assert live.wait_for("Started") is not None
    os.kill(live.pid, signal.SIGKILL)
    live.wait()
    again = faultkit.run("run", job, "--json")
    assert again.rc == 0, again.stderr
    assert cli.output_bytes(out) == ref["bytes"]
    assert set(_non_layer_record(out)["stages"]) == {"copy", "hash", "sync"}
    assert os.listdir(os.path.join(out, ".export", "tmp")) == []


def test_a_calibrated_export_whose_final_norm_calibration_rounds_has_a_worker_write_the_part(tmp_path):
    """Gemma's offset norms go through oneshot's round trip ("(1 + weight)" and back), which rounds the final norm
    outside the layers: the calibrated worker says so in the export plan (PartPlan.rewritten), the copy is dropped,
    and the worker's part equals oneshot's."""
    from tests.models import assert_same_tensors, load_tensors
    from tests.ref_calib import make_tiny_gemma, oneshot_calibrated, token_rows, write_jsonl

    source = make_tiny_gemma(str(tmp_path / "gemma"))
    rows = token_rows(8)
    dataset = write_jsonl(tmp_path / "calib.jsonl", rows)
    out = str(tmp_path / "out")
    job = cli.write_job(tmp_path / "job.toml", source, out, "W4A16", method="gptq", torch_threads=1,
                        calibration={"dataset": dataset, "samples": 8, "seq_len": 40})
    events = cli.events(cli.run("run", job, "--json"))
    declined = [(e["index"], e["reason"]) for e in events if e["type"] == "CopyDeclined"]
    assert declined == [(-1, "the export rewrites 'model.norm.weight' (calibration's offset-norm round trip)")]
    assert "quantize" in _non_layer_record(out)["stages"]
    ref = oneshot_calibrated(source, "W4A16", "gptq", rows, 40, str(tmp_path / "ref"))
    assert_same_tensors(load_tensors(ref), load_tensors(out))
