"""Reference for the per-module quantization error: llm-compressor's whole-model `oneshot` plus compressed-tensors'
fake-quantize, with none of our code.

After a data-free `oneshot` each targeted module still holds its source weight next to the scale (and zero
point, global scale) oneshot computed; `forward_quantize` is the quantize-dequantize a quantized forward pass
runs. The reference error of a module is ||forward_quantize(W) - W_source|| / ||W_source||, W_source read from
the checkpoint. It never imports `supervisor` or `child`.
"""
from __future__ import annotations

import torch

from tests.models import load_tensors


def oneshot_errors(model_dir: str, scheme: str, ignore: list[str], device: str = "cpu") -> dict[str, float]:
    """module name -> reference relative error, for every module oneshot quantizes in the model at model_dir.

    `device` is where the model is loaded, so where oneshot computes its scales: a cuda export is compared with
    oneshot on cuda (measured on an H200: FP8 scales computed on the CPU differ enough to move an error by 0.6%)."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
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
            ref = source[f"{name}.weight"].float()
            assert torch.equal(module.weight.float().cpu(), ref)  # oneshot left the source weight in place
            dq = forward_quantize(module, module.weight, "weight", qscheme.weights).float().cpu()
            out[name] = ((dq - ref).norm() / ref.norm()).item()
    return out
