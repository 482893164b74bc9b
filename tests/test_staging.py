"""child/staging.py: a part's output copied into one reusable host buffer keeps every value, and writes the same
shard bytes as the tensors it was copied from."""
import pytest
import torch
from safetensors.torch import save_file

from child.staging import HostStaging
from child.writer import stage_shard


def _outputs(scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(scale)
    w = torch.randn(64 * scale, 96, generator=g)
    return {
        "q.weight": w.to(torch.float8_e4m3fn),  # FP8 weight
        "q.weight_scale": torch.rand(64 * scale, 1, generator=g).to(torch.bfloat16),
        "k.weight_packed": torch.randint(-2**31, 2**31 - 1, (32, 12 * scale), dtype=torch.int32, generator=g),
        "k.weight_shape": torch.tensor([32, 96 * scale]),  # int64, 1-D
        "o.weight": w.to(torch.bfloat16).t(),  # not contiguous
        "norm.weight": torch.ones(96, dtype=torch.bfloat16)[::2],  # a strided slice
        "zero_dim": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (float8 has no torch.equal of its own)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def test_staged_views_keep_names_dtypes_shapes_and_values():
    """Every tensor comes back contiguous, with its dtype, shape and bytes, as a view of the one buffer."""
    src = _outputs()
    staging = HostStaging("cpu", stage_host=True)
    got = staging.to_host(src)
    assert list(got) == list(src)
    buf = staging._held[1]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for k, v in got.items():
        assert _same(v, src[k].contiguous()), k
        assert v.is_contiguous(), k
        assert v.numel() == 0 or lo <= v.data_ptr() < hi, f"{k} is not in the buffer"
        assert v.data_ptr() % 256 == 0 or v.numel() == 0, k


def test_buffer_is_reused_when_a_part_fits_and_grown_when_it_does_not():
    """A part that fits reuses the buffer (no new allocation); a bigger part gets a bigger one; release frees it."""
    staging = HostStaging("cpu", stage_host=True)
    staging.to_host(_outputs(2))
    ptr, cap = staging._held[1].data_ptr(), staging.capacity
    small = _outputs(1)
    got = staging.to_host(small)
    assert (staging._held[1].data_ptr(), staging.capacity) == (ptr, cap)
    assert all(_same(got[k], small[k].contiguous()) for k in small)
    big = _outputs(400)  # more than the 2 MiB the first buffer was rounded up to
    got = staging.to_host(big)
    assert staging.capacity > cap
    assert all(_same(got[k], big[k].contiguous()) for k in big)
    del got
    staging.release()
    assert staging.capacity == 0


def test_host_tensors_pass_through_unless_staged():
    """On a CPU worker nothing is copied: the backend's host tensors are what is written."""
    src = _outputs()
    got = HostStaging("cpu").to_host(src)
    for k in ("q.weight", "k.weight_packed", "zero_dim"):
        assert got[k].data_ptr() == src[k].data_ptr()


def test_a_shard_written_from_staged_views_has_the_bytes_of_one_written_from_the_tensors(tmp_path):
    """safetensors writes views of one buffer (they share a storage) byte for byte as separate tensors; the digest
    computed from memory matches the file either way."""
    src = _outputs(3)
    ref = tmp_path / "ref.safetensors"
    save_file({k: v.contiguous() for k, v in src.items()}, str(ref), metadata={"format": "pt"})
    staged = HostStaging("cpu", stage_host=True).to_host(src)
    (tmp_path / "out").mkdir()
    w = stage_shard(staged, str(tmp_path / "out" / "part.safetensors"))
    assert (tmp_path / "out" / "part.safetensors").read_bytes() == ref.read_bytes()
    plain = stage_shard({k: v.contiguous() for k, v in src.items()}, str(tmp_path / "out" / "plain.safetensors"))
    assert w.digest == plain.digest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_outputs_land_in_pinned_memory():
    """On a GPU worker the output is copied into registered (pinned) host memory, values intact."""
    src = {k: v.to("cuda:0") for k, v in _outputs(4).items()}
    staging = HostStaging("cuda:0")
    got = staging.to_host(src)
    for k, v in got.items():
        assert v.device.type == "cpu" and _same(v, src[k].cpu().contiguous()), k
        if v.numel():
            assert v.is_pinned(), k
    del got
    staging.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_buffer_cuda_refuses_to_register_still_carries_every_value(monkeypatch, capfd):
    """When cudaHostRegister fails (a locked-memory limit, a driver that refuses), the buffer is used unpinned: the
    copies are synchronous, the values intact, and the worker's stderr says why it is slower."""
    cudart = torch.cuda.cudart()
    refused = "cudaErrorMemoryAllocation"  # torch binds only cudaError.success; anything else is a failure
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda ptr, size, flags: refused)
    src = {k: v.to("cuda:0") for k, v in _outputs(4).items()}
    staging = HostStaging("cuda:0")
    for _ in range(2):  # the second part reuses the unpinned buffer
        got = staging.to_host(src)
        for k, v in got.items():
            assert v.device.type == "cpu" and _same(v, src[k].cpu().contiguous()), k
            assert not v.is_pinned(), k
    assert staging._held[2] == 0
    assert "cudaHostRegister" in capfd.readouterr().err
    del got
    staging.release()  # nothing registered: nothing to unregister
    assert staging.capacity == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_registered_boundary_buffer_is_pinned_copies_both_ways_and_is_unregistered_when_dropped(monkeypatch):
    """pinned_host_buffer (a boundary's host memory on a GPU): page-locked, asynchronous copies device -> host -> device
    carry every value, and it is unregistered once its last view is gone, not before."""
    import gc

    from child import staging
    from child.backends.boundary import host_buffer

    unregistered = []
    real = staging._unregister
    monkeypatch.setattr(staging, "_unregister", lambda ptr, device: (unregistered.append(ptr), real(ptr, device)))
    x = torch.randn(3, 1000, 257, device="cuda", dtype=torch.bfloat16)
    flat = host_buffer(x.numel(), torch.bfloat16, pin=True)
    assert flat.is_pinned() and flat.numel() == x.numel() and flat.dtype == torch.bfloat16
    view = flat.view(x.shape)
    view.copy_(x, non_blocking=True)
    ptr = flat.data_ptr()
    del flat
    gc.collect()
    assert not unregistered  # a view still holds it
    back = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x)
    del view
    gc.collect()
    assert unregistered == [ptr]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_boundary_streamed_from_the_gpu_into_memory_made_meanwhile_is_the_samples(tmp_path):
    """Layer 0's outputs on a GPU: host memory made on another thread (host_buffer_meanwhile) is pinned, and a
    streamed boundary (each sample written once its asynchronous copy has landed) holds every sample's bytes: the
    file loads back equal to the samples, with the digest a one-thread fsynced write of them gives."""
    from child.backends.boundary import Activations, BoundaryWriter, host_buffer_meanwhile

    shapes = [(1, 513, 256)] * 6 + [(1, 77, 256)]
    samples = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    numel = sum(x.numel() for x in samples)
    flat = host_buffer_meanwhile(numel, torch.bfloat16, torch.device("cuda")).result(timeout=120)
    assert flat.is_pinned() and flat.numel() == numel
    w = BoundaryWriter(1, shapes, torch.bfloat16, tmp_path=str(tmp_path / "s.tmp"), keep_in_ram=True, buffer=flat,
                       pin=True, later=True, sync=False, stream=True)
    for j, x in enumerate(samples):
        w.put(j, x * 1)  # queued behind the multiplication: the writer must wait for each copy to land
    acts, pending = w.commit_later(str(tmp_path / "s.bin"))
    digest, _ = pending.wait()
    ref = BoundaryWriter(1, shapes, torch.bfloat16, tmp_path=str(tmp_path / "r.tmp"), keep_in_ram=False)
    for j, x in enumerate(samples):
        ref.put(j, x)
    _, ref_digest, _ = ref.commit(str(tmp_path / "r.bin"))
    assert digest == ref_digest
    assert (tmp_path / "s.bin").read_bytes() == (tmp_path / "r.bin").read_bytes()
    loaded = Activations.load(str(tmp_path / "s.bin"), digest, 1, in_ram=True)
    assert all(torch.equal(loaded.get(j), x.cpu()) for j, x in enumerate(samples))
    assert all(torch.equal(acts.get(j), x.cpu()) for j, x in enumerate(samples))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_samples_sent_ahead_to_the_gpu_are_the_samples():
    """Activations.to_device from pinned memory (the next sample's copy on a stream of its own beside the caller's
    work): every sample arrives with its values, also when the caller computes with it on its own stream and keeps
    none of them; the outputs copied back on the writer's stream are the ones computed."""
    from child.backends.boundary import Activations, BoundaryWriter, host_buffer

    shapes = [(1, 1000 + 37 * j, 256) for j in range(9)]
    samples = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    flat = host_buffer(sum(x.numel() for x in samples), torch.bfloat16, pin=True)
    acts = Activations(1, shapes, torch.bfloat16, flat=flat)
    for j, x in enumerate(samples):
        acts.get(j).copy_(x)
    out = BoundaryWriter(2, shapes, torch.bfloat16, tmp_path=None, keep_in_ram=True, pin=True, later=True)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    for j, hidden in enumerate(acts.to_device(torch.device("cuda"))):
        assert hidden.is_cuda
        out.put(j, (hidden @ w) @ w.T)  # the sample is read by kernels queued after its copy, then dropped
    got, _, _ = out.commit(None)
    for j, x in enumerate(samples):
        ref = (x.cuda() @ w) @ w.T
        assert torch.equal(got.get(j), ref.cpu()), j


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parts_copied_onto_the_gpu_through_pinned_chunks_are_the_parts(tmp_path, monkeypatch):
    """DeviceStaging (the read-ahead's way onto the GPU): tensors of every kind a checkpoint holds (a mapped file's,
    larger than a chunk, empty, 0-dim, bool, 8-bit floats, a non-contiguous view) arrive with their values; also
    while kernels queued on the caller's stream free memory the copies are given (they wait for that work)."""
    from safetensors.torch import load_file

    from child.staging import DeviceStaging

    monkeypatch.setattr(DeviceStaging, "CHUNK", 1 << 20)  # several chunks per tensor, both buffers reused
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(1500, 1000, generator=g).to(torch.bfloat16), "scalar": torch.tensor(3.5),
               "empty": torch.empty(0, 7), "mask": torch.rand(333, generator=g) > 0.5,
               "fp8": torch.randn(4096, 300, generator=g).to(torch.float8_e4m3fn),
               "odd": torch.randint(-9, 9, (12345,), generator=g, dtype=torch.int32)}
    save_file(tensors, tmp_path / "part.safetensors")
    mapped = load_file(tmp_path / "part.safetensors")  # pageable, as the read-ahead's checkpoint tensors
    mapped["strided"] = tensors["big"][:, ::3]
    staging = DeviceStaging("cuda:0")
    for _ in range(3):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            busy = busy @ busy.T / 4096  # queued work that frees memory as it goes
        del busy
        got = staging.to_device(mapped)
        for k, v in mapped.items():
            assert got[k].is_cuda and got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("meta", [None, {"format": "pt", "b": "2", "a": "1", "z": "x"}])
