"""The README's demo command and the studio-backend example run end to end on a fresh folder."""
import json
import os
import re
import subprocess
import sys

from tests.scenarios import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Every line the demo may print: nothing from torch, torchao, transformers or llm-compressor.
DEMO_LINES = re.compile(r"^(building a small Llama-shaped model in |job file: |libraries imported in |"
                        r"worker \d+ \(pid \d+\) on \w+ ready in |export |exported |transformers loaded )")


def test_supervisor_demo_exports_and_loads(tmp_path):
    """`supervisor demo DIR` builds a model, exports it, and transformers loads the result; it prints only our
    lines, and the libraries' own output (build, worker, load-back) is in the logs."""
    proc = cli.run("demo", tmp_path / "demo")
    assert "transformers loaded" in proc.stderr and "top-1 agreement" in proc.stderr
    out = tmp_path / "demo" / "export-fp8_dynamic"
    printed = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert [ln for ln in printed if not DEMO_LINES.match(ln)] == []
    build, load_back = tmp_path / "demo" / "build-model.log", out / ".export" / "logs" / "load-back.log"
    logs = [build, *sorted((out / ".export" / "logs").glob("*.log"))]  # + the zygote's and the workers'
    logged = {ln.strip() for log in logs for ln in log.read_text().splitlines() if ln.strip()}
    assert build.stat().st_size and load_back.stat().st_size and not logged & {ln.strip() for ln in printed}
    assert "Loading weights" in load_back.read_text()  # transformers' progress bar, loading the export back
    with open(out / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    assert sorted(p.name for p in out.glob("model-layer-*.safetensors")) == \
        [f"model-layer-{i:05d}.safetensors" for i in range(8)]


def test_studio_backend_example_keeps_its_model(tmp_path):
    """examples/studio_backend.py exports while holding a live model and finds it unchanged afterwards."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "studio_backend.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "logits identical to before the export: True" in proc.stdout
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["type"] == "Finished"
