"""Run INSIDE .venv-vllm (vLLM's CPU build): greedy generation from several checkpoint folders in one process.

    .venv-vllm/bin/python -P supervisor/commands/vllm_generate.py REQUEST.json RESULT.json

REQUEST: {"folders": [path, ...], "prompts": [[token id, ...], ...], "max_tokens": N}
RESULT:  {path: {"ids": [[generated id, ...] per prompt]} or {"error": "one line: why vLLM refused or failed"}}

Each folder is loaded with `LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16")` and
the prompts are given as token ids (the tiny test models' tokenizers are word-level; no tokenizer is needed).
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): one import of vLLM for all folders, and a
refusal raises here instead of killing a spawned engine. Between folders the LLM is deleted and vLLM's distributed
state torn down, so the next folder starts clean. Imports nothing of this repository (its venv has none of it), so
it is run as a file (`-P`: its folder, which holds this package's modules, stays off sys.path); its users are
`supervisor verify --vllm` (supervisor/commands/vllm_check.py) and tests/clients/test_vllm.py.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback


def _one_line(exc: BaseException) -> str:
    """The innermost cause's type and message, on one line."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:600]


def generate(folders: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results: dict[str, dict] = {}
    for folder in folders:
        llm = None
        try:
            llm = LLM(model=folder, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                      max_model_len=128, max_num_seqs=len(prompts), seed=0)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results[folder] = {"ids": [list(o.outputs[0].token_ids) for o in outs]}
        except Exception as exc:  # a refusal is a result: the test compares it with what it expects
            traceback.print_exc(file=sys.stderr)
            results[folder] = {"error": _one_line(exc)}
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
        print(f"vllm_generate: {folder}: {'error' if 'error' in results[folder] else 'ok'}", file=sys.stderr,
              flush=True)
    return results


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    results = generate(request["folders"], request["prompts"], int(request["max_tokens"]))
    with open(result_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main(sys.argv[1:]))
