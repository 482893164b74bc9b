"""What a worker imports, and what it must not: the warm parent's preload, and the libraries hidden from it.

    child.zygote (the warm parent)         preload(profile): hide_unused(profile), then _MODULES and _WARM_UP
    python -m child (a spawned worker)     hide_unused(profile) before anything imports transformers
    child/sources/adapter.py               allow("peft") before it imports peft

Module names live here as strings (_MODULES, _WARM_UP): a moved module must be renamed here too
(tests/test_zygote_imports.py and tests/test_backend.py import them in fresh interpreters). Owns those lists and
the import hooks only; it never reads the source, builds a backend or touches a device.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import types


# The modules each format's backend imports: the warm parent (child.zygote) imports them once, before forking.
_MODULES: dict[str, tuple[str, ...]] = {
    # child.backends.calibrate is left out: one of its imports initialised CUDA on the H200 machine (2026-11-30), which
    # would make forked workers unusable there; a calibrated export runs one worker, which imports it itself.
    "compressed-tensors": ("child.backends.quantize", "child.backends.name_only", "child.loadcheck", "child.preview"),
    "torchao": ("child.backends.torchao_backend",),
}
# Then what every worker of the format does first whatever the job (each function takes no argument and touches no
# device): done once in the warm parent, inherited by every fork.
_WARM_UP: dict[str, tuple[str, ...]] = {"compressed-tensors": ("child.backends.quantize:warm_up",)}


# Libraries a format's worker never uses but that its libraries import when they are installed, each behind
# transformers' own is_<name>_available() check:
# - torchao: transformers' quantizer registry (and through it sympy and torch._dynamo; it also asked the GPU for its
#   capability on an H200 machine, child/zygote.py). 0.5 s of 4.4 s on this repo's CPU machine, 3.8 s of 25 s there.
# - sklearn (and pandas through it): transformers.generation.candidate_generator; scipy: transformers.loss;
#   torchvision, torchaudio: transformers' image and audio utilities. None of them installed on the CPU machine;
#   on the H200 machine's image sklearn alone took 1.2 s of the warm parent's 12 s (`bench/gpu_session.sh s7a`).
# - peft: llm-compressor's sequential pipeline helpers import it, behind the same check, only to recognise a PeftModel
#   (which no export here hands them); 0.43 s of the warm parent's imports on the H200 machine. The one user is
#   child/sources/adapter.py (a LoRA merged per layer), which calls `allow("peft")` before it imports it.
# Nothing on an export's path imports them otherwise (llm-compressor, compressed-tensors, accelerate, datasets and
# our code do not; peft uses sklearn only inside one adapter type's clustering, AdaMSS, which no export here builds).
_OPTIONAL_EXTRAS = ("sklearn", "scipy", "torchvision", "torchaudio", "peft")
_UNUSED: dict[str, tuple[str, ...]] = {"compressed-tensors": ("torchao", *_OPTIONAL_EXTRAS),
                                       "torchao": _OPTIONAL_EXTRAS}

# Libraries an export worker never uses but that its libraries import unconditionally, so they cannot be marked
# absent: llm-compressor's package __init__ imports its entrypoints, whose dataset arguments and typing import
# `datasets` (with pandas and pyarrow): 0.7 s of the warm parent's 5.7-6.4 s on this repo's CPU machine, the same
# for oneshot and model_free_ptq, which import it whole. Their imports get a placeholder (_Unloaded): every name
# in it is an inert class, enough for annotations and isinstance checks; calling one or reading its attributes
# raises an error that names the library. A calibrated export's samples are ordered by llm-compressor's own
# sampler over the token lists (child/backends/samples.py), not through datasets.Dataset, and nothing else on an
# export's path (llm-compressor's modifiers, lifecycle and pipeline cache; compressed-tensors; our code) uses it.
# Keyed, as _MODULES and _UNUSED, by warm profile (shared.job.warm_profile: the format).
_UNLOADED: dict[str, tuple[str, ...]] = {"compressed-tensors": ("datasets",)}


def hide_unused(profile: str) -> None:
    """Mark the libraries a worker of warm profile `profile` never uses as absent in this process, and serve the
    ones it never uses but must import (_UNLOADED) as placeholders, before anything imports transformers.

    `sys.modules[name] = None` is Python's own "not installed" marker: importlib.util.find_spec then answers None
    (so transformers' is_torchao_available() is False and its torchao quantizer imports nothing) and an import
    raises ModuleNotFoundError. Once transformers is imported its availability answers are cached, so a process
    that imported it already is left alone. It also lets transformers' import read its model files once instead of
    twice (_WholeScanCache; every profile)."""
    import sys

    if "transformers" in sys.modules:
        return
    for name in _UNUSED.get(profile, ()):
        sys.modules.setdefault(name, None)
    for name in _UNLOADED.get(profile, ()):
        if name not in sys.modules and not any(isinstance(f, _Unloaded) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _Unloaded(name))
    if not any(isinstance(f, _WholeScanCache) for f in sys.meta_path):
        sys.meta_path.insert(0, _WholeScanCache())


class _WholeScanCache(importlib.abc.MetaPathFinder):
    """Lets transformers scan its `models` folder once per process instead of twice.

    transformers' package import builds its lazy import structure by reading every file under transformers/models
    (`import_utils.create_import_structure_from_path`, 2384 files and 42 MB of source in 5.17, one call per folder),
    and importing `transformers.models` (AutoConfig, any model class) asks for the same folders again. The answers
    are kept in an `lru_cache` of 128 entries, and the folders number ~520, so the second walk finds none of them
    and reads every file again: 0.19 s of the warm parent's ~3 s on the development VM (docs/performance.md). Here
    the same function is kept in a cache without a bound once that module is loaded: the same answers (a function
    of the files), each folder read once. Where the function is missing or not an lru_cache (another transformers
    version), nothing changes."""

    NAME = "transformers.utils.import_utils"

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.NAME:
            return None
        import sys

        sys.meta_path.remove(self)  # once: this module is loaded once per process
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # not a plain source module: leave it to the usual import
        load = loader.exec_module

        def exec_module(module) -> None:
            load(module)
            scan = getattr(module, "create_import_structure_from_path", None)
            info = getattr(scan, "cache_info", None)
            if getattr(scan, "__wrapped__", None) is not None and info is not None and info().maxsize is not None:
                # the recursion and define_import_structure look the name up in the module: both get this one
                module.create_import_structure_from_path = functools.lru_cache(maxsize=None)(scan.__wrapped__)

        loader.exec_module = exec_module  # this module's own loader object only
        return spec


class _UnloadedType(type):
    """The class of every name in an _Unloaded module: a class, so annotations, unions, isinstance checks and
    subclasses work; using one (calling it, reading an attribute it lacks) raises, naming the library."""

    def _why(cls, what: str) -> str:
        return (f"{what}: this worker's warm parent does not load {cls.__module__.split('.')[0]!r} (no export "
                "worker uses it; child/imports.py _UNLOADED)")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(cls._why(f"{cls.__module__}.{cls.__qualname__}(...)"))

    def __getattr__(cls, attr: str):
        raise AttributeError(cls._why(f"{cls.__module__}.{cls.__qualname__}.{attr}"))


class _UnloadedModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # Python's own probes (__file__, __version__, ...): absent, as for a bare module
            raise AttributeError(attr)
        placeholder = _UnloadedType(attr, (), {"__module__": self.__name__, "__qualname__": attr})
        setattr(self, attr, placeholder)  # the same class on every import
        return placeholder


class _Unloaded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import finder that answers `name` and its submodules with placeholder modules (_UnloadedModule)."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _UnloadedModule(spec.name)

    def exec_module(self, module) -> None:
        pass


def allow(name: str) -> None:
    """Undo hide_unused for `name` in this process, before a module that needs it imports it (it is then imported
    as usual; transformers' own availability answer, cached already, stays False, and nothing here asks it)."""
    import sys

    if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]


def preload(profile: str) -> None:
    """Import what a worker of warm profile `profile` (shared.job.warm_profile) will need and run its warm-up
    (_WARM_UP), never touching CUDA, so forked workers start warm."""
    hide_unused(profile)
    import child.sources.checkpoint  # noqa: F401 - safetensors
    import child.writer  # noqa: F401 - torch, safetensors

    for name in _MODULES.get(profile, ()):
        importlib.import_module(name)
    for name in _WARM_UP.get(profile, ()):
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()
