"""Reference for the per-module quantization error: llm-compressor's whole-model `oneshot` plus compressed-tensors'
fake-quantize, with none of our code.

After a data-free `oneshot` each targeted module still holds its source weight next to the scale (and zero
point, global scale) oneshot computed. compressed-tensors' public `quantize` (to the stored dtype, as its
compressors call it) then `dequantize` give the weight a loader reconstructs from the checkpoint. The reference
error of a module is ||dequantize(quantize(W)) - W_source|| / ||W_source||, W_source read from the checkpoint.
It never imports `supervisor` or `child`.
"""
from __future__ import annotations

import torch

from tests.models import load_tensors


def oneshot_errors(model_dir: str, scheme: str, ignore: list[str], device: str = "cpu") -> dict[str, float]:
    """module name -> reference relative error, for every module oneshot quantizes in the model at model_dir.

    `device` is where the model is loaded, quantized and the error computed, which must be where the export
    quantized: on cuda, compressed-tensors' `quantize` runs a Triton kernel that divides by the scale in float32,
    while its torch path (the CPU's) divides in the weight's bf16, so FP8 and INT4 values can differ by one step
    between the two (measured on an H200: a q_proj's FP8 error 0.025797 exported on cuda against 0.025956 on the
    CPU). Its `fake_quantize` always takes the torch path (it has no Triton kernel), so it cannot be the reference
    on cuda."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    source = load_tensors(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", device_map=device)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore)))
    out = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or qscheme.weights is None:
                continue
            args = qscheme.weights
            ref = source[f"{name}.weight"].float()
            assert torch.equal(module.weight.float().cpu(), ref)  # oneshot left the source weight in place
            qparams = {k: getattr(module, f"weight_{k}", None) for k in ("scale", "zero_point", "global_scale")}
            # the dtype each compressor quantizes to: FP8 and INT to args.pytorch_dtype(); FP4 (NVFP4) to the
            # weight's own dtype, packed afterwards
            fp4 = args.type == "float" and args.num_bits == 4
            q = quantize(x=module.weight, args=args, dtype=None if fp4 else args.pytorch_dtype(), **qparams)
            dq = dequantize(x_q=q, args=args, dtype=q.dtype if fp4 else None, **qparams).float().cpu()
            out[name] = ((dq - ref).norm() / ref.norm()).item()
    return out
