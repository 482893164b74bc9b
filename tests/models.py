"""Tiny checkpoints and the whole-model reference that tests compare against.

This module owns three things the test suites share: building tiny random-weight models on disk
(real safetensors, an offline tokenizer, a generation config), producing the llm-compressor
`oneshot` reference for a scheme, and comparing two tensor dicts exactly. It never imports
`supervisor` or `child`: the reference must come from the upstream tools alone, so a bug in our
code cannot hide in both sides of a comparison.

Sizes: hidden 128 and intermediate 2x hidden keep every in-feature count (hidden, heads*head_dim,
intermediate) a multiple of 128, so W4A16's group of 128 and NVFP4's group of 16 tile the weights.
hidden=64 does not work: llm-compressor's divisibility check only rejects in-features that are >= the
group size, so 64 columns pass it and oneshot itself then crashes in W4A16 (unflatten of 64 into groups
of 128, measured). FP8_BLOCK needs no divisibility (the k/v projections' 64 rows give a partial block,
which oneshot handles with a ceil-divided scale grid).
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Literal

import torch

Kind = Literal["llama", "qwen3", "qwen3moe"]

VOCAB = 256


def _config(kind: Kind, layers: int, hidden: int, tied: bool):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    heads = 4
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=3,
        eos_token_id=2,
        pad_token_id=1,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen3":
        # Qwen3's default head_dim is 128 regardless of hidden size
        return Qwen3Config(**common, head_dim=hidden // heads)
    if kind == "qwen3moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=hidden // heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; expected llama, qwen3 or qwen3moe")


def _save_tokenizer(path: str) -> None:
    # oneshot and the loaders want a processor beside the weights; this one needs no download
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # special tokens under names no word contains ("t1" would be matched inside "t105"), each id used once
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3} | {f"t{i}": i for i in range(4, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )
    fast.save_pretrained(path)


def make_tiny_model(
    kind: Kind, path: str, *, layers: int = 2, hidden: int = 128, seed: int = 0, tied: bool = False
) -> str:
    """Write a tiny random bf16 `kind` model (safetensors, config, tokenizer, generation config) to path.

    hidden must be a multiple of 128 for W4A16/NVFP4 (see the module docstring); tied=True ties lm_head to
    the input embeddings, so the checkpoint holds no lm_head tensor.
    """
    from transformers import GenerationConfig

    save_random_model(_config(kind, layers, hidden, tied), path, seed)
    GenerationConfig(bos_token_id=3, eos_token_id=2, pad_token_id=1).save_pretrained(path)
    return path


def save_random_model(config, path: str, seed: int = 0) -> None:
    """A random bf16 model of `config` (norms perturbed) saved to path with the tiny tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        # norms start at exactly 1.0; perturb them so a pass-through bug cannot look correct
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    _save_tokenizer(path)


def oneshot_reference(model_dir: str, scheme: str, ignore: list[str], out_dir: str) -> str:
    """Quantize model_dir with llm-compressor oneshot (data-free) and save it compressed to out_dir."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore))
    oneshot(model=model, recipe=recipe)
    with warnings.catch_warnings():
        # oneshot's save wraps the model as accelerate-offloaded on CPU; transformers warns about that
        warnings.filterwarnings("ignore", message="Attempting to save a model with offloaded modules")
        model.save_pretrained(out_dir, save_compressed=True)
    return out_dir


def load_tensors(directory: str, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor in directory/*.safetensors (optionally only names starting with prefix)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for fn in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(fn, "pt") as f:
            for k in f.keys():
                if prefix is None or k.startswith(prefix):
                    out[k] = f.get_tensor(k)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    # torch.equal has no fp8 kernels on CPU, and comparing bits also tells -0.0 from 0.0 and NaNs apart
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def _describe(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.is_floating_point():
        diff = (a.float() - b.float()).abs()
        return f"values differ: {int((diff > 0).sum())} of {a.numel()} elements, max abs diff {diff.max().item():.4g}"
    neq = (a.to(torch.int64) != b.to(torch.int64)).sum().item()
    return f"values differ: {neq} of {a.numel()} elements"


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Assert a and b hold the same names with the same dtypes, shapes and bits; say what differs."""
    problems = []
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a:
        problems.append(f"only in first ({len(only_a)}): {only_a[:8]}")
    if only_b:
        problems.append(f"only in second ({len(only_b)}): {only_b[:8]}")
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            problems.append(f"{name}: {ta.dtype}{tuple(ta.shape)} vs {tb.dtype}{tuple(tb.shape)}")
        elif not torch.equal(_bits(ta.cpu()), _bits(tb.cpu())):
            problems.append(f"{name}: {_describe(ta.cpu(), tb.cpu())}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(f"{len(problems)} tensor mismatches:\n  {shown}{more}")


def loaded_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    """The logits for ids of the model in folder, loaded by transformers as a user would (bf16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        return model(ids).logits


def assert_errors_equal_loading(errors: dict[str, float], source: str, export: str) -> None:
    """Each recorded quantization error (module -> figure) equals ||W_loaded - W_source|| / ||W_source||, W_loaded
    from transformers' from_pretrained of the export (compressed-tensors decompressing the shards as any user's load
    does), W_source from its load of the source checkpoint."""
    import pytest
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    dense = CompressedTensorsConfig(run_compressed=False)  # decompress on load, as a CPU user's load does
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16, quantization_config=dense).state_dict()
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).state_dict()
    for name, err in errors.items():
        w, w0 = loaded[f"{name}.weight"].float(), ref[f"{name}.weight"].float()
        assert not torch.equal(w, w0), name  # really the dequantized weight, not the source
        expected = ((w - w0).norm() / w0.norm()).item()
        assert err == pytest.approx(expected, rel=1e-5), name
