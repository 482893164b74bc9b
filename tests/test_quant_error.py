"""child/backends/quant_error.py: the error the layer quantizer records per module equals an independent computation.

Ours: the compressed-tensors backend quantizes one layer at a time and decompresses what it will write.
Reference (tests/ref_quant_error.py): whole-model oneshot, then compressed-tensors' fake-quantize with oneshot's
qparams. Cases cover a block scheme with partial blocks (FP8_BLOCK), a global scale shared by fused modules
(NVFP4A16), asymmetric packed int4 on MoE experts (W4A16_ASYM), and a quantized lm_head in the non-layer part.
"""
import pytest
import torch

from tests.models import load_tensors
from tests.ref_quant_error import oneshot_errors

CASES = [("llama", "FP8_BLOCK", None), ("qwen3", "NVFP4A16", None), ("qwen3moe", "W4A16_ASYM", None),
         ("llama", "W8A16", [])]


@pytest.mark.parametrize("kind,scheme,ignore", CASES, ids=[f"{k}-{s}-{i}" for k, s, i in CASES])
def test_recorded_error_equals_oneshot_fake_quantize(tiny_models, kind, scheme, ignore):
    """Every quantized module of every part gets an error, equal to the reference to 1e-6 (relative; measured 4e-8)."""
    from child.backends import quant_error
    from child.backends.quantize import DEFAULT_IGNORE, LayerQuantizer

    ignore = DEFAULT_IGNORE if ignore is None else ignore
    path = tiny_models(kind)
    expected = oneshot_errors(path, scheme, ignore)
    quantizer = LayerQuantizer(path, scheme, ignore)
    tensors = load_tensors(path)
    got = {}
    quant_error.take()
    for i in range(quantizer.num_layers):
        quantizer.quantize_layer(i, {k: v for k, v in tensors.items() if k.startswith(f"model.layers.{i}.")})
        got.update(quant_error.take())
    quantizer.quantize_non_layer({k: v for k, v in tensors.items() if not k.startswith("model.layers.")})
    got.update(quant_error.take())
    assert expected and set(got) == set(expected)
    assert ("lm_head" in got) == (ignore == [])
    for name, err in expected.items():
        assert got[name] == pytest.approx(err, rel=1e-6), name
        assert 1e-4 < err < 0.5


class _Beat:
    def set(self, index, stage):
        pass


@pytest.mark.parametrize("measure", [True, False, None])
def test_worker_sends_the_errors_unless_the_job_turns_them_off(tiny_models, tmp_path, measure):
    """The child's LayerWritten carries every quantized module's error; [export] measure_error = false, or
    unset on a CPU worker: none."""
    from child.exporter import Exporter
    from shared.job import parse_job
    from shared.messages import PROTOCOL_VERSION, ExportLayer, Hello

    path = tiny_models("llama")
    job = parse_job({"source": {"path": path},
                     "export": {"scheme": "FP8_DYNAMIC", "output": str(tmp_path), "measure_error": measure}})
    (tmp_path / ".export" / "tmp").mkdir(parents=True)
    exporter = Exporter(Hello(version=PROTOCOL_VERSION, job=job, output=str(tmp_path), device="cpu"), _Beat())
    reply = exporter.export(ExportLayer(index=1), writer=None)  # (conftest puts quant_error.enabled back)
    names = {f"model.layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(reply.quant_error) == (names if measure else set())  # None on "cpu": off


def _by_hand(got: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The figure as a Python float sum: each 1024-row block's float32 norms, squared and added one block at a time."""
    diff = total = 0.0
    for g, r in zip(got.split(1024), ref.split(1024)):
        r = r.to(g.device).float()
        diff += torch.linalg.vector_norm(g.float() - r).item() ** 2
        total += torch.linalg.vector_norm(r).item() ** 2
    return (diff / total) ** 0.5 if total else None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("shape", [(5000, 300), (1024, 64), (3, 7), (0, 5)])
def test_the_error_summed_on_the_device_is_the_python_sum(shape, device):
    """relative_error adds the blocks' squared norms where they are (one wait for the device per module, not two per
    block): the very float the per-block Python sum gives, the source on the host as a calibrated export's is."""
    from child.backends.quant_error import relative_error

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(sum(shape))
    ref = torch.randn(shape, generator=g).to(torch.bfloat16)
    got = (ref.float() + 0.01 * torch.randn(shape, generator=g)).to(torch.bfloat16).to(device)
    assert relative_error(got, ref) == _by_hand(got, ref)
    assert (relative_error(got, ref) is None) == (ref.numel() == 0)
