"""The warm parent computes Triton's own cache key before it forks workers (child/zygote.py, _hash_triton_ahead), so
a forked worker's first Triton kernel does not hash Triton's files again. Triton is not installed on the CPU machines
the suite runs on: a stand-in module with the same cached function shows what the zygote does with it."""
from __future__ import annotations

import functools
import importlib.machinery
import os
import subprocess
import sys
import textwrap
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


# In a fresh interpreter (the imports change its environment and freeze its objects): a stand-in Triton whose key
# logs the pid of each process that computes it, the libraries' imports replaced by a wait for that key (so the key
# must be computed beside them, not after), then a fork, as the zygote forks a worker, whose first kernel asks for it.
_THROUGH_IMPORTS = textwrap.dedent("""
    import functools, importlib.machinery, os, sys, threading, types
    log = sys.argv[1]

    @functools.lru_cache
    def triton_key():
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        computed.set()
        return "3.x-abc"

    computed = threading.Event()
    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    triton.__path__ = []
    runtime, cache = types.ModuleType("triton.runtime"), types.ModuleType("triton.runtime.cache")
    cache.triton_key, runtime.cache, triton.runtime = triton_key, cache, runtime
    sys.modules.update({"triton": triton, "triton.runtime": runtime, "triton.runtime.cache": cache})

    import child.imports
    child.imports.preload = lambda fmt: print("beside the imports:", computed.wait(timeout=30))
    from child import zygote

    zygote._imports("compressed-tensors")
    print("parent", os.getpid())
    pid = os.fork()
    if pid == 0:
        triton_key()
        os._exit(0)
    os.waitpid(pid, 0)
""")


def test_the_warm_parent_computes_the_key_beside_its_imports_and_its_forks_inherit_it(tmp_path):
    log = tmp_path / "computed"
    proc = subprocess.run([sys.executable, "-c", _THROUGH_IMPORTS, str(log)], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "beside the imports: True" in lines
    parent = next(line.split()[1] for line in lines if line.startswith("parent "))
    assert log.read_text().split() == [parent]  # computed once, by the warm parent; the fork found it cached
