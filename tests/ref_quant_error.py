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

    `device` is where the fake-quantize runs, which must be where the export quantized: on cuda, compressed-tensors
    quantizes with its Triton kernel, which divides by the scale in float32, while its torch path (the CPU's)
    divides in the weight's bf16 first, so FP8 and INT4 values can differ by one step between the two (measured on
    an H200: a q_proj's FP8 error 0.025797 on cuda against 0.025956 on the CPU)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    source = load_tensors(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore)))
    out = {}

    def on_device(name: str, module: torch.nn.Module):
        tensor = getattr(module, name, None)
        return None if tensor is None else tensor.detach().to(device)

    with torch.no_grad():
        for name, module in model.named_modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or qscheme.weights is None:
                continue
            ref = source[f"{name}.weight"].float()
            assert torch.equal(module.weight.float().cpu(), ref)  # oneshot left the source weight in place
            # forward_quantize's arithmetic for a static weight, with every tensor on `device`
            dq = fake_quantize(x=on_device("weight", module), scale=on_device("weight_scale", module),
                               zero_point=on_device("weight_zero_point", module), args=qscheme.weights,
                               global_scale=on_device("weight_global_scale", module)).float().cpu()
            out[name] = ((dq - ref).norm() / ref.norm()).item()
    return out
