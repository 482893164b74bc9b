"""`supervisor run` on tiny Llama and Qwen3 models equals llm-compressor's whole-model oneshot, per scheme."""
import json

import pytest
import torch

from shared.schemes import DATA_FREE
from tests.models import assert_same_tensors, load_tensors, loaded_logits
from tests.scenarios import cli


@pytest.fixture(scope="module")
def logits_input():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", DATA_FREE)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cli_export_equals_oneshot(kind, scheme, tiny_models, oneshot_ref, tmp_path, logits_input):
    """Every tensor, config.json and the transformers logits equal oneshot's for the same scheme and ignore."""
    source = tiny_models(kind)
    ref = oneshot_ref(kind, scheme)
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", source, out, scheme)
    proc = cli.run("run", job, "--json")
    kinds = [e["type"] for e in cli.events(proc)]
    assert kinds[0] == "Started" and kinds[-1] == "Finished", kinds

    assert_same_tensors(load_tensors(str(ref)), load_tensors(str(out)))
    with open(f"{ref}/config.json") as f:
        ref_cfg = json.load(f)
    with open(out / "config.json") as f:
        got_cfg = json.load(f)
    assert got_cfg["quantization_config"] == ref_cfg["quantization_config"]
    assert got_cfg == ref_cfg
    assert torch.equal(loaded_logits(str(out), logits_input), loaded_logits(str(ref), logits_input))


def test_cli_moe_export_equals_oneshot(tiny_models, oneshot_ref, tmp_path, logits_input):
    """A tiny Qwen3-MoE (routers left dense by the default ignore) exports equal to oneshot, and loads the same."""
    ref = oneshot_ref("qwen3moe", "W4A16")
    out = tmp_path / "out"
    cli.run("run", cli.write_job(tmp_path / "job.toml", tiny_models("qwen3moe"), out, "W4A16"), "--json")
    assert_same_tensors(load_tensors(str(ref)), load_tensors(str(out)))
    with open(f"{ref}/config.json") as a, open(out / "config.json") as b:
        assert json.load(a) == json.load(b)
    assert torch.equal(loaded_logits(str(out), logits_input), loaded_logits(str(ref), logits_input))
