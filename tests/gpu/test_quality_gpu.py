"""On a GPU: `verify --quality` of cuda exports (FP8_DYNAMIC: activations quantized on the device; W4A16; a MoE)
equals transformers' whole-model figures computed in the test (the reference loads both folders on the CPU)."""
import json

import pytest
import torch

from tests.scenarios import cli
from tests.scenarios.test_quality import SEQ, _assert_agrees, _verify, held_out, reference  # noqa: F401

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind,scheme", [("llama", "FP8_DYNAMIC"), ("qwen3", "W4A16"), ("qwen3moe", "W4A16")])
def test_cuda_quality_equals_whole_model_transformers(kind, scheme, tiny_models, held_out, tmp_path):  # noqa: F811
    source = tiny_models(kind, layers=2)
    out = tmp_path / "out"
    cli.run("run", cli.write_job(tmp_path / "job.toml", source, out, scheme, device="cuda"), "--json")
    _, got = _verify(str(out), held_out)
    _assert_agrees(got, reference(source, str(out), held_out, SEQ))
    records = [json.loads(line) for line in open(out / ".export" / "quality" / "journal.jsonl")]
    assert all(r["peak_gpu"] > 0 for r in records if r["type"] == "Layer")
