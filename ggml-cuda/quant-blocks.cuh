// quant-blocks.cuh - the GGUF weight blocks on the device: their layouts (bit for bit those of
// native/src/cpu/quant-blocks.h), the decoding of one 32-value group of a block into small
// integers and scales, and the integer dot product of such a group with 32 int8 activations.
// Everything here is __host__ __device__, so tests/c/test_cuda_blocks.cu checks the same code
// on the CPU against pykv_dequantize.
//
// A group is 32 consecutive values of a row: a whole block of the 32-value types, one eighth
// of a K-quant super-block of 256. Every type's group is read into the same form (qgroup):
// 32 signed 8-bit quants q, four to an int32, and value j = d[j / 16] * q[j] + m. The types
// that centre their quants (Q4_0, Q5_0, Q6_K) have them centred here, so only Q4_1, Q5_1,
// Q4_K and Q5_K have an m; the rest carry m = -0.0f, which leaves d * q's bits unchanged
// (-0.0f is the identity of IEEE addition), so decoding matches the CPU's bit for bit.
//
// Alignment: weight rows start 2-byte aligned, 4-byte aligned for Q4_1, Q5_1, Q4_K and Q5_K
// (whose blocks are a multiple of 4 bytes long); GGUF tensor data and cudaMalloc memory are.
// Arrays of activation blocks (dev_block_q8_1) are 4-byte aligned.
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.cuh"

// ---- the blocks (f16 fields as raw bits; every struct has 2-byte alignment) ----

struct dev_block_q4_0 { uint16_t d; uint8_t qs[16]; };
struct dev_block_q4_1 { uint16_t d, m; uint8_t qs[16]; };
struct dev_block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct dev_block_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct dev_block_q8_0 { uint16_t d; int8_t qs[32]; };
struct dev_block_q4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct dev_block_q5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct dev_block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

// The sizes the CPU's structs assert (quant-blocks.h); test_cuda_blocks compares them too.
static_assert(sizeof(dev_block_q4_0) == 18, "q4_0 layout");
static_assert(sizeof(dev_block_q4_1) == 20, "q4_1 layout");
static_assert(sizeof(dev_block_q5_0) == 22, "q5_0 layout");
static_assert(sizeof(dev_block_q5_1) == 24, "q5_1 layout");
static_assert(sizeof(dev_block_q8_0) == 34, "q8_0 layout");
static_assert(sizeof(dev_block_q4_K) == 144, "q4_K layout");
static_assert(sizeof(dev_block_q5_K) == 176, "q5_K layout");
static_assert(sizeof(dev_block_q6_K) == 210, "q6_K layout");

// 32 activations quantised to 8 bits (the CPU's block_q8_act, without its side arrays):
// x[j] ~ d * qs[j], s = d * sum(qs). 40 bytes, so blocks stay 4-byte aligned in an array.
struct dev_block_q8_1 { float d; float s; int8_t qs[32]; };
static_assert(sizeof(dev_block_q8_1) == 40, "q8_1 layout");

// One group of 32 weights: value j = d[j / 16] * (int8)(byte j % 4 of q[j / 4]) + m.
struct qgroup {
    int32_t q[8];
    float   d[2];
    float   m;
};

// ---- small portable helpers ----

// `#pragma unroll` for the device pass only (the host compiler does not know it).
#ifdef __CUDA_ARCH__
#define QB_UNROLL _Pragma("unroll")
#else
#define QB_UNROLL
#endif

// 4 bytes at p as a little-endian word; p is 2-byte aligned (all the block fields are).
static __host__ __device__ __forceinline__ uint32_t ld_u32_a2(const uint8_t *p) {
#ifdef __CUDA_ARCH__
    const uint16_t *h = (const uint16_t *)p;
    return (uint32_t)h[0] | (uint32_t)h[1] << 16;
#else
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}

// A T at p, where p is aligned for T: one load on the device (the host reads any p).
template <class T>
static __host__ __device__ __forceinline__ T ld_aligned(const uint8_t *p) {
#ifdef __CUDA_ARCH__
    return *(const T *)p;
#else
    T v;
    memcpy(&v, p, sizeof(v));
    return v;
#endif
}

