"""Tiny checkpoints of every MoE family and of layouts other than `*.layers.N`, and their upstream references.

Owns: building tiny random bf16 checkpoints of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS and GLM-4.5
(Glm4Moe), of Falcon / GPT-2 / BLOOM / GPT-J (layers under `transformer.h.N`), and of an architecture transformers
does not know; the name mapping between oneshot's output and the checkpoint's own names; llm-compressor's `model_free_ptq`
as the reference for the name-only path. Like tests/models.py it never imports `supervisor` or `child`.

Sizes: every Linear's input width is a multiple of 128 (W4A16's group), e.g. hidden 128, `moe_intermediate_size`
128, `q_lora_rank` / `kv_lora_rank` 128, heads * head_dim 128. Parameters that real checkpoints keep in float32
(`_keep_in_fp32_modules_strict`, e.g. DeepSeek's router `e_score_correction_bias`) are saved in float32, as a
checkpoint loaded with dtype="auto" and saved again holds them; oneshot writes them in float32 too.
"""
from __future__ import annotations

import json
import os
import re

import torch

from tests.models import VOCAB, _save_tokenizer

FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "deepseekv3", "gptoss", "glm4moe")
NAMED = ("falcon", "gpt2", "bloom", "gptj")
UNKNOWN = "unknown"

_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
               max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=3, eos_token_id=2, pad_token_id=1)


def family_config(kind: str, layers: int = 2, experts: int = 4):
    import transformers as tf

    c = dict(_COMMON, num_hidden_layers=layers)
    if kind == "mixtral":
        return tf.MixtralConfig(**c, intermediate_size=128, num_local_experts=experts, num_experts_per_tok=2)
    if kind == "qwen2moe":
        return tf.Qwen2MoeConfig(**c, intermediate_size=256, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=256, num_experts=experts, num_experts_per_tok=2,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "qwen3moe":
        return tf.Qwen3MoeConfig(**c, intermediate_size=256, head_dim=32, num_experts=experts, num_experts_per_tok=2,
                                 moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "deepseekv3":
        # MLA: q_lora_rank / kv_lora_rank are the input widths of q_b_proj / kv_b_proj; one dense first layer;
        # the default rope scaling (yarn, factor 40 over 4096 positions) does not fit 256 positions
        c.update(num_key_value_heads=4)
        return tf.DeepseekV3Config(**c, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=experts,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32,
                                   qk_nope_head_dim=32, v_head_dim=32,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "gptoss":
        # bf16 (not MXFP4): experts stored fused on disk as [experts, hidden, 2 * intermediate], attention sinks
        return tf.GptOssConfig(**c, intermediate_size=128, num_local_experts=experts, num_experts_per_tok=2,
                               head_dim=32, sliding_window=64,
                               layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
    if kind == "glm4moe":
        return tf.Glm4MoeConfig(**c, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=experts,
                                n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                first_k_dense_replace=1, head_dim=32)
    if kind == "falcon":
        return tf.FalconConfig(hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=VOCAB,
                               bos_token_id=3, eos_token_id=2, pad_token_id=1, tie_word_embeddings=False)
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=128, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=256,
                             bos_token_id=3, eos_token_id=2, pad_token_id=1, tie_word_embeddings=False)
    if kind == "bloom":
        return tf.BloomConfig(hidden_size=128, n_layer=layers, n_head=4, vocab_size=VOCAB, bos_token_id=3,
                              eos_token_id=2, pad_token_id=1, tie_word_embeddings=False)
    if kind == "gptj":
        return tf.GPTJConfig(n_embd=128, n_layer=layers, n_head=4, rotary_dim=16, vocab_size=VOCAB, n_positions=256,
                             bos_token_id=3, eos_token_id=2, pad_token_id=1, tie_word_embeddings=False)
    raise ValueError(f"unknown kind {kind!r}; expected one of {FAMILIES + NAMED}")


def make_family_model(kind: str, path: str, *, layers: int = 2, experts: int = 4, seed: int = 0) -> str:
    """Write a tiny random bf16 checkpoint of `kind` (safetensors, config, tokenizer) to `path`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = family_config(kind, layers, experts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                # norms, biases, sinks and router biases start at constants: perturb them so a pass-through bug
                # cannot look correct
                if t.is_floating_point() and t.ndim == 1 or "norm" in name:
                    t.add_(torch.randn_like(t) * 0.1)
        for name, module in model.named_modules():
            for store in (module._parameters, module._buffers):
                for pname, t in store.items():
                    if t is not None and any(k in f"{name}.{pname}" for k in keep_fp32):
                        store[pname] = type(t)(t.float()) if isinstance(t, torch.nn.Parameter) else t.float()
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=3, eos_token_id=2, pad_token_id=1).save_pretrained(path)
    _save_tokenizer(path)
    return path


def make_unknown_model(path: str, *, layers: int = 2, seed: int = 0) -> str:
    """A checkpoint transformers does not know: Llama weights renamed `backbone.blocks.N.*`, model_type "mystery".

    Written without torch's help for the config (so no class exists); tensors are bf16 like a real checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**dict(_COMMON, num_hidden_layers=layers), intermediate_size=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tensors = {re.sub(r"^model\.layers\.", "backbone.blocks.", k).replace("model.", "backbone."): v.contiguous()
               for k, v in model.state_dict().items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "mystery", "architectures": ["MysteryForCausalLM"], "num_hidden_layers": layers,
                   "hidden_size": 128, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}, f, indent=2)
    _save_tokenizer(path)
    return path


_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def to_checkpoint_names(kind: str, tensors: dict) -> dict:
    """oneshot's output names -> the checkpoint's own names (oneshot writes Mixtral's w1/w3/w2 as gate/up/down_proj)."""
    if kind != "mixtral":
        return dict(tensors)
    rx = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
    return {rx.sub(lambda m: f".experts.{m.group(1)}.{_MIXTRAL[m.group(2)]}.", k): v for k, v in tensors.items()}


def model_free_reference(model_dir: str, scheme: str, ignore: list[str], out_dir: str) -> str:
    """llm-compressor's `model_free_ptq` on model_dir (CPU, one worker): the reference for name-only exports."""
    from llmcompressor import model_free_ptq

    model_free_ptq(model_stub=model_dir, save_directory=out_dir, scheme=scheme, ignore=list(ignore), max_workers=1,
                   device="cpu")
    return out_dir


def oneshot_model(model_dir: str, scheme: str, ignore: list[str]):
    """oneshot's in-memory quantized model (not saved): the forward that an export's loaded model must match."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore)))
    return model.eval()


def loading_info(folder: str, **kwargs) -> tuple:
    """(model, {missing, unexpected, mismatched}) from transformers' real loader (weights read, dequantized)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True, **kwargs)
    return model.eval(), {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys")} | {
        "mismatched_keys": sorted(k for k, *_ in info["mismatched_keys"])}
