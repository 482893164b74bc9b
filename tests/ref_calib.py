"""Calibration datasets for tests, and llm-compressor's whole-model `oneshot` with calibration data: the reference.

`oneshot_calibrated` runs exactly the recipe the issue names (GPTQModifier | [AWQModifier, QuantizationModifier] |
QuantizationModifier, targets Linear, the exporter's default ignore) on the same samples, in the test process, with
torch's thread count pinned (GPTQ's arithmetic depends on it), and saves the compressed result. It never imports
`supervisor` or `child`: the reference must come from the upstream tools alone.

`traced_masks` works around an llm-compressor 0.14.0.1 tracer bug for models whose forward calls the mask function
through a variable (`mask_function = create_causal_mask if ...`: Qwen3-MoE, Mistral, Mixtral, Phi-3, ...): the
sequential pipeline's tracer then passes the mask function a config rebuilt from `to_dict()`, which loses
`_attn_implementation`, so the mask comes out None and the eager attention it forces runs without a causal mask.
Wrapping the mask function under another name makes the tracer trace through it with the live config, and the
layers get the causal mask the model's own forward gives them (docs/fidelity.md has the measured difference).
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings

import torch

from shared.job import DEFAULT_IGNORE


def make_tiny_gemma(path: str, *, seed: int = 0) -> str:
    """A tiny random Gemma (offset norms: "(1 + weight)", which llm-compressor converts for calibration)."""
    from transformers import GemmaConfig

    from tests.models import save_random_model

    cfg = GemmaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                      bos_token_id=3, eos_token_id=2, pad_token_id=1)
    save_random_model(cfg, path, seed)
    return path


# Dense architectures beside Llama/Qwen3 whose layers differ in what the calibration has to get right: fused projections
# (Phi-3's qkv_proj/gate_up_proj, GPT-NeoX's query_key_value), biases (Qwen2, Starcoder2), LayerNorm and parallel
# attention/MLP blocks (Cohere, GPT-NeoX), offset norms with sliding windows and soft-capping (Gemma-2), q/k norms over
# the whole projection and post-norms (OLMo-2), the causal mask through a variable (Mistral, Phi-3, Starcoder2)
DENSE = ("phi3", "qwen2", "mistral", "gemma2", "cohere", "starcoder2", "gptneox", "olmo2")


def make_tiny_dense(kind: str, path: str, *, layers: int = 2, seed: int = 0) -> str:
    """A tiny random bf16 checkpoint of one of DENSE, or of Phi (hidden 128, 4 heads, 2 KV heads, intermediate 256)."""
    import transformers as tf

    from tests.models import save_random_model

    c = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, bos_token_id=3, eos_token_id=2,
             pad_token_id=1, tie_word_embeddings=False)
    configs = {
        "phi3": lambda: tf.Phi3Config(**c),
        "qwen2": lambda: tf.Qwen2Config(**c),
        "mistral": lambda: tf.MistralConfig(**c, head_dim=32),
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=32, sliding_window=16),
        "cohere": lambda: tf.CohereConfig(**c),
        "starcoder2": lambda: tf.Starcoder2Config(**c),
        "gptneox": lambda: tf.GPTNeoXConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"}),
        "olmo2": lambda: tf.Olmo2Config(**c),
        "phi": lambda: tf.PhiConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"}),  # AWQ refuses it
    }
    save_random_model(configs[kind](), path, seed)
    return path


def token_rows(n: int, *, low: int = 24, high: int = 64, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """n random token-id rows of mixed lengths in [low, high), with several equal lengths (the unstable sort)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 48 if i % 3 == 0 else int(torch.randint(low, high, (1,), generator=g))
        rows.append(torch.randint(4, vocab, (length,), generator=g).tolist())
    return rows


def text_rows(n: int, *, seed: int = 1) -> list[str]:
    """n texts of mixed lengths in the tiny models' word-level vocabulary ("t47 t83 ..."), some too long.

    Only the words t40..t99, each one token. (The tiny tokenizer once had special tokens t1/t2/t3, matched inside
    words such as "t105", and an "<unk>" that shared id 0 with "t0", so a word needing the unknown token failed at
    random; tests/models.py now names them <pad>, </s>, <s>, but these texts stay safe either way.)"""
    return [" ".join(f"t{40 + i % 60}" for i in row) for row in token_rows(n, low=20, high=80, seed=seed)]


def write_jsonl(path, samples: list) -> str:
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"text": s} if isinstance(s, str) else {"input_ids": s}) + "\n")
    return str(path)


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def traced_masks(model):
    """See the module docstring: the causal mask reaches the layers in the sequential pipeline."""
    module = sys.modules[type(model).__module__]
    originals = {name: getattr(module, name) for name in ("create_causal_mask", "create_sliding_window_causal_mask")
                 if hasattr(module, name)}

    def wrap(fn):
        def mask_traced_through(*args, **kwargs):  # a name the tracer's ignore list does not hold
            return fn(*args, **kwargs)
        return mask_traced_through

    try:
        for name, fn in originals.items():
            setattr(module, name, wrap(fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def _cpu_awq():
    # llm-compressor 0.14.0.1's AWQ pins cached activations, which fails without an accelerator; pinning never
    # changes a value, so on CPU the reference skips it (as the exporter does).
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    saved = IntermediatesCache.__dict__["_pin_intermediate"]
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, value: None)
    try:
        yield
    finally:
        IntermediatesCache._pin_intermediate = saved


def oneshot_calibrated(model_dir: str, scheme: str, method: str, samples: list, seq_len: int, out_dir: str, *,
                       num_threads: int = 1, fix_masks: bool = False) -> str:
    """oneshot on `samples` (token-id rows or texts, all of them, in file order) and save it compressed."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ignore = list(DEFAULT_IGNORE)
    if method == "gptq":
        recipe = GPTQModifier(targets="Linear", scheme=scheme, ignore=ignore)
    elif method == "awq":
        recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)]
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    if all(isinstance(s, str) for s in samples):
        data = {"text": list(samples)}  # oneshot tokenizes them itself
    else:
        data = {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
    # the model on CPU as oneshot users load it; the sequential pipeline onloads each layer to the GPU if any
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with contextlib.ExitStack() as stack:
        stack.enter_context(threads(num_threads))
        stack.enter_context(_cpu_awq())
        if fix_masks:
            stack.enter_context(traced_masks(model.base_model))
        oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), dataset=Dataset.from_dict(data),
                recipe=recipe, num_calibration_samples=len(samples), max_seq_length=seq_len,
                shuffle_calibration_samples=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        model.save_pretrained(out_dir, save_compressed=True)
    return out_dir
