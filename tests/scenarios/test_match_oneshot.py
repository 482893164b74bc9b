"""`[calibration] match_oneshot = false`: GPTQ's Hessians from the inputs' own dtype with fp32 accumulation (tensor
cores on a GPU), no longer oneshot's bits, held to the default export's quality on several architectures.

The bounds (docs/fidelity.md, as for a group against W = 1): on layer 0, whose inputs both compute alike, every
module's GPTQ loss within 0.5% of the default's; every layer's total loss within 1%; the loaded model's logits on
held-out ids no further from the bf16 model's than the default export's plus 2% (on the CPU's tiny models: 5%, their noise band). A folder started with one setting
is not resumed with the other (exit 2, one line, nothing changed); `plan` and `report` say which arithmetic. AWQ takes
the setting too: it changes AWQ's attention on a GPU only (tests/gpu/test_calibrated_gpu.py), so on the CPU its
export is the default's, bit for bit.
"""
import json
import os

import pytest
import torch

from shared import layout
from tests.models import load_tensors, loaded_logits
from tests.ref_calib import token_rows, write_jsonl
from tests.scenarios import cli

N, SEQ = 20, 40
HELD_OUT = torch.randint(4, 256, (8, 64), generator=torch.Generator().manual_seed(12))
KINDS = ["llama", "qwen3", "deepseekv3"]  # dense; dense with q/k norms; MLA with a dense first layer and MoE


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("calib") / "ids.jsonl", token_rows(N, seed=5))


def _job(tmp_path, model, dataset, out, fast, name="job.toml", method="gptq", **resources):
    calibration = {"dataset": dataset, "samples": N, "seq_len": SEQ}
    if fast is not None:
        calibration["match_oneshot"] = not fast
    return cli.write_job(tmp_path / name, model, out, "W4A16", method=method, torch_threads=1,
                         calibration=calibration, **resources)


def _losses(out) -> dict[str, float]:
    """module -> GPTQ's loss, from the newest journal record of each layer."""
    latest = {}
    with open(os.path.join(out, layout.STATE_DIR, layout.JOURNAL)) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "Shard":
                latest[r["index"]] = r.get("losses", {})
    return {k: v for losses in latest.values() for k, v in losses.items()}


@pytest.fixture(scope="module")
def exports(tiny_models, moe_models, dataset, tmp_path_factory):
    """kind -> (source, the default export's folder, the fast export's folder)."""
    built = {}

    def get(kind):
        if kind not in built:
            model = moe_models(kind) if kind == "deepseekv3" else tiny_models(kind, layers=3, seed=3)
            tmp = tmp_path_factory.mktemp(f"fast-{kind}")
            for name, fast in (("default", None), ("fast", True)):
                cli.run("run", _job(tmp, model, dataset, tmp / name, fast, name=f"{name}.toml"), "--json")
            built[kind] = (model, tmp / "default", tmp / "fast")
        return built[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_fast_hessians_keep_the_defaults_quality(kind, exports):
    """Layer 0's every module's GPTQ loss within 0.5% of the default export's, every layer's total within 1%, the
    held-out logits no further from the bf16 model's than the default's plus 5% (their noise band on these tiny models); the same tensors."""
    model, default, fast = exports(kind)
    # held out: the noise band of rounding-only changes on models this small (docs/fidelity.md: two exports that
    # differ by rounding alone were 0.952-1.048x apart over 8 seeds), not the 2%, which the GPU test of
    # hidden 1024 holds (tests/gpu/test_calibrated_gpu.py). Seen 1.036 for the DeepSeek-V3 case on an AVX2-only
    # host, whose fp32 sums round other bits than an AVX-512 host's (there the packed weights came out equal)
    assert_keeps_the_defaults_quality(model, default, fast, HELD_OUT, held_out_bound=1.05)


def assert_keeps_the_defaults_quality(source, default, fast, held_out: torch.Tensor,
                                      held_out_bound: float = 1.02) -> float:
    """The bounds (module docstring) of the `fast` export's folder against the `default` one's, both from `source`;
    `held_out_bound`: the largest held-out distance fast / default allowed. Returns that ratio."""
    one, two = _losses(default), _losses(fast)
    assert one and sorted(one) == sorted(two)
    assert any(one[k] != two[k] for k in one)  # the other arithmetic ran (on the CPU: the last digits of the losses)
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in one})
    for name in (n for n in one if ".layers.0." in n):
        assert abs(two[name] - one[name]) <= 0.005 * abs(one[name]), (name, one[name], two[name])
    for i in layers:
        a, b = (sum(v for k, v in d.items() if f".layers.{i}." in k) for d in (one, two))
        assert abs(b - a) <= 0.01 * a, (i, a, b)
    bf16 = loaded_logits(str(source), held_out).float()
    d1 = (loaded_logits(str(default), held_out).float() - bf16).norm()
    d2 = (loaded_logits(str(fast), held_out).float() - bf16).norm()
    assert d2 <= held_out_bound * d1, (float(d1), float(d2))
    # the same tensors (on the CPU often the same bits too: the fp32 sums differ in their last bits only)
    a, b = load_tensors(str(default)), load_tensors(str(fast))
    assert {k: (t.dtype, t.shape) for k, t in a.items()} == {k: (t.dtype, t.shape) for k, t in b.items()}
    return float(d2 / d1)


