"""child/imports.py: what a worker of each format imports."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import sys, torch\n"
         "from child.imports import preload\n"
         "preload({fmt!r})\n"
         "from transformers.utils import import_utils\n"
         "print('torchao', sys.modules.get('torchao') is not None, import_utils.is_torchao_available())\n")


@pytest.mark.parametrize("fmt, imported", [("compressed-tensors", False), ("torchao", True)])
def test_a_compressed_tensors_worker_never_imports_torchao(fmt, imported):
    """The warm parent's imports for compressed-tensors leave torchao out (transformers would import it, and on a
    GPU machine its import asked the GPU for its capability): transformers then reports it unavailable. A torchao
    worker imports it as before. Each in a fresh interpreter, as the warm parent is."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(fmt=fmt)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("torchao ")][-1]
    assert line == f"torchao {imported} {imported}"


EXTRAS_PROBE = ("import sys\n"
                "import child.imports as b\n"
                "if sys.argv[1] == 'without':\n"
                "    b._UNUSED = {{}}\n"
                "b.preload({fmt!r})\n"
                "from transformers.utils import import_utils as u\n"
                "print('available', u.is_sklearn_available(), u.is_scipy_available())\n")


@pytest.mark.parametrize("fmt", ["compressed-tensors", "torchao"])
def test_transformers_optional_extras_stay_out_of_a_worker(fmt, tmp_path):
    """sklearn, scipy, torchvision and torchaudio, when installed, are imported by transformers' own modules (sklearn
    alone took 1.2 s of the warm parent's imports on the H200 machine); no export uses them. Stand-in packages that
    leave a mark when imported show both sides, each in a fresh interpreter as the warm parent is: without the
    hiding transformers imports sklearn (and scipy, for compressed-tensors); with it none of the four is imported and
    transformers calls them unavailable."""
    site = tmp_path / "site"
    for name in ("sklearn", "scipy", "torchvision", "torchaudio"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"open({str(tmp_path / ('imported-' + name))!r}, 'w').close()\n")
    for module in ("sklearn/metrics.py", "scipy/optimize.py", "scipy/stats.py"):  # what transformers imports
        (site / module).write_text("def __getattr__(name):\n    return lambda *args, **kwargs: None\n")

    def run(mode: str) -> tuple[str, set[str]]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT])}
        proc = subprocess.run([sys.executable, "-c", EXTRAS_PROBE.format(fmt=fmt), mode], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        marks = {p.name[len("imported-"):] for p in tmp_path.glob("imported-*")}
        for p in tmp_path.glob("imported-*"):
            p.unlink()
        return [ln for ln in proc.stdout.splitlines() if ln.startswith("available ")][-1], marks

    for name in ("torchvision", "torchaudio"):  # transformers' image/audio code would need the real API
        os.rename(site / name, tmp_path / name)
    line, marks = run("without")
    assert line == "available True True" and "sklearn" in marks, (line, marks)
    for name in ("torchvision", "torchaudio"):
        os.rename(tmp_path / name, site / name)
    line, marks = run("with")
    assert line == "available False False" and not marks, (line, marks)


PEFT_PROBE = ("import sys\n"
              "import child.imports as b\n"
              "if sys.argv[1] == 'without':\n"
              "    b._UNUSED = {}\n"
              "b.preload('compressed-tensors')\n"
              "print('peft imported', sys.modules.get('peft') is not None)\n"
              "import torch\n"
              "from child.sources.adapter import LoraPair, merge_pair\n"
              "w = torch.zeros(4, 3, dtype=torch.bfloat16)\n"
              "pair = LoraPair(a=torch.ones(2, 3), b=torch.ones(4, 2), r=2, lora_alpha=2)\n"
              "print('merged', merge_pair(w, pair).float().tolist() == [[2.0] * 3] * 4, type(sys.modules['peft']))\n")


def test_peft_stays_out_of_a_worker_until_an_adapter_is_merged():
    """llm-compressor imports peft (0.43 s of the warm parent's imports on the H200 machine) only to recognise a
    PeftModel; the warm parent leaves it out, and a worker that merges a LoRA adapter (child/sources/adapter.py) imports it
    then and merges with it: (B @ A) * alpha / r added to a zero weight is 2 everywhere. Without the hiding the same
    imports bring peft in."""
    def run(mode: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", PEFT_PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [ln for ln in proc.stdout.splitlines() if ln.startswith(("peft imported", "merged"))]

    assert run("without")[0] == "peft imported True"
    lines = run("with")
    assert lines[0] == "peft imported False"
    assert lines[1] == "merged True <class 'module'>", lines


DATASETS_PROBE = ("import sys\n"
                  "from child.imports import preload\n"
                  "preload(sys.argv[1])\n"
                  "import llmcompressor, datasets\n"
                  "from datasets import Dataset\n"
                  "print('heavy', sorted(m for m in ('pandas', 'pyarrow') if m in sys.modules))\n"
                  "print('isinstance', isinstance([], Dataset))\n"
                  "from child.backends.samples import _oneshot_order\n"
                  "print('order', _oneshot_order([[1], [1, 2, 3], [1, 2], [4, 5, 6, 7]], 3))\n"
                  "for use in [lambda: Dataset.from_dict({'x': [1]}), lambda: datasets.load_dataset('json')]:\n"
                  "    if 'pandas' in sys.modules:  # the real library: nothing to refuse (and no Hub to ask)\n"
                  "        break\n"
                  "    try:\n"
                  "        print('used', type(use()).__name__)\n"
                  "    except (AttributeError, RuntimeError) as exc:\n"
                  "        print('refused', type(exc).__name__, exc)\n")


def test_an_export_warm_parent_leaves_datasets_unloaded_and_orders_samples_without_it():
    """llm-compressor imports `datasets` (and pandas, pyarrow) at its package import; no export worker uses it. The
    compressed-tensors warm profile (data-free and calibrated exports alike) serves a placeholder: llm-compressor
    imports, annotations and isinstance checks work, any use names the library instead of misbehaving, and a
    calibrated export's samples are still put in llm-compressor's sampler's order (longest first; the order itself
    is checked against oneshot's dataloader in tests/test_calibrate.py). A profile without the placeholder (torchao's)
    loads the real library through the same imports. Each in a fresh interpreter, as the warm parent is."""
    def run(profile: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", DATASETS_PROBE, profile], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [ln for ln in proc.stdout.splitlines() if ln.startswith(("heavy", "isinstance", "order", "used",
                                                                        "refused"))]

    export = run("compressed-tensors")
    assert export[:3] == ["heavy []", "isinstance False", "order [3, 1, 2]"], export
    assert export[3].startswith("refused AttributeError datasets.Dataset.from_dict: this worker's warm parent does "
                                "not load 'datasets'"), export
    assert export[4].startswith("refused RuntimeError datasets.load_dataset(...): this worker's warm parent"), export
    real = run("torchao")
    assert real == ["heavy ['pandas', 'pyarrow']", "isinstance False", "order [3, 1, 2]"], real
