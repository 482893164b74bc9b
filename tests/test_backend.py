"""child/backend.py: what a worker of each format imports."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = ("import sys, torch\n"
         "from child.backend import preload\n"
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
