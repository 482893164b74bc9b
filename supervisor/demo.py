"""`supervisor demo`: build a small Llama-shaped model locally, export it, and load the result with transformers.

No model hub is reachable on many machines, so the demo makes its own checkpoint (random bf16 weights, a
WordLevel tokenizer, a generation config) and a job.toml beside it, then runs the same `Supervisor` the `run`
command uses. Owns the demo only; torch and transformers are imported here lazily.
"""
from __future__ import annotations

import os
import sys

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
    vocab_map = {f"t{i}": i for i in range(vocab)}
    vocab_map["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="t1", eos_token="t2",
                            bos_token="t3").save_pretrained(path)
    return path


def check_output(source: str, output: str) -> str:
    """Load the export with transformers and compare its logits with the bf16 source's."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)(ids).logits.float()
        got = AutoModelForCausalLM.from_pretrained(output, dtype=torch.bfloat16)(ids).logits.float()
    rel = ((got - ref).norm() / ref.norm()).item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return f"transformers loaded {output}: logits rel. error vs bf16 source {rel:.4f}, top-1 agreement {top1:.0%}"


def run_demo(folder: str, scheme: str = "FP8_DYNAMIC", json_lines: bool = False) -> int:
    from supervisor.api import Supervisor, load_job
    from supervisor.progress import Display

    folder = os.path.abspath(folder)
    model = os.path.join(folder, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        print(f"building a small Llama-shaped model in {model}", file=sys.stderr)
        make_model(model)
    job_path = os.path.join(folder, f"job-{scheme.lower()}.toml")
    with open(job_path, "w") as f:
        f.write(JOB.format(scheme=scheme, slug=scheme.lower()))
    print(f"job file: {job_path}  (run it yourself with: supervisor run {job_path})", file=sys.stderr)
    run = Supervisor(load_job(job_path))
    display = Display(json_lines=json_lines, total_hint=run.plan.source.num_layers + 1)
    with run, display:
        for e in run.events():
            display.show(e)
    done = run.wait()
    print(f"exported {done.output}" + (" (already complete)" if done.already_complete else
                                         f" in {done.seconds:.1f}s"), file=sys.stderr)
    print(check_output(model, done.output), file=sys.stderr)
    return 0
