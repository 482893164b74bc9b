"""Would transformers load this checkpoint, every weight where it belongs? Its own loader, on the meta device.

    config.json + {name: (dtype, shape)} from safetensors headers (or predicted by the backend on meta tensors)
      ─▶ meta tensors ─▶ <ModelClass>.from_pretrained(None, config=…, state_dict=…, device_map="meta",
                                                      output_loading_info=True)
      ─▶ LoadReport(missing, unexpected, mismatched, error) + the known reason, when one applies

transformers' loader renames keys, runs its converters (the compressed-tensors expert decompression included) and
reports what it could not place. A missing or unexpected weight means a silently wrong model: transformers
initialises a missing weight at random and drops an unexpected one without an error (measured on 5.17: oneshot's
Mixtral and GPT-OSS outputs load "fine" with every expert random). Running it on meta tensors reads no weight, so
the check costs a meta model build however large the checkpoint is.

Used three ways: by the child before an export starts (on the backend's predicted output), at the end of every
export (on the files written: answered by the prediction's verdict when they have its key, see check()), and by
`supervisor verify` (`python -m child.loadcheck OUT --json`: always the loader itself).
Owns the check and its explanations; it never writes a file.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys

from safetensors import safe_open

from child import bytecode
from shared.layout import SAFETENSORS_DTYPES
from shared.load_verdict import problems
from shared.messages import LoadReport

def header_tensors(folder: str) -> dict[str, tuple[str, list[int]]]:
    """{name: (safetensors dtype, shape)} of every tensor in folder/*.safetensors, from the headers alone."""
    out = {}
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, fn), "pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                out[name] = (part.get_dtype(), list(part.get_shape()))
    return out


def check_folder(folder: str, trust_remote_code: bool = False, known: LoadReport | None = None) -> LoadReport:
    """The loader's verdict on an export folder (config.json + safetensors), without reading a weight; `known`:
    see check()."""
    import torch

    tensors = {}
    for name, (dtype, shape) in header_tensors(folder).items():
        if dtype not in SAFETENSORS_DTYPES:
            return LoadReport(checked=False, reason=f"tensor {name} has dtype {dtype}, unknown to the loader check")
        tensors[name] = torch.empty(shape, dtype=getattr(torch, SAFETENSORS_DTYPES[dtype]), device="meta")
    return check(folder, tensors, trust_remote_code, known)


def verdict_key(config_dir: str, tensors: dict, trust_remote_code: bool = False) -> str:
    """What a verdict depends on: config.json's bytes and every tensor's name, dtype and shape (the loader is
    deterministic in them); "" when that is not all (remote code reads other files) or there is no config.json."""
    if trust_remote_code:
        return ""
    try:
        with open(os.path.join(config_dir, "config.json"), "rb") as f:
            config = f.read()
    except OSError:
        return ""
    specs = repr(sorted((k, str(t.dtype), tuple(t.shape)) for k, t in tensors.items()))
    return hashlib.sha256(config + b"\0" + specs.encode()).hexdigest()


def check(config_dir: str, tensors: dict, trust_remote_code: bool = False,
          known: LoadReport | None = None) -> LoadReport:
    """The loader's verdict on `tensors` ({name: meta tensor}) with the config.json in `config_dir`. `known`: a
    verdict given earlier (the prediction's, checked before the export's first part); it is the answer, without
    building the model again, when its key is these files' (0.1 s for 8 layers on the VM, 1 s for the 8B shape)."""
    key = verdict_key(config_dir, tensors, trust_remote_code)
    if key and known is not None and known.key == key:
        return known
    report = _check(config_dir, tensors, trust_remote_code)
    report.key = key
    return report


def _check(config_dir: str, tensors: dict, trust_remote_code: bool) -> LoadReport:
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        return LoadReport(checked=False, reason=f"transformers cannot build this architecture ({type(exc).__name__} "
                                                "reading config.json)")
    cls = _causal_lm_class(config, config_dir, trust_remote_code)
    if cls is None:
        return LoadReport(checked=False, reason=f"transformers has no causal-LM class for {type(config).__name__}")
    report = _Captured()  # its load report (logged as a warning) goes to our LoadReport instead of stderr
    transformers.logging.disable_progress_bar()
    try:
        with report:
            _, info = cls.from_pretrained(None, config=config, state_dict=tensors, device_map="meta",
                                          ignore_mismatched_sizes=True, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - a loader that raises is a verdict too ("would not load")
        return LoadReport(checked=True, error=_one_line(exc) + report.conversion_lines())
    finally:
        transformers.logging.enable_progress_bar()
    return LoadReport(checked=True, missing=sorted(info["missing_keys"]), unexpected=sorted(info["unexpected_keys"]),
                      mismatched=sorted(f"{k} {tuple(a)} vs {tuple(b)}" for k, a, b in info["mismatched_keys"]))


class _Captured(logging.Handler):
    """Collects transformers' loading report while the check runs, and keeps it off the console."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.text: list[str] = []
        self._logger = logging.getLogger("transformers")

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())

    def __enter__(self):
        self._propagate, self._handlers = self._logger.propagate, list(self._logger.handlers)
        self._logger.handlers, self._logger.propagate = [self], False
        return self

    def __exit__(self, *exc) -> None:
        self._logger.handlers, self._logger.propagate = self._handlers, self._propagate

    def conversion_lines(self) -> str:
        """The report's CONVERSION entries (which weights a converter could not build), joined on one line."""
        lines = [" ".join(line.split()) for text in self.text for line in text.splitlines() if "CONVERSION" in line
                 or "conversion" in line.lower() and "|" in line]
        return (": " + "; ".join(lines[:4]))[:600] if lines else ""


def _causal_lm_class(config, config_dir: str, trust_remote_code: bool):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], config_dir)
    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m child.loadcheck",
                                 description="check that transformers loads every weight of an export (meta device)")
    ap.add_argument("folder")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    bytecode.cache_imports()  # before transformers' import (child/bytecode.py)
    report = check_folder(args.folder, args.trust_remote_code)
    if args.json:
        import msgspec

        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        print(problems(report) or ("ok" if report.checked else f"not checked: {report.reason}"))
    return 1 if problems(report) else 0


if __name__ == "__main__":
    sys.exit(main())