def test_the_other_setting_is_refused_and_plan_and_report_name_the_arithmetic(tiny_models, dataset, tmp_path):
    """A folder a fast export left half done is not resumed with the default (exit 2, one line, the folder
    unchanged); `plan` and `report` name the arithmetic of each setting."""
    model = tiny_models("llama", layers=3, seed=3)
    out = tmp_path / "out"
    fault = {"SUPERVISOR_TEST_FAULT": json.dumps({"point": "calibrate", "action": "sigkill", "index": 2,
                                                  "once": str(tmp_path / "fired")})}
    first = cli.run("run", _job(tmp_path, model, dataset, out, True, max_attempts=1), "--json", env=fault,
                    check=False)
    assert first.returncode == 1, first.stderr
    before = cli.output_bytes(out)
    refused = cli.run("run", _job(tmp_path, model, dataset, out, None, name="default.toml"), check=False)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "different job" in lines[0], refused.stderr
    assert cli.output_bytes(out) == before
    assert "match_oneshot = false" in cli.run("report", out).stdout
    plan_fast = cli.run("plan", _job(tmp_path, model, dataset, tmp_path / "p", True, name="p.toml")).stdout
    plan_default = cli.run("plan", _job(tmp_path, model, dataset, tmp_path / "p", None, name="p.toml")).stdout
    assert "match_oneshot = false" in plan_fast and "oneshot's, bit for bit" in plan_default


def test_awq_on_the_cpu_keeps_the_defaults_bits_and_plan_says_so(tiny_models, dataset, tmp_path):
    """AWQ with match_oneshot = false changes its attention to SDPA on a GPU only (tests/gpu/test_calibrated_gpu.py
    holds it to the default's quality there); on the CPU every tensor is the default AWQ export's, bit for bit, and
    `plan` names AWQ's fast arithmetic, not GPTQ's."""
    model = tiny_models("llama", layers=2, seed=3)
    for name, fast in (("default", None), ("fast", True)):
        cli.run("run", _job(tmp_path, model, dataset, tmp_path / name, fast, name=f"{name}.toml", method="awq"),
                "--json")
    a, b = load_tensors(str(tmp_path / "default")), load_tensors(str(tmp_path / "fast"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plan = cli.run("plan", _job(tmp_path, model, dataset, tmp_path / "p", True, name="p.toml", method="awq")).stdout
    assert "SDPA attention in AWQ's" in plan and "Hessians" not in plan, plan
