"""Compiled bytecode for the workers' imports where Python would keep none: a cache folder of this user's.

Python compiles a module's source at every import unless it finds the module's bytecode beside it (`__pycache__`),
and writes that bytecode when it may. Many container images do both things that defeat this: their packages are
installed without bytecode (`pip install --no-compile`) and writing it is turned off (`PYTHONDONTWRITEBYTECODE=1`).
There every process compiles torch, transformers, compressed-tensors and llm-compressor from source: on the
H100/H200 machines' image the warm parent's imports took 8.7-14.4 s, against 4.5-4.8 s read from this cache
(docs/performance.md, "Bytecode"). On the development VM, the same imports compiled from source took 6.6-7.1 s
against 2.4-2.5 s read from bytecode.

    cache_imports()  first thing in the warm parent (child.zygote), a spawned worker (python -m child) and the
                     loader check (python -m child.loadcheck): when the libraries' bytecode is missing and Python
                     cannot write it beside them, Python reads and writes bytecode under CACHE instead
                     (sys.pycache_prefix; the first run fills it, ~75 MB)
    CACHE            $SUPERVISOR_BYTECODE_CACHE, else $XDG_CACHE_HOME/layerwise-supervisor/bytecode (~/.cache/...):
                     a folder only this user can write (bytecode is code: a folder others can write is refused)
    $SUPERVISOR_BYTECODE_CACHE=off   Python left as it is

Nothing is written beside any source, and an environment whose libraries have their bytecode (a plain pip install)
or where Python writes it itself is left alone, as is one that chose its own folder (PYTHONPYCACHEPREFIX). A cached
file is checked against its source's mtime and size on every import, as Python's own are. Owns that decision only;
it imports nothing heavy and never touches a device.
"""
from __future__ import annotations

import importlib.util
import os
import stat
import sys

ENV = "SUPERVISOR_BYTECODE_CACHE"
# The libraries whose imports are the warm parent's seconds (child/imports.py); the ones installed are probed.
_PROBED = ("torch", "transformers", "compressed_tensors", "llmcompressor", "torchao")


def default_folder() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "layerwise-supervisor", "bytecode")


def uncompiled() -> list[str]:
    """The probed libraries installed without bytecode beside their source that Python cannot write there."""
    out = []
    for name in _PROBED:
        try:
            spec = importlib.util.find_spec(name)  # finds the package; imports nothing
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec is not None else None
        if not origin or not origin.endswith(".py") or os.path.exists(importlib.util.cache_from_source(origin)):
            continue
        if sys.dont_write_bytecode or not os.access(os.path.dirname(origin), os.W_OK):
            out.append(name)
    return out


def _safe_folder(path: str) -> str | None:
    """Why `path` must not hold bytecode this process runs, or None once it exists and only this user can write it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot create it ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.geteuid():
        return f"it belongs to user id {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write in it (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return None


def cache_imports() -> str | None:
    """Turn the cache on where it pays (module docstring); when it did something, says so in one line on stderr
    (the process's log) and returns that line."""
    said = _decide()
    if said:
        print(said, file=sys.stderr, flush=True)
    return said


def _decide() -> str | None:
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() == "off" or sys.pycache_prefix is not None:
        return None
    missing = uncompiled()
    if not missing:
        return None
    folder = os.path.abspath(os.path.expanduser(setting)) if setting else default_folder()
    why = _safe_folder(folder)
    if why is not None:
        return f"bytecode: not cached in {folder}: {why} ({ENV}=DIR names another folder, =off stops this)"
    sys.pycache_prefix, sys.dont_write_bytecode = folder, False
    return (f"bytecode: Python can keep none beside {', '.join(missing)}; the imports keep theirs in {folder} "
            f"({ENV}=off: compile them at every start)")
