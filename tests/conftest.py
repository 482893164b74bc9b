"""Session-wide test fixtures: tiny models built once, oneshot references computed once, the `gpu` marker.

Building a tiny model costs ~0.5 s and a oneshot run ~0.1 s (the first one in a process ~7 s of one-time
set-up), so every suite shares them through session-scoped caches instead of rebuilding per test.

Thread count: not pinned. Measured on a 1024-hidden Qwen3 layer (large enough for torch's intra-op
parallelism to kick in), oneshot with 1 thread and the layer quantizer with 2 threads give bit-identical
output for all seven data-free schemes: their arithmetic is element-wise plus min/max reductions, which do
not depend on the order of summation. GPTQ (a calibrated scheme) does depend on it; a test that compares
GPTQ bytes must pin `torch.set_num_threads` itself.
"""

from __future__ import annotations

import os

import pytest

# Each test's runs start their own warm parent and end it (resources.keep_warm = 0), as before that knob existed:
# a kept one would carry one test's state (its environment, its process tree) into the next. The kept-warm tests
# (tests/scenarios/test_keep_warm.py) ask for it in their jobs.
os.environ["SUPERVISOR_KEEP_WARM"] = "0"

from tests.models import make_tiny_model, oneshot_reference


@pytest.fixture(autouse=True)
def _quant_error_default():
    """An Exporter built in this process sets child.backends.quant_error.enabled from its job, as a worker does once
    (off for a CPU job that leaves measure_error unset): each test starts from the module's default again."""
    yield
    import sys

    module = sys.modules.get("child.backends.quant_error")
    if module is not None:
        module.enabled = True


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(kind, **options) -> path of a tiny checkpoint, built once per session per (kind, options)."""
    built: dict[tuple, str] = {}

    def get(kind: str, **options) -> str:
        key = (kind, tuple(sorted(options.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"model-{kind}")
            built[key] = make_tiny_model(kind, str(path), **options)
        return built[key]

    return get


@pytest.fixture(scope="session")
def oneshot_ref(tiny_models, tmp_path_factory):
    """oneshot_ref(kind, scheme, ignore=None, **model_options) -> folder of oneshot's compressed output, cached.

    ignore=None means child.backends.quantize.DEFAULT_IGNORE, the exporter's default.
    """
    done: dict[tuple, str] = {}

    def get(kind: str, scheme: str, ignore: list[str] | None = None, **model_options) -> str:
        if ignore is None:
            from child.backends.quantize import DEFAULT_IGNORE  # heavy import, only for suites that quantize

            ignore = DEFAULT_IGNORE
        key = (kind, scheme, tuple(ignore), tuple(sorted(model_options.items())))
        if key not in done:
            out = tmp_path_factory.mktemp(f"oneshot-{kind}-{scheme}")
            done[key] = oneshot_reference(tiny_models(kind, **model_options), scheme, list(ignore), str(out))
        return done[key]

    return get


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test never leaves a process behind: whatever it start()ed (tests/scenarios/cli.py: its CLI runs, LiveRun)
    that is still running when it ends, passed or failed, is SIGKILLed with its whole process group (warm parent,
    workers). A fixture's processes are the fixture's own to end."""
    from tests.scenarios import cli

    since = cli.started()
    try:
        yield
    finally:
        cli.end_started(since)


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: plain suites stay free of the torch import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """moe_models(kind, **options) -> path of a tiny checkpoint from tests/ref_moe.py (MoE families, Falcon, GPT-2,
    BLOOM, "unknown"), built once per session per (kind, options)."""
    from tests.ref_moe import UNKNOWN, make_family_model, make_unknown_model

    built: dict[tuple, str] = {}

    def get(kind: str, **options) -> str:
        key = (kind, tuple(sorted(options.items())))
        if key not in built:
            path = str(tmp_path_factory.mktemp(f"model-{kind}"))
            make = make_unknown_model if kind == UNKNOWN else (lambda p, **o: make_family_model(kind, p, **o))
            built[key] = make(path, **options)
        return built[key]

    return get


@pytest.fixture(scope="session")
def moe_oneshot(moe_models, tmp_path_factory):
    """moe_oneshot(kind, scheme, ignore=None, **model_options) -> folder of oneshot's compressed output, cached."""
    done: dict[tuple, str] = {}

    def get(kind: str, scheme: str, ignore: list[str] | None = None, **model_options) -> str:
        from shared.job import DEFAULT_IGNORE

        ignore = list(DEFAULT_IGNORE if ignore is None else ignore)
        key = (kind, scheme, tuple(ignore), tuple(sorted(model_options.items())))
        if key not in done:
            out = tmp_path_factory.mktemp(f"oneshot-{kind}-{scheme}")
            done[key] = oneshot_reference(moe_models(kind, **model_options), scheme, ignore, str(out))
        return done[key]

    return get


@pytest.fixture(scope="session")
def saved_export(tiny_models, tmp_path_factory):
    """saved_export(kind, scheme) -> {file: sha256} of exporting `load(kind).save_pretrained(tmp)` (plus its tokenizer)
    on the CPU: the reference for exports of that model held live (tests/ref_studio.py, built once per session)."""
    done: dict[tuple, dict] = {}

    def get(kind: str, scheme: str) -> dict:
        if (kind, scheme) not in done:
            from transformers import AutoTokenizer

            from shared.job import parse_job
            from supervisor import Supervisor
            from tests.ref_studio import load
            from tests.scenarios.cli import output_bytes

            tmp = tmp_path_factory.mktemp(f"saved-{kind}-{scheme}")
            load(tiny_models(kind)).save_pretrained(tmp / "saved")
            AutoTokenizer.from_pretrained(tiny_models(kind)).save_pretrained(tmp / "saved")
            job = parse_job({"source": {"path": str(tmp / "saved")},
                             "export": {"scheme": scheme, "output": str(tmp / "out")}, "resources": {"device": "cpu"}})
            with Supervisor(job) as run:
                run.wait()
            done[kind, scheme] = output_bytes(tmp / "out")
        return done[kind, scheme]

    return get