// ld_u32_a2 where p is 4-byte aligned (the quants of Q4_1, Q5_1, Q4_K and Q5_K blocks).
static __host__ __device__ __forceinline__ uint32_t ld_u32_a4(const uint8_t *p) { return ld_aligned<uint32_t>(p); }
static __host__ __device__ __forceinline__ uint16_t ld_u16(const uint8_t *p) { return ld_aligned<uint16_t>(p); }

static __host__ __device__ __forceinline__ float f16_at(const uint8_t *p) { return f16_bits_to_float(ld_u16(p)); }

static __host__ __device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// sum over the 4 bytes of sign-extended a[i] * b[i], plus c.
static __host__ __device__ __forceinline__ int dp4a(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
#endif
}

// Byte-wise a - b, each byte on its own (no borrow between bytes).
static __host__ __device__ __forceinline__ uint32_t vsub4(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __vsub4(a, b);
#else
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)(uint8_t)((a >> (8 * i)) - (b >> (8 * i))) << (8 * i);
    return r;
#endif
}

// Bits 0..3 of b to bit 4 of bytes 0..3 (the fifth bit of 4 consecutive Q5 quants).
static __host__ __device__ __forceinline__ uint32_t spread4_bit4(uint32_t b) {
    return (b & 1u) << 4 | (b & 2u) << 11 | (b & 4u) << 18 | (b & 8u) << 25;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block (the CPU's k4_scale_min):
// bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3 (low 6 bits); sub-blocks 4-7 take their low 4
// bits from bytes 8-11 and their top 2 bits from the top bits of bytes 0-7.
static __host__ __device__ __forceinline__ void k4_scale_min_dev(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m  = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m  = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ---- one group of each type ----
// Each type is a struct: QK values per block of BYTES bytes, GROUPS = QK / 32 groups per block,
// and unpack(blk, g, w): group g (0..GROUPS-1) of the block at blk into w.

// Q4_0/Q4_1 (and the low bits of Q5_0/Q5_1): byte j of qs holds value j in its low nibble and
// value j + 16 in its high one, so word k of qs gives values 4k..4k+3 (low nibbles) and
// 16+4k..16+4k+3 (high nibbles).
template <int A4>
static __host__ __device__ __forceinline__ void unpack_nibbles16(const uint8_t *qs, int32_t q[8]) {
QB_UNROLL
    for (int k = 0; k < 4; k++) {
        const uint32_t v = A4 ? ld_u32_a4(qs + 4 * k) : ld_u32_a2(qs + 4 * k);
        q[k]     = (int32_t)(v & 0x0F0F0F0Fu);
        q[k + 4] = (int32_t)((v >> 4) & 0x0F0F0F0Fu);
    }
}

// Q5_0/Q5_1: bit j of the little-endian word qh is value j's fifth bit.
template <int A4>
static __host__ __device__ __forceinline__ void add_fifth_bits(const uint8_t *qh, int32_t q[8]) {
    const uint32_t h = A4 ? ld_u32_a4(qh) : ld_u32_a2(qh);
QB_UNROLL
    for (int k = 0; k < 8; k++) q[k] |= (int32_t)spread4_bit4(h >> (4 * k));
}

static __host__ __device__ __forceinline__ void centre(int32_t q[8], uint32_t by) {
QB_UNROLL
    for (int k = 0; k < 8; k++) q[k] = (int32_t)vsub4((uint32_t)q[k], by);
}

// Q4_0, Q4_1, Q5_0 and Q5_1: a block of 32 values is an f16 d, an f16 m (the _1 types), the
// fifth bits qh (the Q5 types, 4 bytes) and 16 bytes of nibbles. The _0 types centre their
// quants (by 8, or 16 with a fifth bit); the _1 types have m instead, and their blocks (20
// and 24 bytes) are the 4-byte aligned ones.
template <int TYPE_, int HAS_M, int HAS_QH>
struct qt_nibbles {
    enum { TYPE = TYPE_, QK = 32, BYTES = 2 + 2 * HAS_M + 4 * HAS_QH + 16, GROUPS = 1 };
    static __host__ __device__ __forceinline__ void unpack(const uint8_t *blk, int, qgroup &w) {
        const uint8_t *qh = blk + 2 + 2 * HAS_M;
        unpack_nibbles16<HAS_M>(qh + 4 * HAS_QH, w.q);
        if constexpr (HAS_QH) add_fifth_bits<HAS_M>(qh, w.q);
        if constexpr (!HAS_M) centre(w.q, HAS_QH ? 0x10101010u : 0x08080808u);
        w.d[0] = w.d[1] = f16_at(blk);
        w.m = HAS_M ? f16_at(blk + 2) : -0.0f;
    }
};

// Named types (not aliases), so that the kernels instantiated for them keep their names.
struct qt_q4_0 : qt_nibbles<PYKV_TYPE_Q4_0, 0, 0> {};
struct qt_q4_1 : qt_nibbles<PYKV_TYPE_Q4_1, 1, 0> {};
struct qt_q5_0 : qt_nibbles<PYKV_TYPE_Q5_0, 0, 1> {};
struct qt_q5_1 : qt_nibbles<PYKV_TYPE_Q5_1, 1, 1> {};
static_assert(qt_q4_0::BYTES == 18 && qt_q4_1::BYTES == 20 && qt_q5_0::BYTES == 22 && qt_q5_1::BYTES == 24,
              "the nibble types' block sizes");

struct qt_q8_0 {
    enum { TYPE = PYKV_TYPE_Q8_0, QK = 32, BYTES = 34, GROUPS = 1 };
    static __host__ __device__ __forceinline__ void unpack(const uint8_t *blk, int, qgroup &w) {
QB_UNROLL
        for (int k = 0; k < 8; k++) w.q[k] = (int32_t)ld_u32_a2(blk + 2 + 4 * k);
        w.d[0] = w.d[1] = f16_at(blk);
        w.m = -0.0f;
    }
};

// Q4_K/Q5_K: group g is sub-block g; chunk g / 2 of 32 bytes of qs holds sub-block 2c in its
// low nibbles and 2c + 1 in its high ones (byte l: value l of each). Q5_K's fifth bit of value
// l of sub-block g is bit g of qh[l]. value = d*scale_g * q - dmin*min_g.
static __host__ __device__ __forceinline__ void unpack_k4(const uint8_t *blk, const uint8_t *qs, const uint8_t *qh,
                                                        int g, qgroup &w) {
    const int shift = 4 * (g & 1);
    qs += 32 * (g >> 1);
QB_UNROLL
    for (int k = 0; k < 8; k++) {
        uint32_t v = (ld_u32_a4(qs + 4 * k) >> shift) & 0x0F0F0F0Fu;
        if (qh) v |= ((ld_u32_a4(qh + 4 * k) >> g) & 0x01010101u) << 4;
        w.q[k] = (int32_t)v;
    }
    int sc, mn;
    k4_scale_min_dev(g, blk + 4, &sc, &mn);
    w.d[0] = w.d[1] = f16_at(blk) * (float)sc;
    w.m = -(f16_at(blk + 2) * (float)mn);
}

struct qt_q4_K {
    enum { TYPE = PYKV_TYPE_Q4_K, QK = 256, BYTES = 144, GROUPS = 8 };
    static __host__ __device__ __forceinline__ void unpack(const uint8_t *blk, int g, qgroup &w) {
        unpack_k4(blk, blk + 16, (const uint8_t *)0, g, w);
    }
};

struct qt_q5_K {
    enum { TYPE = PYKV_TYPE_Q5_K, QK = 256, BYTES = 176, GROUPS = 8 };
    static __host__ __device__ __forceinline__ void unpack(const uint8_t *blk, int g, qgroup &w) {
        unpack_k4(blk, blk + 48, blk + 16, g, w);
    }
};

// Q6_K: group g = 4h + r is run r (0..3) of half h (0..1): value l (0..31) has its low 4 bits
// in the low (r < 2) or high (r >= 2) nibble of ql[64h + 32(r & 1) + l] and its top 2 bits at
// bits 2r..2r+1 of qh[32h + l], minus 32; values 0-15 and 16-31 are sub-blocks 8h + 2r and
// 8h + 2r + 1, each with an int8 scale.
struct qt_q6_K {
    enum { TYPE = PYKV_TYPE_Q6_K, QK = 256, BYTES = 210, GROUPS = 8 };
    static __host__ __device__ __forceinline__ void unpack(const uint8_t *blk, int g, qgroup &w) {
        const int h = g >> 2, r = g & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (r & 1);
        const uint8_t *qh = blk + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(blk + 192);
QB_UNROLL
        for (int k = 0; k < 8; k++) {
            const uint32_t lo = (ld_u32_a2(ql + 4 * k) >> (4 * (r >> 1))) & 0x0F0F0F0Fu;
            const uint32_t hi = ((ld_u32_a2(qh + 4 * k) >> (2 * r)) & 0x03030303u) << 4;
            w.q[k] = (int32_t)vsub4(lo | hi, 0x20202020u);
        }
        const float d = f16_at(blk + 208);
        w.d[0] = d * (float)scales[8 * h + 2 * r];
        w.d[1] = d * (float)scales[8 * h + 2 * r + 1];
        w.m = -0.0f;
    }
};

// The group's 32 values as floats (the CPU's dequantisation, bit for bit).
static __host__ __device__ __forceinline__ void qgroup_decode(const qgroup &w, float y[32]) {
QB_UNROLL
    for (int k = 0; k < 8; k++) {
        const float d = w.d[k >> 2];
QB_UNROLL
        for (int i = 0; i < 4; i++) y[4 * k + i] = d * (float)(int8_t)(w.q[k] >> (8 * i)) + w.m;
    }
}

// A whole block of type Q (QK values) as floats.
template <class Q>
static __host__ __device__ __forceinline__ void block_decode(const uint8_t *blk, float *y) {
    for (int g = 0; g < Q::GROUPS; g++) {
        qgroup w;
        Q::unpack(blk, g, w);
        qgroup_decode(w, y + 32 * g);
    }
}

// sum_j value_j * a.d * a.qs[j]: the integer sums of each half of 16 (each with its own d),
// scaled by the activations' d, plus m times the activations' sum s.
static __host__ __device__ __forceinline__ float qgroup_dot_q8_1(const qgroup &w, const int32_t a[8], float ad, float as) {
    int lo = 0, hi = 0;
QB_UNROLL
    for (int k = 0; k < 4; k++) {
        lo = dp4a(w.q[k], a[k], lo);
        hi = dp4a(w.q[k + 4], a[k + 4], hi);
    }
    return ad * (w.d[0] * (float)lo + w.d[1] * (float)hi) + w.m * as;
}

// The 8 words of an activation block's quants (blocks are 4-byte aligned).
static __host__ __device__ __forceinline__ void q8_1_words(const dev_block_q8_1 *a, int32_t out[8]) {
#ifdef __CUDA_ARCH__
    const int32_t *p = (const int32_t *)a->qs;
QB_UNROLL
    for (int k = 0; k < 8; k++) out[k] = p[k];
#else
    memcpy(out, a->qs, 32);
#endif
}

// ---- activations to Q8_1 ----

// The steps of quantising a block, shared by the one-thread quantiser below and the
// one-warp one (norm-quant.cuh), so that both give the same bits. The divisions are the
// correctly rounded ones also under --use_fast_math.
// The block's step d = amax / 127 and its inverse (0 where 1 / d would overflow).
static __host__ __device__ __forceinline__ void q8_1_scale(float amax, float *d, float *id) {
#ifdef __CUDA_ARCH__
    *d = __fdiv_rn(amax, 127.0f);
    *id = *d >= FLT_MIN ? __frcp_rn(*d) : 0.0f;
#else
    *d = amax / 127.0f;
    *id = *d >= FLT_MIN ? 1.0f / *d : 0.0f;
#endif
}

// One value's quant: round-to-nearest-even(x * id).
static __host__ __device__ __forceinline__ int q8_1_round(float x, float id) {
#ifdef __CUDA_ARCH__
    return __float2int_rn(x * id);
#else
    return (int)nearbyintf(x * id);
#endif
}

// 32 activations into a block, as the CPU's quantize_row_q8_act_scalar (same bits): d =
// max|x| / 127, q = round-to-nearest-even(x / d); a block with an inf or a NaN gets zero quants
// and a NaN d and s, so its products come out NaN.
static __host__ __device__ __forceinline__ void q8_1_quantize_block(const float *x, dev_block_q8_1 *y) {
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < 32; j++) {
        finite = finite && isfinite(x[j]);
        amax = fmaxf(amax, fabsf(x[j]));
    }
    if (!finite) {
        for (int j = 0; j < 32; j++) y->qs[j] = 0;
        y->d = y->s = NAN;
        return;
    }
    float d, id;
    q8_1_scale(amax, &d, &id);
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        const int q = q8_1_round(x[j], id);
        y->qs[j] = (int8_t)q;
        sum += q;
    }
    y->d = d;
    y->s = d * (float)sum;
}

// ---- the float weight types (any row length) ----

static __host__ __device__ __forceinline__ float weight_f32_at(const void *row, int64_t c) { return ((const float *)row)[c]; }
static __host__ __device__ __forceinline__ float weight_f16_at(const void *row, int64_t c) {
    return f16_bits_to_float(((const uint16_t *)row)[c]);
}
static __host__ __device__ __forceinline__ float weight_bf16_at(const void *row, int64_t c) {
    return bf16_bits_to_float(((const uint16_t *)row)[c]);
}

struct ft_f32  { enum { TYPE = PYKV_TYPE_F32,  ELEM_BYTES = 4 }; static __host__ __device__ __forceinline__ float at(const void *r, int64_t c) { return weight_f32_at(r, c); } };
struct ft_f16  { enum { TYPE = PYKV_TYPE_F16,  ELEM_BYTES = 2 }; static __host__ __device__ __forceinline__ float at(const void *r, int64_t c) { return weight_f16_at(r, c); } };
struct ft_bf16 { enum { TYPE = PYKV_TYPE_BF16, ELEM_BYTES = 2 }; static __host__ __device__ __forceinline__ float at(const void *r, int64_t c) { return weight_bf16_at(r, c); } };

// ---- run-time dispatch (tests and the launchers' switches) ----

// Bytes of a row of `cols` values of `type`, 0 for a type the kernels do not take.
static __host__ __device__ inline int64_t qtype_row_bytes(int32_t type, int64_t cols) {
    switch (type) {
    case PYKV_TYPE_F32:  return cols * 4;
    case PYKV_TYPE_F16:  return cols * 2;
    case PYKV_TYPE_BF16: return cols * 2;
    case PYKV_TYPE_Q4_0: return cols / qt_q4_0::QK * qt_q4_0::BYTES;
    case PYKV_TYPE_Q4_1: return cols / qt_q4_1::QK * qt_q4_1::BYTES;
    case PYKV_TYPE_Q5_0: return cols / qt_q5_0::QK * qt_q5_0::BYTES;
    case PYKV_TYPE_Q5_1: return cols / qt_q5_1::QK * qt_q5_1::BYTES;
    case PYKV_TYPE_Q8_0: return cols / qt_q8_0::QK * qt_q8_0::BYTES;
    case PYKV_TYPE_Q4_K: return cols / qt_q4_K::QK * qt_q4_K::BYTES;
    case PYKV_TYPE_Q5_K: return cols / qt_q5_K::QK * qt_q5_K::BYTES;
    case PYKV_TYPE_Q6_K: return cols / qt_q6_K::QK * qt_q6_K::BYTES;
    default:             return 0;
    }
}

// Group gi (values 32gi..32gi+31) of a row of a quantised type into w; 0 for a float or
// unknown type.
static __host__ __device__ inline int qgroup_unpack(int32_t type, const void *row, int64_t gi, qgroup &w) {
    const uint8_t *r = (const uint8_t *)row;
#define QG_CASE(Q) case Q::TYPE: Q::unpack(r + gi / Q::GROUPS * Q::BYTES, (int)(gi % Q::GROUPS), w); return 1;
    switch (type) {
    QG_CASE(qt_q4_0) QG_CASE(qt_q4_1) QG_CASE(qt_q5_0) QG_CASE(qt_q5_1) QG_CASE(qt_q8_0)
    QG_CASE(qt_q4_K) QG_CASE(qt_q5_K) QG_CASE(qt_q6_K)
    default: return 0;
    }
#undef QG_CASE
}
