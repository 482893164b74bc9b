"""The warm parent's imports (child/zygote.py `_imports`): what they cost beyond the modules themselves.

Each probe runs in a fresh interpreter, as the warm parent does (the imports freeze the interpreter's objects and
change its import machinery), once for the module."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what the warm parent's imports leave: the collector's record, and transformers' lazy import structure
PROBE = """
import gc, hashlib, json, sys
import child.imports
if sys.argv[1] == "transformers-own-cache":  # the reference: transformers' scan as it ships, nothing else changed
    child.imports._WholeScanCache.find_spec = lambda self, fullname, path=None, target=None: None
from child.zygote import _imports
_imports("compressed-tensors")
import transformers, transformers.models
from transformers.utils import import_utils

def structure(module):
    return hashlib.sha256(repr([sorted(module._modules), sorted(module._class_to_module.items()),
                                sorted((k, sorted(map(str, v))) for k, v in module._object_missing_backend.items())])
                          .encode()).hexdigest()

scan = import_utils.create_import_structure_from_path.cache_info()
print(json.dumps({"full_collections": gc.get_stats()[2]["collections"], "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "scan_misses": scan.misses, "scan_cached": scan.currsize,
                  "structure": [structure(transformers), structure(transformers.models)]}))
"""


def _probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-P", "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def warm_parent() -> dict:
    return _probe("as-the-warm-parent")


def test_the_imports_run_no_full_collection_and_leave_their_objects_frozen(warm_parent):
    """The imports make ~0.6 M objects that all stay; each full collection on the way scanned all of them (6-7 per
    import on the development VM, a quarter of the imports' CPU time). None runs during the imports now, the
    collector is on again afterwards, and what the imports made is frozen (out of every later collection's reach)."""
    assert warm_parent["full_collections"] == 0
    assert warm_parent["enabled"] is True
    assert warm_parent["frozen"] > 100_000


def test_transformers_reads_each_model_folder_once_and_builds_the_same_import_structure(warm_parent):
    """transformers' import walks its ~520 model folders twice (its package, then transformers.models) through an
    lru_cache of 128 entries, so the second walk reads every file again. In the warm parent each folder is read
    once (as many scans as folders cached), and the lazy modules' import structure is the one transformers builds
    with its own cache."""
    assert warm_parent["scan_misses"] == warm_parent["scan_cached"] > 300
    reference = _probe("transformers-own-cache")
    assert reference["scan_misses"] > 2 * 300  # the reference really walked twice
    assert warm_parent["structure"] == reference["structure"]


# a worker's first steps after the warm parent's imports: the backend for a tiny Llama, what it imported and built
WORKER_PROBE = """
import json, sys
from child.imports import preload
preload("compressed-tensors")
import transformers.conversion_mapping as mapping
builds = []
build = mapping._build_checkpoint_conversion_mapping
mapping._build_checkpoint_conversion_mapping = lambda: builds.append(1) or build()
before = set(sys.modules)
from child.backends.quantize import LayerQuantizer
q = LayerQuantizer(sys.argv[1], "FP8_DYNAMIC", ["lm_head"])
print(json.dumps({"layers": q.num_layers, "builds": len(builds), "imported": sorted(set(sys.modules) - before)}))
"""


def test_a_forked_workers_backend_finds_the_conversion_table_built_and_the_moe_classes_imported(tmp_path):
    """Every data-free worker's backend looks up llm-compressor's MoE linearizers (whose first lookup imports
    GPT-OSS's classes) and transformers' checkpoint conversions (whose first lookup builds the table of every
    architecture's): the warm parent does both, so after its imports a backend for a tiny Llama builds no table and
    imports only the Llama model's own modules."""
    from tests.models import make_tiny_model

    model = make_tiny_model("llama", str(tmp_path / "llama"))
    proc = subprocess.run([sys.executable, "-P", "-c", WORKER_PROBE, model], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["layers"] == 2 and seen["builds"] == 0, seen
    assert all(m.startswith("transformers.models.llama") for m in seen["imported"]), seen["imported"]
