"""Which runs may share a kept warm parent (supervisor.workers.zygote.kept_key), and the folder it lives in."""
from __future__ import annotations

import os
import stat

from supervisor.workers import zygote

ENV = {"PATH": "/usr/bin", "HOME": "/home/u", "HF_HOME": "/data/hf", "PWD": "/a"}


def test_the_key_ignores_what_nothing_reads_at_import():
    base = zygote.kept_key(ENV, "compressed-tensors")
    noise = {**ENV, "PWD": "/b", "OLDPWD": "/a", "SHLVL": "3", "_": "/usr/bin/x", "COLUMNS": "200",
             "SUPERVISOR_TEST_FAULT": '{"point": "read"}', "SUPERVISOR_KEEP_WARM": "60"}
    assert zygote.kept_key(noise, "compressed-tensors") == base


def test_the_key_changes_with_the_environment_the_format_and_the_code(monkeypatch):
    base = zygote.kept_key(ENV, "compressed-tensors")
    assert zygote.kept_key({**ENV, "HF_HOME": "/other"}, "compressed-tensors") != base
    assert zygote.kept_key({**ENV, "OMP_NUM_THREADS": "4"}, "compressed-tensors") != base
    assert zygote.kept_key(ENV, "torchao") != base
    stamp = zygote._code_stamp()
    assert any(f[0] == "child" and f[1] == "zygote.py" for f in stamp[1])  # the files the zygote imports
    assert {lib for lib, _ in stamp[2]} >= {"torch", "transformers", "compressed-tensors", "llmcompressor"}
    monkeypatch.setattr(zygote, "_code_stamp", lambda: [stamp[0], stamp[1][1:], stamp[2]])
    assert zygote.kept_key(ENV, "compressed-tensors") != base


def test_keep_warm_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(zygote.KEEP_WARM_ENV, raising=False)
    assert zygote.keep_warm_seconds(None) == zygote.DEFAULT_KEEP_WARM
    monkeypatch.setenv(zygote.KEEP_WARM_ENV, "0")
    assert zygote.keep_warm_seconds(None) == 0
    assert zygote.keep_warm_seconds(45) == 45  # the job's value wins
    monkeypatch.setenv(zygote.KEEP_WARM_ENV, "soon")
    assert zygote.keep_warm_seconds(None) == zygote.DEFAULT_KEEP_WARM


def test_the_folder_is_private_or_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = zygote.kept_dir()
    assert made == os.path.join(str(tmp_path), f"supervisor-{os.getuid()}")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    os.chmod(made, 0o755)  # readable by others: not ours to trust
    assert zygote.kept_dir() is None
    os.chmod(made, 0o700)
    assert zygote.kept_parents() == []


def test_the_code_stamp_covers_the_sub_packages():
    """A module in a sub-package (child/backends/, child/sources/) is in the stamp: editing it starts a fresh warm
    parent instead of serving the old code."""
    files = {(f[0], f[1]) for f in zygote._code_stamp()[1]}
    assert ("child", os.path.join("backends", "quantize.py")) in files
    assert ("child", os.path.join("sources", "checkpoint.py")) in files
