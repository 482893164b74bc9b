"""`supervisor demo`: build a small Llama-shaped model locally, export it, and load the result with transformers.

No model hub is reachable on many machines, so the demo makes its own checkpoint (random bf16 weights, a
WordLevel tokenizer, a generation config) and a job.toml beside it, then runs the same `Supervisor` the `run`
command uses. The build and the load-back check run in helper processes (`python -P -m supervisor.commands.demo
build|check`, through supervisor.commands.liblog) whose library output goes to a log: DIR/build-model.log and
OUT/.export/logs/load-back.log; the demo itself prints only our lines (--debug echoes the logs).
Owns the demo only; torch and transformers are imported only inside `make_model` and `check_output`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from shared import layout
from supervisor.commands import liblog
from supervisor.errors import SupervisorError

JOB = """\
[source]
path = "model"

[export]
scheme = "{scheme}"
output = "export-{slug}"

[resources]
device = "auto"
"""


def make_model(path: str, layers: int = 8, hidden: int = 256, vocab: int = 512, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=3, eos_token_id=2, pad_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=3, eos_token_id=2, pad_token_id=1).save_pretrained(path)
    # special tokens under names no word contains ("t1" would be matched inside "t105"), each id used once
    vocab_map = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3} | {f"t{i}": i for i in range(4, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
                            bos_token="<s>").save_pretrained(path)
    return path


def check_output(source: str, output: str) -> dict:
    """Load the export with transformers and compare its logits with the bf16 source's."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)(ids).logits.float()
        got = AutoModelForCausalLM.from_pretrained(output, dtype=torch.bfloat16)(ids).logits.float()
    return {"rel_error": ((got - ref).norm() / ref.norm()).item(),
            "top1": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def _helper(step: str, paths: list[str], log: str) -> dict:
    """Run one step in a helper process (its library output into `log`); its JSON result."""
    code, result = liblog.run_logged(["supervisor.commands.demo", step, *paths], log)
    if code != 0:
        raise SupervisorError(f"the demo's {step} step failed (exit code {code}); its output is in {log}")
    return json.loads(result)


def run_demo(folder: str, scheme: str = "FP8_DYNAMIC", json_lines: bool = False, debug: bool = False) -> int:
    from supervisor.api import Supervisor, load_job
    from supervisor.commands.progress import Display

    folder = os.path.abspath(folder)
    model = os.path.join(folder, "model")
    os.makedirs(folder, exist_ok=True)
    job_path = os.path.join(folder, f"job-{scheme.lower()}.toml")
    with open(job_path, "w") as f:
        f.write(JOB.format(scheme=scheme, slug=scheme.lower()))
    job = load_job(job_path)
    logs = layout.state_path(job.export.output, layout.LOGS)
    build_log = os.path.join(folder, "build-model.log")
    with liblog.Echo([folder, logs], enabled=debug):
        if not os.path.exists(os.path.join(model, "config.json")):
            print(f"building a small Llama-shaped model in {model} (library output: {build_log})", file=sys.stderr)
            _helper("build", [model], build_log)
        print(f"job file: {job_path}  (run it yourself with: supervisor run {job_path})", file=sys.stderr)
        run = Supervisor(job, warm_now=True)
        display = Display(json_lines=json_lines, total_hint=run.plan.source.num_layers + 1)
        with run, display:
            for e in run.events():
                display.show(e)
        done = run.wait()  # bounded: events() returned, so the run has ended
        print(f"exported {done.output}" + (" (already complete)" if done.already_complete else
                                             f" in {done.seconds:.1f}s"), file=sys.stderr)
        check_log = os.path.join(logs, "load-back.log")
        r = _helper("check", [model, done.output], check_log)
    print(f"transformers loaded {done.output}: logits rel. error vs bf16 source {r['rel_error']:.4f}, "
          f"top-1 agreement {r['top1']:.0%} (library output: {check_log})", file=sys.stderr)
    return 0


def _main(argv: list[str] | None = None) -> int:
    """The helper process: `python -P -m supervisor.commands.demo build MODEL | check MODEL OUTPUT --result-fd N`."""
    ap = argparse.ArgumentParser(prog="python -m supervisor.commands.demo")
    ap.add_argument("step", choices=["build", "check"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--result-fd", type=int, required=True)
    args = ap.parse_args(argv)
    result = check_output(*args.paths) if args.step == "check" else {"model": make_model(*args.paths)}
    with os.fdopen(args.result_fd, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
