"""The warm parent computes Triton's own cache key before it forks workers (child/zygote.py, _hash_triton_ahead), so
a forked worker's first Triton kernel does not hash Triton's files again. Triton is not installed on the CPU machines
the suite runs on: a stand-in module with the same cached function shows what the zygote does with it."""
from __future__ import annotations

import functools
import importlib.machinery
import sys
import types

from child import zygote


def _fake_triton(monkeypatch, key):
    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    triton.__path__ = []
    runtime = types.ModuleType("triton.runtime")
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = key
    runtime.cache = cache
    triton.runtime = runtime
    for name, module in (("triton", triton), ("triton.runtime", runtime), ("triton.runtime.cache", cache)):
        monkeypatch.setitem(sys.modules, name, module)


def test_the_key_is_computed_once_in_the_warm_parent_and_cached_for_its_forks(monkeypatch):
    calls = []

    @functools.lru_cache
    def triton_key():
        calls.append(1)
        return "3.x-abc"

    _fake_triton(monkeypatch, triton_key)
    thread = zygote._hash_triton_ahead()
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert calls == [1]
    assert triton_key.cache_info().currsize == 1  # what a forked worker's first kernel finds
    triton_key()
    assert calls == [1]


def test_without_triton_nothing_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # Python's "not installed" marker
    assert zygote._hash_triton_ahead() is None


def test_a_failing_key_leaves_the_worker_to_compute_it(monkeypatch):
    def triton_key():
        raise OSError("libtriton.so: unreadable")

    _fake_triton(monkeypatch, triton_key)
    thread = zygote._hash_triton_ahead()
    thread.join(timeout=30)
    assert not thread.is_alive()  # it ended quietly: the imports go on and report ready
