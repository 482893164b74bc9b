"""A live PEFT model over a bitsandbytes nf4 base (QLoRA, the studio's commonest model) exports like PEFT's own
merge into the 16-bit base, then export.

The model is real: transformers loads the tiny bf16 checkpoint in nf4 with bitsandbytes' CPU backend, PEFT wraps it
(`peft.tuners.lora.bnb.Linear4bit` over `Params4bit`), LoRA B random and nonzero. The reference never runs our
merge: `live.save_pretrained(adapter)`, then `PeftModel.from_pretrained(<bf16 base>, adapter).merge_and_unload()
.save_pretrained(merged)` (tests/ref_studio.py), exported as a plain checkpoint (the path
tests/scenarios/test_export_matches_oneshot.py holds equal to oneshot's). The live model is checked afterwards: every
state_dict entry (the 4-bit data, absmax, quant_map, quant_state, the LoRA tensors) equal, the same LoRA objects.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from shared.job import parse_job
from supervisor import Supervisor, events as ev, offload
from supervisor.errors import SourceError
from tests.ref_studio import lora_model, merged_checkpoint
from tests.scenarios.cli import output_bytes, tree

pytest.importorskip("bitsandbytes")

SCHEME = "FP8_DYNAMIC"
TARGETS = ["q_proj", "v_proj", "down_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_nf4(base_dir: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, device_map="cpu",
                                                dtype=torch.bfloat16).eval()


def qlora(base_dir: str, seed: int = 1, targets=TARGETS, **config):
    return lora_model(load_nf4(base_dir), seed=seed, targets=targets, r=16, lora_alpha=32, **config)


def _job(out, source: dict | None = None, **resources):
    job = {"export": {"scheme": SCHEME, "output": str(out)},
           "resources": {"device": "cpu", "max_attempts": 3, **resources}}
    return parse_job({**job, "source": source} if source else job)


def _export(job, **kwargs) -> list:
    with Supervisor(job, retry_delay=0.05, **kwargs) as run:
        seen = list(run.events())
        run.wait()
    return seen


def reference(base_dir: str, live, tmp) -> dict:
    """{file: sha256} of PEFT's merge of `live`'s saved adapter into the bf16 base, saved and exported."""
    live.save_pretrained(tmp / "adapter")
    merged_checkpoint(base_dir, str(tmp / "adapter"), str(tmp / "merged"))
    for fn in TOKENIZER_FILES:  # the base folder's tokenizer, as the export of the base folder carries it
        if os.path.exists(os.path.join(base_dir, fn)):
            shutil.copy(os.path.join(base_dir, fn), tmp / "merged" / fn)
    _export(_job(tmp / "ref", {"path": str(tmp / "merged")}))
    return output_bytes(tmp / "ref")


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_model(model, before: dict, lora_objects: dict) -> None:
    now = model.state_dict()
    assert set(now) == set(before)
    assert any(".absmax" in k for k in now) and any("quant_state" in k for k in now)  # Params4bit's own state
    for name, value in before.items():
        assert now[name].dtype == value.dtype and torch.equal(now[name], value), f"{name} changed"
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p is lora_objects[name] and p.requires_grad, name


def _lora_objects(model) -> dict:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def test_qlora_model_without_source_exports_from_its_base_folder_and_resumes_after_a_child_sigkill(
        tiny_models, tmp_path, monkeypatch):
    """No [source]: the base is the local folder the PEFT model names; the child is SIGKILLed mid-export, the next
    reads the checkpoint and the pool's pairs again; the output equals PEFT's merge into the bf16 base then export,
    and the 4-bit model is unchanged (every state_dict entry, the LoRA objects)."""
    base = tiny_models("llama")
    live = qlora(base)
    assert type(live.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight).__name__ == "Params4bit"
    before, objects = _state(live), _lora_objects(live)
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps(
        {"point": "quantize", "action": "sigkill", "index": 1, "once": str(tmp_path / "killed")}))
    seen = _export(_job(tmp_path / "out"), model=live)
    monkeypatch.delenv("SUPERVISOR_TEST_FAULT")
    retries = [e for e in seen if isinstance(e, ev.Retrying)]
    assert len(retries) == 1 and "SIGKILL" in retries[0].reason
    _assert_same_model(live, before, objects)
    with open(tmp_path / "out" / ".export" / "journal.jsonl") as f:
        header = json.loads(f.readline())
    assert header["job"]["source"]["path"] == os.path.abspath(base)  # the discovered base, journaled
    assert output_bytes(tmp_path / "out") == reference(base, live, tmp_path)


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setattr(offload, "ACCELERATOR_TYPES", frozenset({"cpu"}))  # tests/test_offload.py explains it


def test_qlora_model_with_source_path_is_released_restored_and_merged_as_from_pretrained(tiny_models, tmp_path,
                                                                                       cpu_accelerator):
    """[source] path = a copy of the bf16 base (not the folder the model names), bf16 LoRA tensors, a LoRA on the
    (unquantized) lm_head too: the 4-bit model is released (its Params4bit moved by their own .to()) and restored
    equal; the pairs are upcast as PeftModel.from_pretrained does and the non-layer part is merged by a worker (not
    copied as it is), so the output equals its merge of the saved adapter, then export."""
    base = tiny_models("llama")
    shutil.copytree(base, tmp_path / "base")
    live = qlora(base, seed=2, targets=TARGETS + ["lm_head"])
    assert type(live.base_model.model.lm_head.base_layer.weight) is torch.nn.Parameter
    with torch.no_grad():
        for name, module in live.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                module.lora_A["default"].to(torch.bfloat16)
                module.lora_B["default"].to(torch.bfloat16)
    assert {p.dtype for n, p in live.named_parameters() if "lora_" in n} == {torch.bfloat16}
    before, objects = _state(live), _lora_objects(live)
    seen = _export(_job(tmp_path / "out", {"path": str(tmp_path / "base")}), model=live)
    released = next(e for e in seen if isinstance(e, ev.MemoryReleased))
    assert released.released and released.moved_bytes > 0
    assert any(isinstance(e, ev.ModelRestored) for e in seen)
    assert not any(isinstance(e, ev.LayerWritten) and e.index == -1 and "copy" in e.stages for e in seen)
    _assert_same_model(live, before, objects)
    assert output_bytes(tmp_path / "out") == reference(str(tmp_path / "base"), live, tmp_path)


def test_source_adapter_wins_over_the_live_models_pairs(tiny_models, tmp_path):
    """[source] path + adapter with a live QLoRA model: the adapter folder is merged (the live model's own pairs,
    another adapter, are not), as for any job with an adapter."""
    base = tiny_models("llama")
    other = qlora(base, seed=3)
    ref = reference(base, other, tmp_path)  # saves `other`'s adapter under tmp_path/adapter
    live = qlora(base, seed=4)
    _export(_job(tmp_path / "out", {"path": base, "adapter": str(tmp_path / "adapter")}), model=live)
    assert output_bytes(tmp_path / "out") == ref


def test_changed_adapter_after_a_failed_run_is_redone_not_mixed(tiny_models, tmp_path, monkeypatch):
    """A run fails at layer 2 after layers 0 and 1 were journaled; the re-run's live adapter changed on layer 0 only:
    layer 0 is redone (its journaled digest of the pairs differs), layer 1 stands (the same pairs' digest, computed
    by the supervisor, equals the child's), and the output equals the reference of the changed adapter."""
    base = tiny_models("llama", layers=3)
    live = qlora(base, seed=5)
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps({"point": "read", "action": "raise", "index": 2}))
    with Supervisor(_job(tmp_path / "out", max_attempts=1, workers=1), model=live, retry_delay=0.05) as run:
        list(run.events())
        with pytest.raises(Exception, match="layer 2 failed"):
            run.wait()
    monkeypatch.delenv("SUPERVISOR_TEST_FAULT")
    with open(tmp_path / "out" / ".export" / "journal.jsonl") as f:
        shards = [json.loads(line) for line in f if '"Shard"' in line]
    journaled = {r["index"] for r in shards}
    assert {0, 1} <= journaled and 2 not in journaled, journaled
    assert all(r["source_digest"] for r in shards if r["index"] >= 0)  # each layer's pairs, hashed by the child

    with torch.no_grad():
        live.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(1.5)  # trained on
    seen = _export(_job(tmp_path / "out", workers=1), model=live)
    started = next(e for e in seen if isinstance(e, ev.Started))
    assert started.redo == [0] and started.resumed == len(journaled) - 1
    assert not any(isinstance(e, ev.LayerStarted) and e.index == 1 for e in seen)  # layer 1 stood
    assert output_bytes(tmp_path / "out") == reference(base, live, tmp_path)


