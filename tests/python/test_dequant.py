"""pykv_dequantize against the gguf package's own dequantizer (gguf.quants.dequantize).

Every type is checked on rows built two ways: gguf.quants.quantize of random floats where
gguf can quantize that type, and random bytes with finite f16 scale fields (which reach
every bit pattern of the quants, including ones the quantizer never writes). Both sides
compute in float32 with the same operations in the same order, so results must be equal
bit for bit: the tolerance is zero.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pykv._ffi import ffi, lib

TYPES = {
    "F32": lib.PYKV_TYPE_F32, "F16": lib.PYKV_TYPE_F16, "BF16": lib.PYKV_TYPE_BF16,
    "Q8_0": lib.PYKV_TYPE_Q8_0, "Q4_0": lib.PYKV_TYPE_Q4_0, "Q4_1": lib.PYKV_TYPE_Q4_1,
    "Q5_0": lib.PYKV_TYPE_Q5_0, "Q5_1": lib.PYKV_TYPE_Q5_1, "Q2_K": lib.PYKV_TYPE_Q2_K,
    "Q3_K": lib.PYKV_TYPE_Q3_K, "Q4_K": lib.PYKV_TYPE_Q4_K, "Q5_K": lib.PYKV_TYPE_Q5_K,
    "Q6_K": lib.PYKV_TYPE_Q6_K, "IQ4_NL": lib.PYKV_TYPE_IQ4_NL, "IQ4_XS": lib.PYKV_TYPE_IQ4_XS,
}
QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Byte offsets of the f16 scale fields in each block (ggml's block_* structs).
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def block_size(name):
    return GGML_QUANT_SIZES[Q[name]]


def pykv_dequant(name, raw, n):
    out = np.empty(n, dtype=np.float32)
    status = lib.pykv_dequantize(TYPES[name], ffi.from_buffer(raw), n, ffi.from_buffer("float[]", out))
    assert status == lib.PYKV_OK, ffi.string(lib.pykv_last_error()).decode()
    return out


def random_blocks(name, n, rng):
    """Random bytes for n elements, with finite f16 scales written over the scale fields."""
    bs, bb = block_size(name)
    raw = rng.integers(0, 256, size=(n // bs, bb), dtype=np.uint8)
    if name in F16_FIELDS:
        for off in F16_FIELDS[name]:
            scales = rng.uniform(-0.5, 0.5, size=n // bs).astype(np.float16)
            raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    elif name == "F32":
        raw = rng.standard_normal(n).astype(np.float32).view(np.uint8)
    else:  # F16, BF16: any bit pattern but inf/NaN (exponent bits all ones)
        bits = raw.reshape(-1).view(np.uint16)
        exp_mask = np.uint16(0x7C00 if name == "F16" else 0x7F80)
        raw = np.where(bits & exp_mask == exp_mask, bits & ~exp_mask, bits).astype(np.uint16).view(np.uint8)
    return np.ascontiguousarray(raw).reshape(-1)


def assert_same(got, want):
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def row_length(name):
    return 1536 if block_size(name)[0] == 256 else 576


@pytest.mark.parametrize("name", list(TYPES))
def test_random_blocks_match_gguf(name):
    rng = np.random.default_rng(1234 + TYPES[name])
    n = row_length(name)
    for _ in range(4):
        raw = random_blocks(name, n, rng)
        assert_same(pykv_dequant(name, raw, n), dequantize(raw, Q[name]))


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_rows_match_gguf(name):
    rng = np.random.default_rng(99 + TYPES[name])
    n = row_length(name)
    data = (rng.standard_normal((3, n)) * rng.uniform(0.01, 3.0, size=(3, 1))).astype(np.float32)
    data[1, :32] = 0.0                     # an all-zero block (d = 0)
    data[2] = np.abs(data[2])              # one-signed blocks (Q4_1/Q5_1 min at zero side)
    packed = quantize(data, Q[name])
    raw = np.ascontiguousarray(packed).view(np.uint8).reshape(3, -1)
    for row in raw:
        assert_same(pykv_dequant(name, row, n), dequantize(row, Q[name]))


def test_odd_address_source():
    rng = np.random.default_rng(7)
    for name in TYPES:
        n = row_length(name)
        raw = random_blocks(name, n, rng)
        shifted = np.empty(raw.size + 1, dtype=np.uint8)
        shifted[1:] = raw
        assert_same(pykv_dequant(name, shifted[1:], n), dequantize(raw, Q[name]))


def test_block_traits_match_gguf():
    for name, t in TYPES.items():
        bs, bb = block_size(name)
        assert lib.pykv_type_block_size(t) == bs
        assert lib.pykv_type_block_bytes(t) == bb
        assert ffi.string(lib.pykv_type_name(t)).decode() == name.lower()


def error_text():
    return ffi.string(lib.pykv_last_error()).decode()


def test_unknown_type():
    out = np.empty(32, dtype=np.float32)
    src = np.zeros(64, dtype=np.uint8)
    for bad in (99, 4, -1):          # 4 is a retired ggml type number
        assert lib.pykv_dequantize(bad, ffi.from_buffer(src), 32, ffi.from_buffer("float[]", out)) == lib.PYKV_ERR_UNSUPPORTED
        assert "type" in error_text() and str(bad) in error_text()


def test_partial_block():
    out = np.empty(512, dtype=np.float32)
    src = np.zeros(512, dtype=np.uint8)
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q4_0, ffi.from_buffer(src), 33, ffi.from_buffer("float[]", out)) \
        == lib.PYKV_ERR_INVALID_ARG
    assert "33" in error_text() and "q4_0" in error_text() and "block size 32" in error_text()
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q6_K, ffi.from_buffer(src), 300, ffi.from_buffer("float[]", out)) \
        == lib.PYKV_ERR_INVALID_ARG
    assert "block size 256" in error_text()
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q8_0, ffi.from_buffer(src), -32, ffi.from_buffer("float[]", out)) \
        == lib.PYKV_ERR_INVALID_ARG


def test_null_pointers():
    out = np.empty(32, dtype=np.float32)
    src = np.zeros(64, dtype=np.uint8)
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q8_0, ffi.NULL, 32, ffi.from_buffer("float[]", out)) == lib.PYKV_ERR_INVALID_ARG
    assert "NULL src" in error_text()
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q8_0, ffi.from_buffer(src), 32, ffi.NULL) == lib.PYKV_ERR_INVALID_ARG
    assert "NULL dst" in error_text()
    assert lib.pykv_dequantize(lib.PYKV_TYPE_Q8_0, ffi.NULL, 0, ffi.NULL) == lib.PYKV_OK