def test_a_staged_shard_has_the_bytes_safetensors_writes(meta, tmp_path):
    """stage_shard's file is save_file's own, byte for byte, its metadata keys in sorted order (an uninterrupted and a
    resumed run write the same bytes), and its digest (hashed from memory) is the file's."""
    import json
    import struct

    from shared import durable
    from shared.layout import SHARD_METADATA

    tensors = {"model.layers.0.mlp.down_proj.weight": torch.randn(256, 700, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight_scale": torch.rand(256, 1, dtype=torch.float32),
               "model.layers.0.self_attn.q_proj.weight": torch.randint(-128, 127, (4096, 33), dtype=torch.int8)}
    ref = str(tmp_path / "ref.safetensors")
    save_file(tensors, ref, metadata=SHARD_METADATA if meta is None else meta)
    with open(ref, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    path = str(tmp_path / "out" / "part.safetensors")
    w = stage_shard(tensors, path, metadata=meta)
    with open(path, "rb") as f:
        got = f.read()
    assert w.digest == durable.hash_file(path) and w.nbytes == len(got)
    (m,) = struct.unpack("<Q", got[:8])
    assert m == n and got[8 + n:] == data[8 + n:]
    mine = json.loads(got[8:8 + n])
    assert mine == header and list(mine["__metadata__"]) == sorted(header["__metadata__"])
    if meta is None:
        assert got == data
