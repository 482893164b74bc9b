"""supervisor/run/verbatim.py's rules: which exports copy the non-layer part ahead, and when the export plan confirms the
copy. (The copy's bytes against a worker's are tests/scenarios/test_verbatim.py's.)"""
from __future__ import annotations

import pytest

from shared.job import parse_job
from shared.messages import NON_LAYER, Described, PartPlan
from supervisor.run import verbatim
from supervisor.checks.source import inspect


def _job(model, **export):
    return parse_job({"source": {"path": model}, "export": {"scheme": "FP8_DYNAMIC", "output": "o", **export}})


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("llama")


def test_a_data_free_export_copies_every_tensor_outside_the_layers(llama):
    src = inspect(llama)
    part = verbatim.part_to_copy(_job(llama), src)
    names = [t.name for t in part.tensors]
    assert names == sorted(n for n in src.tensor_names if not n.startswith("model.layers."))
    assert names == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert {t.dtype for t in part.tensors} == {"bfloat16"} and part.nbytes > 0


@pytest.mark.parametrize("why, job", [
    ("lm_head quantized", {"ignore": []}),
    ("torchao", {"format": "torchao", "scheme": "Int8WeightOnly"}),
])
def test_exports_that_change_the_part_do_not_copy_it(why, job, llama):
    data = {"source": {"path": llama}, "export": {"scheme": "FP8_DYNAMIC", "output": "o", **job}}
    assert verbatim.part_to_copy(parse_job(data), inspect(llama)) is None, why


def test_a_calibrated_export_copies_it_until_the_plan_says_otherwise(llama, tmp_path):
    """Calibration changes the layers only, except the offset norms' round trip (the worker names those)."""
    (tmp_path / "c.jsonl").write_text('{"text": "t5 t6"}\n')
    data = {"source": {"path": llama}, "export": {"scheme": "W4A16", "output": "o", "method": "gptq"},
            "calibration": {"dataset": str(tmp_path / "c.jsonl"), "samples": 1, "seq_len": 4}}
    part = verbatim.part_to_copy(parse_job(data), inspect(llama))
    assert [t.name for t in part.tensors] == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    plan = PartPlan(index=NON_LAYER, kept=[t.name for t in part.tensors if t.name != "model.norm.weight"],
                    rewritten=["model.norm.weight"], out_bytes=part.nbytes)
    why = part.differs(Described(backend="x", layer_prefix="model.layers.", parts=[plan]))
    assert why == "the export rewrites 'model.norm.weight' (calibration's offset-norm round trip)"


def test_an_adapter_or_the_switch_turns_it_off(llama, monkeypatch):
    src = inspect(llama)
    job = _job(llama)
    job.source.adapter = "/some/adapter"  # a merge may change values under the same names
    assert verbatim.part_to_copy(job, src) is None
    monkeypatch.setenv(verbatim.OFF_ENV, "1")
    assert verbatim.part_to_copy(_job(llama), src) is None


def test_the_plan_confirms_only_an_unchanged_part(llama):
    part = verbatim.part_to_copy(_job(llama), inspect(llama))
    names = [t.name for t in part.tensors]

    def described(**plan):
        fields = dict(index=NON_LAYER, quantized=[], kept=names, out_bytes=part.nbytes) | plan
        return Described(backend="x", layer_prefix="model.layers.", parts=[PartPlan(index=0), PartPlan(**fields)])

    assert part.differs(described()) == ""
    assert "quantizes 'lm_head.weight'" in part.differs(described(quantized=["lm_head.weight"], kept=names[1:]))
    assert "other tensors" in part.differs(described(kept=names[:-1]))
    assert "bytes" in part.differs(described(out_bytes=part.nbytes + 4))  # an extra tensor written beside them
    assert "does not describe" in part.differs(Described(backend="x", layer_prefix="model.layers."))
