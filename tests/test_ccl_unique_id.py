"""oneCCL's unique id travels whole: it is 4096 binary bytes, NULs included (no oneCCL needed)."""
import ctypes

import pytest

from hpcdl.comm.ccl import UNIQUE_ID_BYTES, _UniqueId, unique_id_from_bytes, unique_id_to_bytes


def an_id_with_nul_bytes() -> _UniqueId:
    raw = bytes((i * 7) % 256 for i in range(UNIQUE_ID_BYTES))  # a NUL at 0, 256, 512, ...
    assert raw[0] == 0 and raw[1:4] != b"\0\0\0"
    return _UniqueId.from_buffer_copy(raw)


def test_an_id_with_nul_bytes_is_sent_whole_and_rebuilt_byte_for_byte():
    uid = an_id_with_nul_bytes()
    sent = unique_id_to_bytes(uid)
    assert len(sent) == UNIQUE_ID_BYTES
    rebuilt = unique_id_from_bytes(sent)
    assert ctypes.string_at(ctypes.addressof(rebuilt), UNIQUE_ID_BYTES) == \
        ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


def test_a_short_id_is_refused_not_read_past_its_end():
    with pytest.raises(RuntimeError, match="unique id of 17 bytes, expected 4096"):
        unique_id_from_bytes(b"x" * 17)
