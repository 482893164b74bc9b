"""child/backends/eager_attention.py: eager attention with its scaling, mask and upcast fused gives transformers' eager
attention bit for bit, on the architectures it says yes to; it says no to the others; a difference turns it off.

On the CPU it is installed only through its test switch (it pays on a GPU only); tests/gpu/test_calibrated_gpu.py
runs AWQ on cuda, where it is on by default, against oneshot."""
import json

import pytest
import torch

from child import faults
from child.backends import eager_attention, rotary, warp_softmax
from tests.models import assert_same_tensors, load_tensors
from tests.ref_calib import make_tiny_dense, oneshot_calibrated, threads
from tests.test_calibrate import SEQ, _export_in_process, ids_dataset  # noqa: F401 - the fixture

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test starts with the fusion on and nothing compared (the module keeps its state per process)."""
    monkeypatch.setitem(eager_attention._state, "off", False)
    monkeypatch.setitem(eager_attention._state, "told", False)
    monkeypatch.setitem(warp_softmax._state, "error", None)
    monkeypatch.setitem(eager_attention._state, "rotary told", False)
    monkeypatch.setitem(rotary._state, "error", None)
    eager_attention._checked.clear()
    eager_attention._lengths.clear()
    yield
    eager_attention._checked.clear()


def _skeleton(kind: str, attn: str = "eager", **overrides):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**small, **overrides}),
                                                attn_implementation=attn)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "mixtral", "phi3", "deepseek_v3"])
def test_it_applies_where_the_eager_attention_is_llamas(kind):
    assert eager_attention.applies(_skeleton(kind), CUDA) is None


@pytest.mark.parametrize("kind,rotary_is_llamas", [("llama", True), ("qwen3", True), ("mistral", True),
                                                   ("mixtral", True), ("phi3", False), ("deepseek_v3", True),
                                                   ("gemma2", True), ("gpt_neox", False)])
def test_the_rotary_kernel_stands_in_where_the_rotary_embedding_is_llamas(kind, rotary_is_llamas, monkeypatch):
    """Phi-3's and GPT-NeoX's rotary embeddings (partial rotary) are their own, and keep them; the others' modules get the kernel's stand-in while installed, and their own back after."""
    model = _skeleton(kind)
    found = eager_attention._rotary_globals(model)
    assert bool(found) == rotary_is_llamas
    originals = [names["apply_rotary_pos_emb"] for names in found]
    assert rotary.ENABLED  # on by default
    with eager_attention.installed(model):
        assert all(names["apply_rotary_pos_emb"] is not fn for names, fn in zip(found, originals))
    assert [names["apply_rotary_pos_emb"] for names in found] == originals
    with monkeypatch.context() as m:
        m.setattr(rotary, "ENABLED", False)  # SUPERVISOR_TEST_KERNELS=norotary: nothing stands in
        with eager_attention.installed(model):
            assert [names["apply_rotary_pos_emb"] for names in found] == originals


@pytest.mark.parametrize("value,expected", [("", (True, False)), ("pack", (True, True)), ("nosmem,pack", (False, True)),
                                            ("norotary,smem", (True, False))])
def test_the_kernels_switches(value, expected, monkeypatch):
    """SUPERVISOR_TEST_KERNELS: a name turns its part on, "no" and the name off, else its default."""
    monkeypatch.setenv(faults.KERNELS, value)
    assert (faults.switched("smem", True), faults.switched("pack", False)) == expected
    assert faults.switched("rotary", True) == ("norotary" not in value)


@pytest.mark.parametrize("kind,why", [("gemma2", "Gemma2Attention's eager attention is not Llama's"),
                                      ("gpt_oss", "GptOssAttention's eager attention is not Llama's")])
def test_it_refuses_other_eager_attentions(kind, why):
    overrides = {"num_local_experts": 2} if kind == "gpt_oss" else {}
    assert eager_attention.applies(_skeleton(kind, **overrides), CUDA) == why


def test_it_refuses_other_attention_and_the_cpu(monkeypatch):
    monkeypatch.delenv(eager_attention.FORCE_ENV, raising=False)
    assert eager_attention.applies(_skeleton("llama", attn="sdpa"), CUDA) == "the attention is not eager"
    assert eager_attention.applies(_skeleton("llama"), CPU) == "cpu: not where it pays"
    monkeypatch.setenv(eager_attention.FORCE_ENV, "1")
    assert eager_attention.applies(_skeleton("llama"), CPU) is None


def _model(kind: str, dtype=torch.bfloat16, **overrides):
    """A real model of `kind` (random weights, eager attention) in `dtype`, and ids to run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = AutoConfig.for_model(kind, **{**shape, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype).eval()
    return model, torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind,dtype,overrides", [
    ("llama", torch.bfloat16, {}),
    ("qwen3", torch.bfloat16, {}),  # q/k norms before the attention
    ("mistral", torch.bfloat16, {"sliding_window": 16}),  # transformers' sliding-window mask
    ("llama", torch.float16, {}),
])
def test_the_fused_attention_is_eagers_bit_for_bit(kind, dtype, overrides):
    """The model's logits (its own masks, every layer's attention) through transformers' eager attention and
    through the fused one are equal; the fused one ran (its call compared once) and agreed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, ids = _model(kind, dtype, **overrides)
    with torch.no_grad():
        ref = model(ids).logits
        with eager_attention.installed():
            assert ALL_ATTENTION_FUNCTIONS.get_interface("eager", None) is eager_attention.fused_eager_attention
            ours = model(ids).logits
        assert "eager" not in ALL_ATTENTION_FUNCTIONS._local_mapping  # gone once left
    assert len(eager_attention._checked) == 1 and not eager_attention._state["off"]
    assert torch.equal(ref, ours)


def test_samples_of_many_lengths_are_eagers_and_only_the_first_lengths_are_compared(monkeypatch):
    """torch.compile makes a kernel for the first length and one for any length at the second: every sample's
    logits equal eager's, and eager runs beside the fused kernel for the first three lengths only (one call each:
    a model of one layer)."""
    model, ids = _model("qwen3", num_hidden_layers=1)
    compared = []
    eager = eager_attention._eager()
    monkeypatch.setattr(eager_attention, "_eager", lambda: lambda *a, **k: (compared.append(a[1].shape[-2]),
                                                                         eager(*a, **k))[1])
    lengths = [48, 40, 33, 20, 47]
    with torch.no_grad():
        refs = [model(ids[:, :n]).logits for n in lengths]
        compared.clear()
        with eager_attention.installed():
            ours = [model(ids[:, :n]).logits for n in lengths]
    assert all(torch.equal(a, b) for a, b in zip(refs, ours)) and not eager_attention._state["off"]
    assert compared == [48, 40, 33]


def test_a_difference_from_eager_turns_it_off_and_gives_eagers_result(monkeypatch, capfd):
    model, ids = _model("llama")
    wrong = lambda scores, m, scaling, upcast: (scores * scaling + m).float() * 1.001  # noqa: E731 - not eager's
    monkeypatch.setitem(eager_attention._state, "compiled", wrong)
    with torch.no_grad():
        ref = model(ids).logits
        with eager_attention.installed():
            ours = model(ids).logits
            assert eager_attention._state["off"]
            again = model(ids).logits  # eager from here on
    assert torch.equal(ref, ours) and torch.equal(ref, again)
    assert "fused attention: off: its result differs from eager attention's" in capfd.readouterr().err


def _eagers_probabilities(scores, mask, scaling):
    return torch.nn.functional.softmax(scores * scaling + mask, dim=-1, dtype=torch.float32).to(scores.dtype)


@pytest.mark.parametrize("wrong", [False, True])
def test_the_rotary_kernel_is_compared_and_a_difference_turns_it_off(wrong, monkeypatch, capfd):
    """The GPU's rotary kernel (child/backends/rotary.py, stood in for here) is compared with the library's
    apply_rotary_pos_emb once a layer per kind of call: where it differs, that call gets the library's result and
    the kernel is off for the process, with one line in the log; the logits are the library's either way."""
    model, ids = _model("llama")
    ran = []

    def kernel(library, q, k, cos, sin, unsqueeze_dim=1):
        if rotary.available() is not None:
            return None
        ran.append(q.shape)
        q_embed, k_embed = library(q, k, cos, sin, unsqueeze_dim)
        if wrong:
            q_embed = q_embed.clone()
            q_embed[0, 0, 0, 0] += 1
        return q_embed, k_embed
    monkeypatch.setattr(rotary, "rotated", kernel)
    monkeypatch.setattr(rotary, "ENABLED", True)
    with torch.no_grad():
        ref = model(ids).logits
        with eager_attention.installed(model):
            ours = model(ids).logits
    assert torch.equal(ref, ours)
    kinds = [call for call in eager_attention._checked if call[0] == "rotary"]
    err = capfd.readouterr().err
    if wrong:  # the first layer's call found the difference; the second layer took the library's
        assert len(ran) == 1 and len(kinds) == 1 and "differed from the library's" in rotary.available()
        assert err.count("fused attention: the rotary kernel differs from apply_rotary_pos_emb") == 1
    else:  # both layers' calls the kernel's: one kind, compared once
        assert len(ran) == 2 and len(kinds) == 1 and rotary.available() is None and "rotary" not in err


