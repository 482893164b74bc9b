"""On the H200: how close the right checkpoint comes to the fallback's tolerances when the live weight was quantized
by bitsandbytes' CUDA kernels (excess beyond the code's cell in scaled units vs CELL_SLACK; absmax error vs tol),
and the CPU time of one check of a large weight. docs/studio.md holds the H200 figures."""
import time, torch
import bitsandbytes.functional as F
from supervisor.live import qlora
torch.manual_seed(0)
def excess(scaled, live, book):
    book = torch.unique(book)
    mids = (book[1:] + book[:-1]) / 2
    inf = torch.tensor([float("inf")])
    i = torch.searchsorted(book, live)
    low, high = torch.cat([-inf, mids])[i], torch.cat([mids, inf])[i]
    return float(torch.clamp(torch.maximum(low - scaled, scaled - high), min=0).max())
worst = {"cell": 0.0, "absmax_ratio": 0.0, "int8": 0.0}
for trial, shape in enumerate([(4096, 4096), (1024, 14336), (14336, 1024), (8192, 1024), (4096, 11008)]):
    base = torch.randn(shape) * (0.01 + 0.02 * trial)
    base[torch.rand(shape) < 1e-4] *= 20  # outliers
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = base.to(dtype)
        for qt in ("nf4", "fp4"):
            for dq in (False, True):
                for bs in (64, 128, 256):
                    d, qs = F.quantize_4bit(x.cuda(), blocksize=bs, compress_statistics=dq, quant_type=qt)
                    d = d.cpu()
                    xf = x.reshape(-1).float()
                    am = qlora._blocks(xf, bs).abs().amax(1)
                    per = am.repeat_interleave(bs)[:len(xf)]
                    vals = qs.code.cpu().float()
                    e = excess(xf / per.clamp(min=1e-38), vals[qlora._codes_4bit(d, qs, False).long()], vals)
                    scale, tol = qlora._live_absmax_4bit(qs, False)
                    err = (scale - am.double()).abs()
                    ratio = float((err / tol.clamp(min=1e-300)).max()) if dq else float(err.max())
                    key = f"{shape} {str(dtype)[6:]} {qt} dq={dq} bs={bs}"
                    print(key, f"cell excess {e:.3g} (slack {qlora.CELL_SLACK:.3g})",
                          f"absmax {'err/tol' if dq else 'err'} {ratio:.3g}", flush=True)
                    worst["cell"] = max(worst["cell"], e)
                    if dq:
                        worst["absmax_ratio"] = max(worst["absmax_ratio"], ratio)
                    elif ratio:
                        print("  PLAIN ABSMAX DIFFERS", ratio)
    x16 = base.to(torch.float16)
    cb, scb, _ = F.int8_vectorwise_quant(x16.cuda())
    rows = x16.float().abs().amax(1)
    s = x16.float() * 127 / rows[:, None]
    e = float(torch.clamp((s - cb.cpu().float()).abs() - 0.5, min=0).max())
    print(shape, "int8 excess", e, "SCB exact", torch.equal(scb.cpu(), rows), flush=True)
    worst["int8"] = max(worst["int8"], e)
print("WORST", worst, "slack", qlora.CELL_SLACK, "int8 slack", 127 * qlora.CELL_SLACK)
# CPU cost of one check of a large weight (fallback path), on this host's CPU
for shape in [(1024, 4096), (4096, 4096), (4096, 14336)]:
    x = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    import bitsandbytes.nn as bnn
    w = bnn.Params4bit(x, requires_grad=False, quant_type="nf4", compress_statistics=True).to("cuda")
    t = time.time()
    r = qlora._weight_difference(w, x)
    print(shape, "nf4+dq check", repr(r), f"{time.time() - t:.2f}s")
