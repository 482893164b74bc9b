"""On a GPU: every MoE family quantized on cuda equals oneshot (on the GPU too), the CLI exports and refuses as on
CPU, and a 12-layer 32-expert export keeps the worker's GPU memory and RSS flat."""
from __future__ import annotations

import json

import pytest
import torch

from shared.job import DEFAULT_IGNORE
from tests.models import assert_same_tensors, load_tensors
from tests.ref_moe import FAMILIES, to_checkpoint_names
from tests.scenarios import cli
from tests.test_moe_families import export_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "NVFP4A16"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_cuda_family_equals_oneshot(kind, scheme, moe_models, moe_oneshot):
    """Every part quantized on cuda:0 comes back on CPU equal to oneshot's output (names mapped for Mixtral)."""
    got = export_in_process(moe_models(kind), scheme, list(DEFAULT_IGNORE), device="cuda:0")
    assert all(t.device.type == "cpu" for t in got.values())
    assert_same_tensors(to_checkpoint_names(kind, load_tensors(moe_oneshot(kind, scheme))), got)


@pytest.mark.parametrize("kind", ["mixtral", "deepseekv3", "gptoss"])
def test_cuda_cli_fp8_exports_equal_oneshot_and_verify(kind, moe_models, moe_oneshot, tmp_path):
    """`supervisor run` on cuda, FP8_DYNAMIC: equal to oneshot, and verify (hashes + transformers' loader) passes.
    GPT-OSS with its experts ignored (no quantized layout of them loads in transformers 5.17)."""
    ignore = ["lm_head", "re:.*experts.*"] if kind == "gptoss" else None
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", moe_models(kind), out, "FP8_DYNAMIC", device="cuda", ignore=ignore)
    events = cli.events(cli.run("run", job, "--json"))
    assert events[-1]["type"] == "Finished"
    if kind != "gptoss":
        assert_same_tensors(to_checkpoint_names(kind, load_tensors(moe_oneshot(kind, "FP8_DYNAMIC"))),
                            load_tensors(str(out)))
    assert cli.run("verify", out).returncode == 0


def test_cuda_nvfp4_moe_is_refused(moe_models, tmp_path):
    """NVFP4A16 on a MoE (DeepSeek-V3) with device cuda: refused before any layer is journaled, exit 2, nothing
    left on disk."""
    job = cli.write_job(tmp_path / "job.toml", moe_models("deepseekv3"), tmp_path / "out", "NVFP4A16", device="cuda")
    proc = cli.run("run", job, "--json", check=False)
    assert proc.returncode == 2 and "weight_global_scale" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cuda_moe_memory_flat(moe_models, tmp_path):
    """12 layers x 32 experts on cuda: the last layer's peak GPU memory and peak RSS within 5% of the first's."""
    model = moe_models("qwen3moe", layers=12, experts=32)
    # one worker: the check is that one process's memory stays flat from layer to layer
    job = cli.write_job(tmp_path / "job.toml", model, tmp_path / "out", "W4A16", device="cuda", workers=1)
    events = cli.events(cli.run("run", job, "--json"))
    layers = sorted((e for e in events if e["type"] == "LayerWritten" and e["index"] >= 0), key=lambda e: e["index"])
    assert len(layers) == 12 and layers[0]["peak_gpu"] > 0
    assert layers[-1]["peak_gpu"] <= 1.05 * layers[0]["peak_gpu"], [e["peak_gpu"] for e in layers]
    assert layers[-1]["peak_rss"] <= 1.05 * layers[0]["peak_rss"], [e["peak_rss"] for e in layers]
    print(json.dumps({"peak_gpu": [e["peak_gpu"] for e in layers], "peak_rss": [e["peak_rss"] for e in layers]}))
