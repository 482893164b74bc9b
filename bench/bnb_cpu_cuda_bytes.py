"""On a CUDA GPU: bitsandbytes' CUDA vs CPU quantization bytes (4-bit: nf4/fp4, double quant, blocksize, storage;
int8), then supervisor.live.qlora.base_difference on a model quantized on the GPU (its 16-bit folder, another seed, a
1%-noise 'fine-tune'). Needs bitsandbytes and msgspec there (carried: docs/benchmarks.md); docs/studio.md holds
the H200 figures."""
import json, os, time
import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F
print("bnb", bnb.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
out = {}
torch.manual_seed(0)
def codes(d):
    b = d.reshape(-1).view(torch.uint8)
    return torch.stack([b >> 4, b & 15], 1).reshape(-1)
for shape in [(4096, 4096), (1024, 11008)]:
    base = torch.randn(shape) * 0.02
    base[0, :7] = 0.0  # a few exact zeros, and a larger outlier
    base[5, 3] = 0.3
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = base.to(dtype)
        for qt in ("nf4", "fp4"):
            for dq in (False, True):
                for bs in (64, 128):
                    for st in (torch.uint8, torch.bfloat16):
                        settings = dict(blocksize=bs, compress_statistics=dq, quant_type=qt, quant_storage=st)
                        dc, sc = F.quantize_4bit(x.cuda(), **settings)
                        dh, sh = F.quantize_4bit(x, **settings)
                        dc = dc.cpu()
                        key = f"{shape} {str(dtype)[6:]} {qt} dq={dq} bs={bs} {str(st)[6:]}"
                        cd = int((codes(dc) != codes(dh)).sum())
                        # bytes, not torch.equal: codes stored as bf16 hold NaN patterns (the 2026-12-02 run used
                        # torch.equal, so its bf16-storage rows said False where the codes were equal)
                        same = torch.equal(dc.reshape(-1).view(torch.uint8), dh.reshape(-1).view(torch.uint8))
                        r = {"bytes_equal": same, "codes_differ": cd,
                             "absmax_equal": torch.equal(sc.absmax.cpu(), sh.absmax)}
                        if dq:
                            r["offset_equal"] = sc.offset.item() == sh.offset.item()
                            r["offset_diff"] = sc.offset.item() - sh.offset.item()
                            r["absmax2_equal"] = torch.equal(sc.state2.absmax.cpu(), sh.state2.absmax)
                            r["qabsmax_differ"] = int((sc.absmax.cpu() != sh.absmax).sum())
                        out[key] = r
    x16 = base.to(torch.float16)
    cb_c, scb_c, _ = F.int8_vectorwise_quant(x16.cuda())
    cb_h, scb_h, _ = F.int8_vectorwise_quant(x16.clone())
    out[f"{shape} int8"] = {"CB_equal": torch.equal(cb_c.cpu(), cb_h), "CB_differ": int((cb_c.cpu() != cb_h).sum()),
                            "SCB_equal": torch.equal(scb_c.cpu(), scb_h)}
for k, r in out.items():
    print(k, r)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "kernels.json"), "w"), indent=1)

# ---- end to end: supervisor.live.qlora on a GPU-quantized model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig
from peft import LoraConfig, get_peft_model
from supervisor.live import qlora, model as live
from supervisor.checks.source import inspect
cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=512, head_dim=128)
root = "/tmp/models"
def save(seed, path, noise=None):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if noise is not None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(99)
            for n, p in m.named_parameters():
                if p.ndim == 2:
                    p.add_((torch.randn(p.shape, generator=g) * p.float().std() * noise).to(p.dtype))
    m.save_pretrained(path)
save(0, f"{root}/base"); save(7, f"{root}/seed7"); save(0, f"{root}/tuned", noise=0.01)
for name, kw in [("nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)),
                 ("fp4+dq", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True)),
                 ("nf4+dq fp16", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)),
                 ("int8", dict(load_in_8bit=True))]:
    dtype = torch.float16 if "fp16" in name else torch.bfloat16
    m = AutoModelForCausalLM.from_pretrained(f"{root}/base", quantization_config=BitsAndBytesConfig(**kw),
                                             device_map="cuda", dtype=dtype)
    lv = get_peft_model(m, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    inner = lv.base_model.model
    loras, _ = live.lora_layers(inner, "default", quantized=True)
    saved = live.Saved(inner, {}, loras)
    w = inner.model.layers[0].self_attn.v_proj.base_layer.weight
    print(name, type(w).__name__, w.device, flush=True)
    exact = []
    orig = qlora._cell_difference
    def spy(*a, **k):
        exact.append("fallback")
        return orig(*a, **k)
    qlora._cell_difference = spy
    for folder in ("base", "seed7", "tuned"):
        exact.clear()
        src = inspect(f"{root}/{folder}")
        t = time.time()
        d = qlora.base_difference(saved, src)
        print(f"  {name} {folder}: {d!r} sample={qlora.sample(qlora._known(saved, src), src, set(loras))} "
              f"path={'fallback' if exact else 'bytes'} {time.time() - t:.3f}s", flush=True)
    qlora._cell_difference = orig
    del lv, m
    torch.cuda.empty_cache()
