"""On a GPU: child/backends/warp_softmax.py's one kernel gives eager attention's probabilities bit for bit (the
scaling, the mask, PyTorch's fp32 softmax and the cast as transformers' eager attention runs them), for every row
length it takes, both half dtypes, with and without masks; longer rows are left to eager's chain; whole models through
the fused attention give eager's logits with the kernel in use; child/backends/rotary.py's kernel gives Llama's
apply_rotary_pos_emb bit for bit, strides included, and is in use in those models. (AWQ exports on cuda against oneshot, with the
fusion on: tests/gpu/test_calibrated_gpu.py.)"""
import pytest
import torch

from child.backends import eager_attention, rotary, warp_softmax
from tests.test_eager_attention import fresh_state  # noqa: F401 - autouse: the fusion on, nothing compared yet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
LENGTHS = [1, 7, 31, 32, 33, 100, 128, 257, 1000, 1024, 1025, 1536, 2047, 2048]


def _eagers(scores, mask, scaling):
    """transformers' eager attention between its products, as it is written."""
    x = scores * scaling
    if mask is not None:
        x = x + mask
    return torch.nn.functional.softmax(x, dim=-1, dtype=torch.float32).to(scores.dtype)


def _scores(dtype, heads, q, k, spread, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    query = torch.randn(1, heads, q, 128, generator=g, device=CUDA, dtype=dtype) * spread
    key = torch.randn(1, heads, k, 128, generator=g, device=CUDA, dtype=dtype)
    return torch.matmul(query, key.transpose(2, 3))


def _causal(dtype, q, k):
    """transformers' 4D mask for eager attention: 0 where attended, the dtype's minimum elsewhere."""
    return torch.full((1, 1, q, k), torch.finfo(dtype).min, dtype=dtype, device=CUDA).triu(k - q + 1)


@pytest.fixture(params=[(False, False), (True, False), (False, True), (True, True)],
                ids=["plain", "pack", "smem", "pack+smem"])
def switches(request, monkeypatch):
    """The kernel's ways of moving and holding a row (warp_softmax.PACK, SMEM): every one must give eager's bits."""
    monkeypatch.setattr(warp_softmax, "PACK", request.param[0])
    monkeypatch.setattr(warp_softmax, "SMEM", request.param[1])
    return request.param


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN included


def _describe(ours, ref) -> str:
    differ = (ours.view(torch.int16) != ref.view(torch.int16)).view(-1, ref.shape[-1]).any(-1)  # as _same_bits
    return f"{int(differ.sum())} of {differ.numel()} rows differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("length", LENGTHS)
def test_the_kernel_gives_eagers_probabilities(dtype, length, switches):
    scaling = 128 ** -0.5
    cases = {
        "causal": (_scores(dtype, 4, length, length, 1.0, length), _causal(dtype, length, length)),
        "no mask, one query": (_scores(dtype, 8, 1, length, 1.0, length + 1), None),
        # wide scores: many exp() far below the row's maximum (fp32 subnormals and zeros)
        "wide, causal": (_scores(dtype, 4, length, length, 20.0, length + 2),
                         _causal(dtype, length, length)),
        # a padded sample: the last keys masked for every query (a batch's shorter row)
        "padding": (_scores(dtype, 2, length, length, 1.0, length + 3),
                    _causal(dtype, length, length).clone().index_fill_(-1, torch.arange(
                        length // 2, length, device=CUDA), torch.finfo(dtype).min)),
        # a sample's first queries see no key at all (left padding): every x is the lowest value, uniform rows
        "masked rows": (_scores(dtype, 2, length, length, 1.0, length + 5),
                        _causal(dtype, length, length).clone().index_fill_(-2, torch.arange(
                            min(3, length), device=CUDA), torch.finfo(dtype).min)),
    }
    # masked scores so large that x is not the mask's lowest value (bf16), or NaN
    causal = _causal(dtype, length, length)
    scores = _scores(dtype, 2, length, length, 1.0, length + 6)
    if dtype == torch.bfloat16:
        cases["huge masked scores"] = (scores.masked_fill(causal != 0, 3e38), causal)
    cases["NaN scores"] = (scores.masked_fill(causal != 0, float("nan")), causal)
    for name, (scores, mask) in cases.items():
        ours = warp_softmax.probabilities(scores, mask, scaling)
        if length > warp_softmax.MAX_ROW[dtype]:  # fp16's longer rows: PyTorch's own kernel (the fused prefix's path)
            assert ours is None and warp_softmax.available() is None
            continue
        assert ours is not None, (name, warp_softmax.available())
        # with SMEM, rows of a multiple of 8 keys (16-byte aligned) go through shared memory, the others lane by lane
        assert warp_softmax.variant(scores, mask)[1] == (switches[1] and length % 8 == 0)
        ref = _eagers(scores, mask, scaling)
        assert _same_bits(ours, ref), f"{name}, length {length}: {_describe(ours, ref)}"


def test_a_mask_broadcast_over_queries_and_a_strided_mask(switches):
    """Masks as other models build them: [batch, 1, 1, keys] (broadcast over the queries), and a slice of a wider one
    (a cache's mask cut to the keys)."""
    dtype, scaling = torch.bfloat16, 0.125
    for n in (300, 296):  # lane by lane; through shared memory where the layout allows it
        scores = _scores(dtype, 4, n, n, 1.0, 7)
        row = torch.zeros(1, 1, 1, n, dtype=dtype, device=CUDA)
        row[..., 250:] = torch.finfo(dtype).min
        wide = _causal(dtype, n, n + 100)[..., 100:]  # starts 200 bytes in: not 16-byte aligned
        for mask, smem in ((row, switches[1] and n % 8 == 0), (wide, False)):
            ours = warp_softmax.probabilities(scores, mask, scaling)
            assert warp_softmax.variant(scores, mask)[1] == smem
            assert ours is not None and torch.equal(ours, _eagers(scores, mask, scaling))


def test_the_row_division_equals_ieee_division():
    """warp_softmax.ROW_DIVISION (the row's reciprocal once, two fma a key) against div.rn, PyTorch's division: every
    ev of the range the kernel takes it for, [2^-64, 1] (2^29 + 1 values), against the end sums 1 and 2048 and random
    sums between; every significand of ev against 64 random significands of the sum; the reciprocal instruction's
    exact scaling over the sums' exponents. (bench/division_proof.py checks all 2^46 pairs of significands.)"""
    from bench.division_proof import ONE, SIGNIFICANDS, mismatches, scaling_mismatches

    assert scaling_mismatches() == 0
    g = torch.Generator().manual_seed(0)
    two_048 = 0x45000000  # 2048.0f's bits
    ends = torch.tensor([ONE, two_048, two_048 - 1, ONE + 1], dtype=torch.int32)
    sums = torch.cat([ends, torch.randint(ONE, two_048, (4,), generator=g, dtype=torch.int32)]).to(CUDA)
    low = 0x1F800000  # 2^-64's bits
    assert mismatches(sums, low, ONE - low + 1) == (0, 0, 0)
    significands = torch.randint(ONE, ONE + SIGNIFICANDS, (64,), generator=g, dtype=torch.int32).to(CUDA)
    assert mismatches(significands, ONE, SIGNIFICANDS) == (0, 0, 0)
    assert mismatches(significands, ONE, SIGNIFICANDS, control=True)[0] > 0  # the uncorrected product: it can fail


def test_what_the_kernel_leaves_to_eagers_chain():
    dtype = torch.bfloat16
    assert warp_softmax.probabilities(_scores(dtype, 2, 4, warp_softmax.MAX_ROW[dtype] + 1, 1.0, 0), None, 0.1) is None
    scores = _scores(dtype, 2, 16, 16, 1.0, 0)
    assert warp_softmax.probabilities(scores, _causal(torch.float32, 16, 16), 0.1) is None  # a mask of another dtype
    assert warp_softmax.probabilities(scores.float(), None, 0.1) is None
    assert warp_softmax.probabilities(scores.transpose(2, 3), None, 0.1) is None  # not contiguous
    assert warp_softmax.available() is None


def _model(kind, dtype, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **{**shape, **overrides}),
                                             attn_implementation="eager")
    return model.to(CUDA, dtype).eval()


@pytest.mark.parametrize("kind,dtype,overrides", [
    ("llama", torch.bfloat16, {}),
    ("qwen3", torch.bfloat16, {}),
    ("mistral", torch.bfloat16, {"sliding_window": 64}),
    ("llama", torch.float16, {}),
])
def test_models_through_the_fused_attention_give_eagers_logits(kind, dtype, overrides, switches, monkeypatch):
    """Every layer's attention through the one kernel (lengths 700, 2048 and 2100: the last, and fp16's 2048, by
    eager's chain with the fused prefix) and the rotary kernel, logits equal eager's, and each path was the one
    expected."""
    monkeypatch.setattr(rotary, "ENABLED", True)
    model = _model(kind, dtype, **overrides)
    paths = []
    for length in (700, 2048, 2100):
        ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(length)).to(CUDA)
        with torch.no_grad():
            ref = model(ids).logits
            with eager_attention.installed(model):
                ours = model(ids).logits
        assert torch.equal(ref, ours), (kind, length)
        # the kinds of call compared: the attention's paths, and the rotary kernel's
        paths.append({call[-1][0] for call in eager_attention._checked if call[0] != "rotary"})
        assert any(call[0] == "rotary" for call in eager_attention._checked)
    middle = "warp softmax" if dtype == torch.bfloat16 else "fused prefix"
    assert paths == [{"warp softmax"}, {middle}, {"fused prefix"}]
    assert not eager_attention._state["off"] and warp_softmax.available() is None and rotary.available() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,cos_batch,heads,kv_heads,tokens,head_dim", [
    (1, 1, 32, 8, 2048, 128),  # the 8B shape
    (1, 1, 8, 2, 7, 64),
    (1, 1, 4, 1, 1, 80),
    (2, 1, 4, 4, 33, 128),  # cos and sin broadcast over the batch
    (2, 2, 4, 2, 300, 96),
])
def test_the_rotary_kernel_gives_llamas_rotary_embedding(dtype, batch, cos_batch, heads, kv_heads, tokens, head_dim):
    """Queries and keys as Llama's attention makes them (a [batch, tokens, heads, dim] projection transposed), and
    contiguous ones; cos and sin of wide and narrow values: every output and its strides equal the library's."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator(device=CUDA).manual_seed(tokens)
    for layout in ("transposed", "contiguous"):
        q = torch.randn(batch, tokens, heads, head_dim, generator=g, device=CUDA).mul(4).to(dtype)
        k = torch.randn(batch, tokens, kv_heads, head_dim, generator=g, device=CUDA).mul(4).to(dtype)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if layout == "contiguous":
            q, k = q.contiguous(), k.contiguous()
        angles = torch.rand(cos_batch, tokens, head_dim, generator=g, device=CUDA) * 1000
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        ours = rotary.rotated(apply_rotary_pos_emb, q, k, cos, sin)
        assert ours is not None, rotary.available()
        for a, b in zip(ours, apply_rotary_pos_emb(q, k, cos, sin)):
            assert torch.equal(a, b) and a.stride() == b.stride(), (layout, (a != b).sum())
