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
from supervisor import Supervisor, events as ev
from supervisor.live import offload
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
    kinds = {type(p).__name__ for p in model.parameters()}
    if "Params4bit" in kinds:
        assert any(".absmax" in k for k in now) and any("quant_state" in k for k in now)  # Params4bit's own state
    if "Int8Params" in kinds:
        assert any(k.endswith(".SCB") for k in now)  # Int8Params' row scales
    for name, value in before.items():
        # bytes, not torch.equal: 4-bit codes stored as bf16 (bnb_4bit_quant_storage) hold NaN patterns
        assert now[name].dtype == value.dtype and torch.equal(_bytes(now[name]), _bytes(value)), f"{name} changed"
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p is lora_objects[name] and p.requires_grad, name


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


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


# ---- the base is recognised by its weights (supervisor/live/qlora.py: base_difference), not by its config alone ----------
_FIX = '[source] path = "<the 16-bit checkpoint the live model was loaded from>"'


@pytest.fixture(scope="module")
def tuned(tiny_models, tmp_path_factory) -> str:
    """The base with every matrix moved by 1% of its spread (a fine-tune of it: base vs instruct), same config."""
    from safetensors.torch import load_file, save_file

    base = tiny_models("llama")
    out = tmp_path_factory.mktemp("tuned")
    shutil.copytree(base, out, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for fn in [f for f in os.listdir(base) if f.endswith(".safetensors")]:
        moved = {k: (v.float() + torch.randn(v.shape, generator=gen) * v.float().std() * 0.01).to(v.dtype)
                 if v.ndim == 2 else v for k, v in load_file(os.path.join(base, fn)).items()}
        save_file(moved, str(out / fn), metadata={"format": "pt"})
    return str(out)


def _started(job, live) -> ev.Started:
    """The run's Started event; the run is then cancelled (the model restored), the export is not needed."""
    with Supervisor(job, model=live, retry_delay=0.05) as run:
        for e in run.events():
            if isinstance(e, ev.Started):
                return e
    raise AssertionError("no Started event")


def _bnb(base_dir: str, **quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(**quant),
                                                 device_map="cpu", dtype=torch.bfloat16).eval()
    return lora_model(model, seed=1, targets=TARGETS, r=16, lora_alpha=32)


def test_a_base_with_the_live_models_config_but_other_weights_is_refused_naming_the_tensor(tiny_models, tmp_path,
                                                                                          tuned):
    """Another seed's checkpoint of the same config, and a fine-tune of the base (every matrix moved by 1% of its
    spread), pass the config check but not the weights: a one-line refusal naming the folder, the tensor and the fix,
    nothing written, the model untouched; as [source] path and as the folder the model names."""
    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = qlora(base)
    out = tmp_path / "outs" / "out"
    os.makedirs(out.parent)
    for folder in (seed7, tuned):
        msg = _refused(_job(out, {"path": folder}), live, "holds another checkpoint than the live model's base", out)
        assert f"[source] path {os.path.abspath(folder)!r}" in msg and "point it at the 16-bit checkpoint" in msg
        assert "its model.layers.0." in msg and "is not what the live 4-bit weight encodes" in msg, msg
    inner = live.base_model.model
    live.peft_config["default"].base_model_name_or_path = inner.config._name_or_path = seed7
    msg = _refused(_job(out), live, "holds another checkpoint than the live model's base", out)
    assert f"({os.path.abspath(seed7)!r}, its config._name_or_path)" in msg and "its model.layers.0." in msg
    assert _FIX in msg


def test_the_folder_the_model_was_loaded_from_wins_over_the_adapters_recorded_base(tiny_models, tmp_path):
    """The adapter records another checkpoint of the same config as its base (trained there, loaded onto this one):
    the export is from the folder the live model itself names (config._name_or_path), Started.source_note says which
    was taken, and the output equals PEFT's merge of the adapter into that base, then export."""
    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = qlora(base)
    live.peft_config["default"].base_model_name_or_path = seed7
    seen = _export(_job(tmp_path / "out"), model=live)
    note = next(e for e in seen if isinstance(e, ev.Started)).source_note
    assert f"taken: {os.path.abspath(base)!r} (its config._name_or_path)" in note, note
    assert f"not {os.path.abspath(seed7)!r} (its base_model_name_or_path)" in note
    assert output_bytes(tmp_path / "out") == reference(base, live, tmp_path)


def test_of_two_named_folders_the_weights_decide_and_an_adapter_named_folder_is_checked_too(tiny_models, tmp_path,
                                                                                         tuned):
    """config._name_or_path names a checkpoint of the same config with other weights and the adapter the base: the
    base is taken, and the Started event says why the other was not; both folders wrong: one refusal naming both;
    only the adapter naming a folder (config._name_or_path a hub id): that folder, refused too when its weights
    are another checkpoint's."""
    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = qlora(base)
    config, inner = live.peft_config["default"], live.base_model.model
    inner.config._name_or_path, config.base_model_name_or_path = seed7, base
    note = _started(_job(tmp_path / "taken"), live).source_note
    assert f"taken: {os.path.abspath(base)!r} (its base_model_name_or_path)" in note, note
    assert f"not {os.path.abspath(seed7)!r} (its config._name_or_path), which holds another checkpoint: its " \
           "model.layers.0." in note

    out = tmp_path / "outs" / "out"
    os.makedirs(out.parent)
    config.base_model_name_or_path = tuned
    msg = _refused(_job(out), live, "neither folder the live model names is its base", out)
    assert repr(os.path.abspath(seed7)) in msg and repr(os.path.abspath(tuned)) in msg and _FIX in msg

    inner.config._name_or_path = "meta-llama/Llama-3.1-8B"
    msg = _refused(_job(out), live, "holds another checkpoint", out)
    assert f"({os.path.abspath(tuned)!r}, its base_model_name_or_path)" in msg
    config.base_model_name_or_path = base
    assert _started(_job(tmp_path / "adapter"), live).source_note == ""


@pytest.mark.parametrize("quant", [
    {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
    {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_blocksize": 128,
     "bnb_4bit_quant_storage": torch.bfloat16},
    "repacked",  # nf4, after an eval forward on a CPU with AVX512-BF16: bitsandbytes repacks it for CPU inference
], ids=["nf4-double-quant", "fp4-blocksize128-bf16-storage", "nf4-repacked-for-cpu"])
def test_each_4bit_setting_accepts_its_base_and_refuses_another_seed(tiny_models, tmp_path, quant):
    """Whatever the live 4-bit settings (quant type, blocksize, double quant, quant storage, bitsandbytes' CPU
    repacking): the bf16 folder it was loaded from is accepted, another seed's checkpoint refused naming its
    tensor."""
    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = _bnb(base, **(quant if quant != "repacked" else {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}))
    if quant == "repacked":
        import bitsandbytes.functional as F

        if not F.has_avx512bf16():
            pytest.skip("bitsandbytes repacks 4-bit weights for inference only on a CPU with AVX512-BF16")
        with torch.no_grad():
            live(torch.tensor([[1, 2, 3]]))
        weight = live.base_model.model.model.layers[0].self_attn.v_proj.base_layer.weight
        assert weight.quant_state.packing_format_for_cpu
    out = tmp_path / "out"
    with pytest.raises(SourceError, match="holds another checkpoint") as info:  # state_dict() would unpack it
        Supervisor(_job(out, {"path": seed7}), model=live)
    assert "\n" not in str(info.value) and "its model.layers.0." in str(info.value) and not out.exists()
    assert Supervisor(_job(out, {"path": base}), model=live).plan.job.source.path == os.path.abspath(base)
    if quant == "repacked":
        assert weight.quant_state.packing_format_for_cpu  # compared as it is, never unpacked in place


def test_a_base_quantized_with_other_arithmetic_is_checked_by_what_its_bytes_encode(tiny_models, tmp_path, tuned):
    """Double quant's offset one float32 ulp off, as a GPU's mean gives it (measured on an H200: 1-2 ulps from the
    CPU's): bitsandbytes' CPU quantization of the folder no longer matches the live bytes, yet the base is accepted
    (every value in its live code's cell, each absmax within the 8-bit step); another seed, the fine-tune, and the
    base with one live 4-bit code changed are refused."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file

    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = _bnb(base, load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    weights = [p for p in live.parameters() if type(p).__name__ == "Params4bit"]
    for p in weights:
        p.quant_state.offset = torch.nextafter(p.quant_state.offset, torch.tensor(1.0))
    v = live.base_model.model.model.layers[0].self_attn.v_proj.base_layer.weight
    disk = load_file(os.path.join(base, "model.safetensors"))["model.layers.0.self_attn.v_proj.weight"]
    _, cpu = F.quantize_4bit(disk, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert cpu.offset.item() != v.quant_state.offset.item()  # the bytes path cannot match
    assert Supervisor(_job(tmp_path / "out", {"path": base}), model=live).plan.job.source.path == os.path.abspath(base)
    out = tmp_path / "outs" / "out"
    os.makedirs(out.parent)
    for folder in (seed7, tuned):
        msg = _refused(_job(out, {"path": folder}), live, "is not what the live 4-bit weight encodes", out)
        assert "its model.layers.0.self_attn.v_proj.weight" in msg
    with torch.no_grad():
        v.data[0] ^= 0x80  # the first value's code 8 steps away
    msg = _refused(_job(out, {"path": base}), live, "is not what the live 4-bit weight encodes", out)
    assert "1 of its 8192 values lie outside the cell of their live code" in msg, msg


def test_an_8bit_base_is_checked_by_its_int8_rows_and_exports_from_its_folder(tiny_models, tmp_path):
    """A PEFT model over a bitsandbytes 8-bit base (Int8Params, on the CPU): another seed's checkpoint of the same
    config is refused naming its tensor; with no [source] its folder is taken and the output equals PEFT's merge of
    the saved adapter into the bf16 base, then export."""
    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    live = _bnb(base, load_in_8bit=True)
    assert type(live.base_model.model.model.layers[0].self_attn.v_proj.base_layer.weight).__name__ == "Int8Params"
    out = tmp_path / "outs" / "out"
    os.makedirs(out.parent)
    msg = _refused(_job(out, {"path": seed7}), live, "holds another checkpoint", out)
    assert "its model.layers.0." in msg and "is not what the live int8 weight encodes" in msg
    _export(_job(tmp_path / "out"), model=live)
    assert output_bytes(tmp_path / "out") == reference(base, live, tmp_path)


class _Opaque(torch.nn.Parameter):
    """A weight of a quantizer supervisor/live/qlora.py does not know: a tensor subclass it cannot compare."""


def test_a_base_of_an_unknown_quantizer_is_not_refused_and_the_started_event_says_it_is_unchecked(tiny_models,
                                                                                                 tmp_path):
    """A PEFT model whose base weights are a tensor subclass of no known quantizer, over another seed's checkpoint
    (same config): not refused (its weights cannot be compared), and Started.source_note says the base was checked
    by its config.json only, and why."""
    from transformers import AutoModelForCausalLM

    base, seed7 = tiny_models("llama"), tiny_models("llama", seed=7)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = _Opaque(module.weight.data, requires_grad=False)
    live = lora_model(model, seed=1, targets=TARGETS)
    note = _started(_job(tmp_path / "out", {"path": seed7}), live).source_note
    assert f"the base {os.path.abspath(seed7)!r} is checked by its config.json only" in note and "_Opaque" in note
