"""The GGUF header reader against crafted files: every claimed length is checked against
the bytes left, so none of these hangs, allocates what it claims, or escapes as
anything but a one-line BadInput (issue 12)."""

from __future__ import annotations

import struct
import time

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.sizing.gguf import read_gguf_header

HEAD = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"  # one key/value pair, key "k"


def _crafted(tmp_path, body: bytes):
    p = tmp_path / "crafted.gguf"
    p.write_bytes(HEAD + body)
    return p


CASES = {
    # array of 2^60 arrays of 2^62 uint8: the old reader seeked over each inner array forever
    "nested arrays, 61 bytes": struct.pack("<I", 9) + struct.pack("<IQ", 9, 2**60) + struct.pack("<IQ", 0, 2**62),
    "string claiming 2^60 bytes": struct.pack("<I", 8) + struct.pack("<Q", 2**60),
    "array of 2^63 strings": struct.pack("<I", 9) + struct.pack("<IQ", 8, 2**63),
    "array of 2^62 uint64": struct.pack("<I", 9) + struct.pack("<IQ", 10, 2**62),
    "arrays nested 10 deep": struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(10)),
    "unknown value type": struct.pack("<I", 99),
    "truncated value": struct.pack("<I", 4) + b"\x01",
}


@pytest.mark.parametrize("name", list(CASES))
def test_crafted_header_fails_fast_with_one_line(tmp_path, name):
    path = _crafted(tmp_path, CASES[name])
    t0 = time.perf_counter()
    with pytest.raises(BadInput) as e:
        read_gguf_header(path)
    assert time.perf_counter() - t0 < 1.0
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_61_byte_file_is_61_bytes(tmp_path):
    assert _crafted(tmp_path, CASES["nested arrays, 61 bytes"]).stat().st_size == 61


def test_kv_count_beyond_the_file_is_refused(tmp_path):
    p = tmp_path / "many.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62))
    with pytest.raises(BadInput, match="key/value pairs"):
        read_gguf_header(p)


def test_long_string_array_is_skipped_not_kept(tmp_path):
    strings = [b"x" * (i % 7) for i in range(5000)] + [b"y" * (3 << 20)]  # one string longer than a buffer
    body = struct.pack("<I", 9) + struct.pack("<IQ", 8, len(strings))
    body += b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    body += b"tail"
    p = _crafted(tmp_path, body)
    h = read_gguf_header(p)
    assert h.metadata["k"].length == len(strings) and h.metadata_end == p.stat().st_size - 4
