"""child/bytecode.py: the workers' bytecode kept in a cache folder where Python would keep none beside the source.

Each case runs in a fresh interpreter (cache_imports() changes the interpreter's import machinery), on a package
made here without bytecode (`fakepkg`, the one library probed), as the H100/H200 image installs torch and the rest;
the interpreter's own verbose import log (`python -v`) is the witness of where a module's code came from."""
from __future__ import annotations

import glob
import json
import os
import py_compile
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, sys
from child import bytecode
bytecode._PROBED = ("fakepkg",)
said = bytecode.cache_imports()
import fakepkg.sub
print(json.dumps({"said": said, "value": fakepkg.sub.VALUE, "prefix": sys.pycache_prefix}))
"""


def _site(tmp_path) -> str:
    site = tmp_path / "site"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("")
    (site / "fakepkg" / "sub.py").write_text("VALUE = 41 + 1\n")
    return str(site)


def _env(site: str, env: dict) -> dict:
    """This process's environment without Python's own bytecode settings, `site` first on the path, then `env`."""
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    full.update(PYTHONPATH=os.pathsep.join([site, ROOT]), **env)
    return full


def _run(site: str, env: dict, *flags: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-P", *flags, "-c", PROBE], cwd=ROOT, env=_env(site, env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _cached(cache: str, name: str) -> list[str]:
    return glob.glob(os.path.join(cache, "**", f"{name}.cpython-*.pyc"), recursive=True)


def test_a_library_without_bytecode_is_compiled_once_into_the_cache_and_read_from_it_after(tmp_path):
    """Writing off (PYTHONDONTWRITEBYTECODE) and no bytecode beside the source: the first process writes it under
    the cache folder (only this user's, nothing beside the source), the next one's code comes from there."""
    site, cache = _site(tmp_path), str(tmp_path / "cache")
    env = {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": cache}
    first, _ = _run(site, env)
    assert first["value"] == 42 and first["prefix"] == cache
    assert "fakepkg" in first["said"] and cache in first["said"], first["said"]
    assert _cached(cache, "sub") and _cached(cache, "__init__"), os.listdir(cache)
    assert not glob.glob(os.path.join(site, "**", "*.pyc"), recursive=True)  # nothing beside the source
    assert os.stat(cache).st_mode & 0o777 == 0o700
    second, verbose = _run(site, env, "-v")
    assert second["value"] == 42
    assert f"code object from '{_cached(cache, 'sub')[0]}'" in verbose


def test_python_is_left_alone_where_it_keeps_bytecode_itself_or_was_told_how(tmp_path):
    """No cache when it is turned off, when the bytecode is beside the source, when Python writes it there itself,
    or when PYTHONPYCACHEPREFIX chose a folder: cache_imports() says nothing and writes nothing."""
    site, cache = _site(tmp_path), str(tmp_path / "cache")
    off = {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": "off"}
    own = {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": cache,
           "PYTHONPYCACHEPREFIX": str(tmp_path / "own")}
    writes = {"SUPERVISOR_BYTECODE_CACHE": cache}  # writing on, the package's folder writable
    for env in (off, own, writes):
        out, _ = _run(site, env)
        assert out["said"] is None and out["value"] == 42, (env, out)
        assert not os.path.exists(cache), env
    assert glob.glob(os.path.join(site, "fakepkg", "__pycache__", "sub.cpython-*.pyc"))  # `writes`: Python's own
    compiled = _site(tmp_path / "compiled")
    for name in ("__init__", "sub"):
        py_compile.compile(os.path.join(compiled, "fakepkg", f"{name}.py"), doraise=True)
    out, _ = _run(compiled, {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": cache})
    assert out["said"] is None and out["prefix"] is None and not os.path.exists(cache), out


def test_a_cache_folder_others_may_write_is_refused_in_one_line(tmp_path):
    """Bytecode is code: a folder group or others may write is not used (the line says why and how to fix it)."""
    site, cache = _site(tmp_path), tmp_path / "shared-cache"
    cache.mkdir()
    cache.chmod(0o777)
    out, _ = _run(site, {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": str(cache)})
    assert out["prefix"] is None and out["value"] == 42
    assert "not cached" in out["said"] and "chmod go-w" in out["said"] and "\n" not in out["said"], out["said"]
    assert not _cached(str(cache), "sub")


ZYGOTE = """
import sys
from child import bytecode
bytecode._PROBED = ("fakepkg",)
from child.zygote import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_warm_parent_caches_its_imports_bytecode(tmp_path):
    """The warm parent (child.zygote) turns the cache on before its imports: torch's own modules are compiled into
    the cache folder, and its log says so."""
    site, cache = _site(tmp_path), str(tmp_path / "cache")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = _env(site, {"PYTHONDONTWRITEBYTECODE": "1", "SUPERVISOR_BYTECODE_CACHE": cache})
    proc = subprocess.Popen([sys.executable, "-P", "-c", ZYGOTE, "--sock-fd", str(theirs.fileno()), "--parent-pid",
                             str(os.getpid()), "--format", "plain"], cwd=ROOT, env=env, pass_fds=[theirs.fileno()],
                            stderr=subprocess.PIPE, text=True)
    theirs.close()
    try:
        ours.settimeout(180)
        ready = json.loads(ours.recv(1 << 20))  # the imports are done
        assert ready.get("ready"), ready
    finally:
        ours.close()  # the zygote ends when its socket closes
        _, err = proc.communicate(timeout=60)
    import torch

    assert f"imports keep theirs in {cache}" in err, err[-2000:]
    torch_dir = os.path.dirname(torch.__file__).lstrip(os.sep)
    assert glob.glob(os.path.join(cache, torch_dir, "__init__.cpython-*.pyc")), os.listdir(cache)