@pytest.mark.parametrize("wrong", [False, True])
def test_the_one_kernel_softmax_is_compared_and_a_difference_turns_it_alone_off(wrong, monkeypatch, capfd):
    """The GPU's one-kernel probabilities (child/backends/warp_softmax.py, stood in for here) are a kind of call of
    their own, compared with eager once a layer. Where they differ, that call gets eager's result, the kernel is off
    for the process with one line in the log, and the other layers take the fused prefix, compared and equal."""
    model, ids = _model("llama")

    def kernel(scores, mask, scaling, which=()):
        if warp_softmax.available() is not None:
            return None
        probs = _eagers_probabilities(scores, mask, scaling)
        if wrong:
            probs.view(-1)[0] = 0.5  # the first query attends to itself alone: 1.0 in eager's
        return probs
    monkeypatch.setattr(warp_softmax, "probabilities", kernel)
    with torch.no_grad():
        ref = model(ids).logits
        with eager_attention.installed():
            ours = model(ids).logits
    assert torch.equal(ref, ours) and not eager_attention._state["off"]
    paths = {call[-1][0] for call in eager_attention._checked}
    err = capfd.readouterr().err
    if wrong:
        assert paths == {"warp softmax", "fused prefix"} and "differed from eager" in warp_softmax.available()
        assert err.count("fused attention: the one-kernel softmax differs from eager attention's") == 1
    else:
        assert paths == {"warp softmax"} and warp_softmax.available() is None and "fused attention" not in err


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_awq_with_the_fused_attention_equals_oneshot(kind, tiny_models, ids_dataset, tmp_path, monkeypatch):  # noqa: F811
    """AWQ's grid search through the fused attention (switched on for the CPU): every tensor equals oneshot's,
    whose search ran transformers' eager attention; the fused function did run, compared and agreed."""
    monkeypatch.setenv(eager_attention.FORCE_ENV, "1")
    ran = []
    fused = eager_attention.fused_eager_attention
    monkeypatch.setattr(eager_attention, "fused_eager_attention", lambda *a, **k: (ran.append(1), fused(*a, **k))[1])
    source = tiny_models("llama") if kind == "llama" else make_tiny_dense(kind, str(tmp_path / "src"))
    rows = [json.loads(line)["input_ids"] for line in open(ids_dataset)]
    with threads(1):
        ref = oneshot_calibrated(source, "W4A16", "awq", rows, SEQ, str(tmp_path / "ref"), fix_masks=kind != "llama")
        ours = _export_in_process(source, "W4A16", "awq", ids_dataset, tmp_path / "ours")
    assert_same_tensors(load_tensors(ref), load_tensors(str(ours)))
    assert len(ran) > 2 * 21 and not eager_attention._state["off"]


def test_the_kernels_launcher_packs_each_argument_where_its_pointer_points():
    """child/backends/cuda_kernels.Kernel hands cuLaunchKernel one pointer an argument (`Arguments`): a 64-bit
    pointer for "p", a C int for "i" (the kernels' parameters), each read back here through its pointer."""
    import ctypes

    from child.backends.cuda_kernels import Arguments

    signature = "ppi" + "i" * 10 + "p"
    args = [0x7F00DEADBEEF, 0, 2 ** 31 - 1, *range(-5, 5), 2 ** 47 + 16]
    values, pointers = Arguments(signature).pack(*args)
    read = [ctypes.c_void_p.from_address(pointers[i]).value or 0 if kind == "p" else
            ctypes.c_int.from_address(pointers[i]).value for i, kind in enumerate(signature)]
    assert read == args and len(pointers) == 14
    with pytest.raises(ValueError, match="signature"):
        Arguments("pf")