def _refused(job, live, match: str, out) -> str:
    before, objects = _state(live), _lora_objects(live)
    parent = tree(out.parent)
    with pytest.raises(SourceError, match=match) as info:
        Supervisor(job, model=live)
    assert "\n" not in str(info.value) and not out.exists() and tree(out.parent) == parent
    _assert_same_model(live, before, objects)
    return str(info.value)


def test_qlora_model_whose_base_is_not_found_or_not_its_own_is_refused_before_anything_is_written(tiny_models,
                                                                                                 tmp_path):
    """One-line refusals, nothing written, the model untouched: a base named by a hub id (not a local folder), a
    named local folder of another model, a [source] path of another model, an adapter merged into the 4-bit
    weights, DoRA (the advice: merge into the 16-bit base, not into 4 bits), and an nf4 model without PEFT and
    without [source]."""
    base = tiny_models("llama")
    live = qlora(base)
    out = tmp_path / "outs" / "out"
    os.makedirs(out.parent)
    inner = live.base_model.model
    live.peft_config["default"].base_model_name_or_path = inner.config._name_or_path = "meta-llama/Llama-3.1-8B"
    msg = _refused(_job(out), live, "not a local checkpoint folder", out)
    assert "Params4bit" in msg and '[source] path = "<the 16-bit checkpoint' in msg and "merge_and_unload" not in msg

    other = tiny_models("llama", hidden=256)
    live.peft_config["default"].base_model_name_or_path = inner.config._name_or_path = other
    msg = _refused(_job(out), live, "is not the live model's base", out)
    assert "config.json has head_dim = 64, the live model 32" in msg and '[source] path = "<the 16-bit checkpoint' in msg

    _refused(_job(out, {"path": other}), live, r"\[source\] path .* is not the live model's base", out)

    live.merge_adapter()
    _refused(_job(out, {"path": base}), live, "merged into the quantized weights", out)

    dora = qlora(base, use_dora=True)
    msg = _refused(_job(out), dora, "DoRA", out)
    assert "merge it into the 16-bit base" in msg and "merge it with PEFT (merge_and_unload), save the model" not in msg

    plain = load_nf4(base)  # no PEFT: nothing to merge, and no 16-bit weights in memory
    msg = _refused(_job(out), plain, r"quantized \(Params4bit\)", out)
    assert '[source] path = "<the 16-bit checkpoint' in msg and "weight conversion" not in msg
