"""shared/framing.py: whole frames, size cap, clean vs dirty EOF, deadlines."""
import os

import msgspec
import pytest

from shared.framing import HEADER, EndOfStream, FrameError, Reader, Writer
from shared.messages import ExportLayer, Heartbeat, Hello, Stop, ToChild, ToSupervisor
from shared.job import parse_job


def _pipe(type_, **kw):
    r, w = os.pipe()
    return Reader(r, type_, **kw), Writer(w, **kw), r, w


def test_round_trip_of_every_child_bound_message():
    """Tagged-union messages decode to the same Structs they were encoded from."""
    job = parse_job({"source": {"path": "s"}, "export": {"scheme": "W4A16", "output": "o"}})
    reader, writer, r, w = _pipe(ToChild)
    msgs = [Hello(version=1, job=job, output="/o", device="cpu"), ExportLayer(index=3, attempt=2, prefetch=4), Stop()]
    for m in msgs:
        writer.send(m)
    assert [reader.recv() for _ in msgs] == msgs


def test_eof_between_frames_is_a_clean_end():
    """Closing the pipe after whole frames raises EndOfStream, not FrameError."""
    reader, writer, r, w = _pipe(ToSupervisor)
    writer.send(Heartbeat(index=1, stage="read"))
    os.close(w)
    assert reader.recv() == Heartbeat(index=1, stage="read")
    with pytest.raises(EndOfStream):
        reader.recv()


def test_eof_inside_a_frame_is_a_protocol_error():
    """A frame cut short by EOF raises FrameError."""
    reader, writer, r, w = _pipe(ToSupervisor)
    writer.send_raw(HEADER.pack(100) + b"\x00" * 10)
    os.close(w)
    with pytest.raises(FrameError, match="inside a frame"):
        reader.recv()


def test_oversized_length_is_refused_without_reading_it():
    """A length prefix over the cap raises FrameError at once (no giant allocation)."""
    reader, writer, r, w = _pipe(ToSupervisor, max_frame=1024)
    writer.send_raw(HEADER.pack(1025))
    with pytest.raises(FrameError, match="exceeds the cap"):
        reader.recv()


def test_sender_refuses_frames_over_the_cap():
    """Writer.send refuses a message whose encoding is over the cap."""
    _, writer, _, _ = _pipe(ToSupervisor, max_frame=64)
    with pytest.raises(FrameError):
        writer.send(Heartbeat(stage="x" * 100))


def test_garbage_and_unknown_tags_are_frame_errors():
    """Undecodable bytes and a valid msgpack object with an unknown tag both raise FrameError."""
    reader, writer, r, w = _pipe(ToSupervisor)
    writer.send_raw(HEADER.pack(2) + b"\xc1\xc1")
    with pytest.raises(FrameError):
        reader.recv()
    bogus = msgspec.msgpack.encode({"type": "Bogus"})
    writer.send_raw(HEADER.pack(len(bogus)) + bogus)
    with pytest.raises(FrameError):
        reader.recv()


def test_partial_frame_times_out_with_a_deadline():
    """A stalled half-frame raises TimeoutError when a timeout is given."""
    reader, writer, r, w = _pipe(ToSupervisor)
    writer.send_raw(HEADER.pack(50) + b"\x00")
    with pytest.raises(TimeoutError):
        reader.recv(timeout=0.2)
