"""shared/durable.py: the digest of a safetensors file hashed from memory (equal to hashing the file, and the file hashed
instead whenever the bytes at hand do not fit its header); writes past the page cache (write_direct) leave the bytes a
plain write does."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shared import durable


def _file(tmp_path) -> tuple[str, dict]:
    tensors = {"b.weight": torch.randn(7, 5, dtype=torch.bfloat16), "a.norm": torch.randn(5, dtype=torch.float32),
               "c.flag": torch.tensor(True)}
    path = str(tmp_path / "x.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def test_digest_from_memory_equals_the_files(tmp_path):
    path, tensors = _file(tmp_path)
    assert durable.digest_safetensors(path, lambda name: _bytes(tensors[name])) == durable.hash_file(path)


def test_bytes_that_do_not_fit_the_header_fall_back_to_the_file(tmp_path):
    """A missing tensor, or bytes of another size, never yield a digest of bytes the file does not hold."""
    path, tensors = _file(tmp_path)
    whole = durable.hash_file(path)
    assert durable.digest_safetensors(path, lambda name: None if name == "a.norm" else _bytes(tensors[name])) == whole
    assert durable.digest_safetensors(path, lambda name: _bytes(tensors[name])[:-1]) == whole
    # the same sizes but other values: the digest is of those values (the caller vouches for them), so it differs
    other = {k: torch.zeros_like(v) for k, v in tensors.items()}
    assert durable.digest_safetensors(path, lambda name: _bytes(other[name])) != whole


def _direct_works(folder) -> bool:
    """Whether this filesystem takes O_DIRECT at all (tmpfs does not): asked here, not through the code under test."""
    import os

    path = os.path.join(folder, "probe")
    open(path, "wb").close()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(path)


def _aligned(nbytes: int, shift: int = 0) -> memoryview:
    import mmap

    mapping = mmap.mmap(-1, nbytes + shift + 1)
    view = memoryview(mapping)[shift:shift + nbytes]
    view[:] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    return view


@pytest.mark.parametrize("nbytes,shift,offset", [
    (3 * (32 << 20) + 4096 * 3 + 17, 0, 4096),  # several 32 MiB pieces, whole blocks, a tail of 17 bytes
    (4096 * 5, 0, 0),                           # whole blocks only
    (100, 0, 4096),                             # under a block: the page cache alone
    (4096 * 3 + 5, 1, 4096),                    # memory not aligned: the page cache
    (4096 * 3 + 5, 0, 4100),                    # offset not aligned: the page cache
])
def test_a_direct_write_leaves_the_bytes_a_plain_write_does(nbytes, shift, offset, tmp_path):
    """write_direct's file holds what sits before `offset` untouched and then exactly `data`, whichever way each
    block went; the update callback sees `data` once, in order; O_DIRECT wrote the blocks exactly when everything
    was aligned and the filesystem takes it."""
    import os

    data = _aligned(nbytes, shift)
    path = str(tmp_path / "f.bin")
    head = b"h" * offset
    with open(path, "wb") as f:
        f.write(head)
    seen = []
    fd = os.open(path, os.O_WRONLY)
    try:
        direct = durable.write_direct(fd, path, data, offset, lambda v: seen.append(bytes(v)), threads=3)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == head + bytes(data)
    assert b"".join(seen) == bytes(data)
    expect = shift == 0 and offset % 4096 == 0 and nbytes >= 4096 and _direct_works(str(tmp_path))
    assert direct == expect


def test_a_filesystem_that_refuses_direct_writes_gets_the_same_bytes(tmp_path, monkeypatch):
    """O_DIRECT refused at open (tmpfs: EINVAL) or at the first write (a block size over 4 KiB): the whole of the
    data through the page cache, hashed once."""
    import errno
    import os

    data = _aligned(4096 * 20 + 9)
    real_open, real_pwrite = os.open, os.pwrite
    for where in ("open", "write"):
        def fake_open(p, flags, *a):
            if where == "open" and flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(p, flags, *a)

        direct_fds = set()

        def tracking_open(p, flags, *a):
            fd = fake_open(p, flags, *a)
            if flags & os.O_DIRECT:
                direct_fds.add(fd)
            return fd

        def fake_pwrite(fd, view, off):
            if fd in direct_fds:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, view, off)

        monkeypatch.setattr(os, "open", tracking_open)
        monkeypatch.setattr(os, "pwrite", fake_pwrite)
        path = str(tmp_path / f"{where}.bin")
        fd = real_open(path, os.O_WRONLY | os.O_CREAT)
        seen = []
        try:
            assert durable.write_direct(fd, path, data, 0, lambda v: seen.append(bytes(v))) is False
        finally:
            os.close(fd)
        monkeypatch.undo()
        with open(path, "rb") as f:
            assert f.read() == bytes(data)
        assert b"".join(seen) == bytes(data)


def test_a_direct_write_that_fails_otherwise_raises(tmp_path, monkeypatch):
    """A disk error other than the alignment one (a full disk) is raised, not hidden by the fallback."""
    import errno
    import os

    if not _direct_works(str(tmp_path)):
        pytest.skip("this filesystem takes no O_DIRECT")
    data = _aligned(4096 * 8)

    def full(fd, view, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as info:
            durable.write_direct(fd, path, data, 0)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_replace_all_places_every_file_and_syncs_each_folder_once(tmp_path, monkeypatch):
    """Several temp files become their final names with their bytes; each is fsynced before any rename and each
    destination folder once after them; a temp file that is missing renames nothing."""
    import os

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "tmp").mkdir()
    pairs = []
    for k, folder in enumerate(["a", "a", "b"]):
        tmp = tmp_path / "tmp" / f"f{k}.tmp"
        tmp.write_bytes(bytes([k]) * (k + 1))
        pairs.append((str(tmp), str(tmp_path / folder / f"f{k}")))
    (tmp_path / "a" / "f0").write_bytes(b"old")  # replaced
    calls = []
    real_file, real_dir, real_replace = durable.fsync_file, durable.fsync_dir, os.replace
    monkeypatch.setattr(durable, "fsync_file", lambda p, drop=False: (calls.append(("file", p)), real_file(p))[1])
    monkeypatch.setattr(durable, "fsync_dir", lambda p: (calls.append(("dir", p)), real_dir(p))[1])
    monkeypatch.setattr(durable.os, "replace", lambda a, b: (calls.append(("rename", a)), real_replace(a, b))[1])
    durable.replace_all(pairs)
    for k, (_, dest) in enumerate(pairs):
        assert open(dest, "rb").read() == bytes([k]) * (k + 1)
    kinds = [c[0] for c in calls]
    assert kinds == ["file"] * 3 + ["rename"] * 3 + ["dir"] * 2, kinds
    assert [c[1] for c in calls if c[0] == "dir"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert not list((tmp_path / "tmp").iterdir())

    calls.clear()
    keep = tmp_path / "tmp" / "kept.tmp"
    keep.write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        durable.replace_all([(str(keep), str(tmp_path / "a" / "kept")), (str(tmp_path / "tmp" / "gone"), str(tmp_path / "a" / "gone"))])
    assert keep.exists() and not (tmp_path / "a" / "kept").exists()
    assert "rename" not in [c[0] for c in calls]
