"""On a GPU: the per-part figures of a cuda export (peak GPU memory, each module's quantization error measured on
the device) and `supervisor report` over them."""
import json

import pytest
import torch

from tests.ref_quant_error import oneshot_errors
from tests.scenarios import cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16", "NVFP4A16"])
def test_cuda_export_journals_gpu_memory_and_errors(scheme, tiny_models, tmp_path):
    """Every layer records its peak GPU memory and, per quantized module, the error measured on the GPU, equal to
    oneshot + fake-quantize on cuda within 1e-4 relative; the report plots GPU memory."""
    path = tiny_models("llama")
    job = cli.write_job(tmp_path / "job.toml", path, tmp_path / "out", scheme, device="cuda")
    cli.run("run", job)
    report = json.loads(cli.run("report", tmp_path / "out", "--json").stdout)
    layers = [p for p in report["parts"] if p["index"] >= 0]
    assert layers and all(p["peak_gpu"] > 0 for p in layers)
    from child.backends.quantize import DEFAULT_IGNORE

    expected = oneshot_errors(path, scheme, list(DEFAULT_IGNORE), device="cuda")
    got = {name: err for p in report["parts"] for name, err in p["quant_error"].items()}
    assert set(got) == set(expected)
    for name, err in expected.items():
        assert got[name] == pytest.approx(err, rel=1e-4), name
    html = cli.run("report", tmp_path / "out", "--html", tmp_path / "r.html")
    assert "<figcaption>peak GPU MiB</figcaption>" in (tmp_path / "r.html").read_text(), html.stderr
