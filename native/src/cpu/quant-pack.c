// quant-pack.c - weight rows and activation rows into gemm-q8.h's interleaved super-blocks.
// Each weight type is first read into natural order (its quants as unsigned integers, the
// scales of its sub-blocks of 16 and groups of 32), then interleaved.
#include <string.h>

#include "cpu/gemm-q8.h"
#include "cpu/quant-blocks.h"
#include "model/types.h"

// Natural order to the lanes of a super-block `width` elements wide (gemm-q8.h): with m lanes
// per sub-block, byte b of vector v takes element 16 * (L / m) + 2 * (m * v + L % m) + b % 2.
static void interleave(uint8_t *dst, const uint8_t *src, int width) {
    const int m = PK_ELEMS / width;
    for (int v = 0; v < width / 32; v++)
        for (int L = 0; L < 16; L++) {
            const int e = 16 * (L / m) + 2 * (m * v + L % m);
            dst[32 * v + 2 * L] = src[e];
            dst[32 * v + 2 * L + 1] = src[e + 1];
        }
}

// A short super-block's scales from sub-block and group order to lane order (gemm-q8.h).
static void spread_weight_scales(pk_weight *o, int width) {
    const int m = PK_ELEMS / width;
    const pk_weight n = *o;
    for (int L = 0; L < 16; L++) { o->sc[L] = n.sc[L / m]; o->mn[L] = n.mn[L / m]; }
    for (int k = 0; k < 8; k++) { o->dw[k] = n.dw[k / m]; o->dm[k] = n.dm[k / m]; }
}

static void spread_act_scales(pk_act *a, int width) {
    const int m = PK_ELEMS / width;
    const pk_act n = *a;
    for (int L = 0; L < 16; L++) a->bsum[L] = L % m == 0 ? n.bsum[L / m] : 0;
    for (int k = 0; k < 8; k++) a->dx[k] = n.dx[k / m];
}

// Each unpack_* fills a packed super-block's scales and its quants in natural order (q), which
// pack_weight_row then interleaves. The 32-element types unpack n_groups blocks: 8, or fewer
// for a row's short last super-block.

// The unit-scale types (gemm-q8.h): x = dw * q - dm per group of 32, sc = mn = 1.
static void unit_scales(pk_weight *o) {
    for (int p = 0; p < 16; p++) o->sc[p] = o->mn[p] = 1;
}

// Q4_0..Q5_1: byte j of qs holds element j in its low nibble, element j + 16 in its high one;
// for Q5, bit j of qh is element j's fifth bit (qh = 0 for Q4).
static void nibble_quants(const uint8_t *qs, uint32_t qh, uint8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

// IQ4_NL's 4-bit indices into iq4_levels, the low nibble of byte j element j, the high one
// element j + 16, as levels shifted by 128.
static void iq4_level_quants(const uint8_t *qs, uint8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)(iq4_levels[qs[j] & 0xF] + 128);
        q[j + 16] = (uint8_t)(iq4_levels[qs[j] >> 4] + 128);
    }
}

// One block of a 32-element type: its factors (x = dw * q - dm) and its 32 quants. Q4_0 and
// Q5_0 centre theirs (q - 8, q - 16); Q4_1 and Q5_1 add an offset m. Q8_0 and IQ4_NL, signed,
// are shifted by 128 into unsigned quants, for the VNNI kernel only: their pairs of products
// overflow AVX2's int16 sums (gemm-q8.h). 0 for another type.
static int unpack_small_block(int32_t type, const void *blk, float *dw, float *dm, uint8_t *q) {
    switch (type) {
    case PYKV_TYPE_Q4_0: { const block_q4_0 *b = blk; *dw = fp16_to_fp32(b->d); *dm = 8.0f * *dw;
                           nibble_quants(b->qs, 0, q); return 1; }
    case PYKV_TYPE_Q4_1: { const block_q4_1 *b = blk; *dw = fp16_to_fp32(b->d); *dm = -fp16_to_fp32(b->m);
                           nibble_quants(b->qs, 0, q); return 1; }
    case PYKV_TYPE_Q5_0: { const block_q5_0 *b = blk; *dw = fp16_to_fp32(b->d); *dm = 16.0f * *dw;
                           nibble_quants(b->qs, q5_high_bits(b->qh), q); return 1; }
    case PYKV_TYPE_Q5_1: { const block_q5_1 *b = blk; *dw = fp16_to_fp32(b->d); *dm = -fp16_to_fp32(b->m);
                           nibble_quants(b->qs, q5_high_bits(b->qh), q); return 1; }
    case PYKV_TYPE_Q8_0: { const block_q8_0 *b = blk; *dw = fp16_to_fp32(b->d); *dm = 128.0f * *dw;
                           for (int j = 0; j < 32; j++) q[j] = (uint8_t)(b->qs[j] + 128);
                           return 1; }
    case PYKV_TYPE_IQ4_NL: { const block_iq4_nl *b = blk; *dw = fp16_to_fp32(b->d); *dm = 128.0f * *dw;
                             iq4_level_quants(b->qs, q); return 1; }
    default: return 0;
    }
}

// IQ4_XS: IQ4_NL's layout per group of 32, with the group's signed 6-bit scale folded into
// its factors as Q4_K's are.
static void unpack_iq4_xs(const block_iq4_xs *b, pk_weight *o, uint8_t *q) {
    unit_scales(o);
    const float d = fp16_to_fp32(b->d);
    for (int g = 0; g < 8; g++) {
        o->dw[g] = d * (float)iq4_xs_scale(b, g);
        o->dm[g] = 128.0f * o->dw[g];
        iq4_level_quants(b->qs + 16 * g, q + 32 * g);
    }
}

// Q2_K, Q3_K, Q6_K: one super-block scale (dw) and min scale (dm) for all eight groups, and
// a scale and min per sub-block of 16 in sc and mn.
static void k_scales(pk_weight *o, float d, float dmin) {
    for (int g = 0; g < 8; g++) { o->dw[g] = d; o->dm[g] = dmin; }
}

// Q4_K and Q5_K: one scale and min per group of 32, so they go into the group's float
// factors (d and dmin are halves and the factors 6-bit integers: the products are exact),
// leaving sc = mn = 1 as the VNNI kernel wants (gemm-q8.h).
static void k4_group_scales(const uint8_t *scales, float d, float dmin, pk_weight *o) {
    unit_scales(o);
    for (int g = 0; g < 8; g++) {
        uint8_t sc, m;
        k4_scale_min(g, scales, &sc, &m);
        o->dw[g] = d * sc;
        o->dm[g] = dmin * m;
    }
}

static void unpack_q4_K(const block_q4_K *b, pk_weight *o, uint8_t *q) {
    k4_group_scales(b->scales, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin), o);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = b->qs[32 * c + l] & 0xF;
            q[64 * c + 32 + l] = b->qs[32 * c + l] >> 4;
        }
}

static void unpack_q5_K(const block_q5_K *b, pk_weight *o, uint8_t *q) {
    k4_group_scales(b->scales, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin), o);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            const uint8_t ql = b->qs[32 * c + l], qh = b->qh[l];
            q[64 * c + l] = (uint8_t)((ql & 0xF) | ((qh >> (2 * c)) & 1) << 4);
            q[64 * c + 32 + l] = (uint8_t)((ql >> 4) | ((qh >> (2 * c + 1)) & 1) << 4);
        }
}

// Q2_K, Q3_K, Q6_K: element 128h + 32r + l (quant-blocks.h's runs), sub-block 8h + 2r + l/16.
// Q3_K and Q6_K centre their quants (q - 4, q - 32): the offset goes into mn, with dm = d.
static void unpack_q6_K(const block_q6_K *b, pk_weight *o, uint8_t *q) {
    const float d = fp16_to_fp32(b->d);
    k_scales(o, d, d);
    for (int p = 0; p < 16; p++) { o->sc[p] = b->scales[p]; o->mn[p] = (int16_t)(32 * b->scales[p]); }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * r + l] = (uint8_t)(q6k_quant(b, h, r, l) + 32);
}

static void unpack_q3_K(const block_q3_K *b, pk_weight *o, uint8_t *q) {
    const float d = fp16_to_fp32(b->d);
    k_scales(o, d, d);
    for (int p = 0; p < 16; p++) { o->sc[p] = (int16_t)q3_scale(b->scales, p); o->mn[p] = (int16_t)(4 * o->sc[p]); }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * r + l] = (uint8_t)(q3k_quant(b, h, r, l) + 4);
}

static void unpack_q2_K(const block_q2_K *b, pk_weight *o, uint8_t *q) {
    k_scales(o, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin));
    for (int p = 0; p < 16; p++) { o->sc[p] = b->scales[p] & 0xF; o->mn[p] = b->scales[p] >> 4; }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * r + l] = (uint8_t)q2k_quant(b->qs, h, r, l);
}

// The largest quant a type's unpacked form holds; 0 for a type that is not packed.
static int largest_quant(int32_t type) {
    switch (type) {
    case PYKV_TYPE_Q2_K: return 3;
    case PYKV_TYPE_Q3_K: return 7;
    case PYKV_TYPE_Q4_0: case PYKV_TYPE_Q4_1: case PYKV_TYPE_Q4_K: return 15;
    case PYKV_TYPE_Q5_0: case PYKV_TYPE_Q5_1: case PYKV_TYPE_Q5_K: return 31;
    case PYKV_TYPE_Q6_K: return 63;
    case PYKV_TYPE_IQ4_NL: case PYKV_TYPE_IQ4_XS: return 113 + 128;
    case PYKV_TYPE_Q8_0: return 127 + 128;
    default: return 0;
    }
}

int gemm_q8_unit_scales(int32_t type) {
    switch (type) {
    case PYKV_TYPE_Q4_0: case PYKV_TYPE_Q4_1: case PYKV_TYPE_Q5_0: case PYKV_TYPE_Q5_1: case PYKV_TYPE_Q8_0:
    case PYKV_TYPE_Q4_K: case PYKV_TYPE_Q5_K: case PYKV_TYPE_IQ4_NL: case PYKV_TYPE_IQ4_XS: return 1;
    default: return 0;
    }
}

// Any row of whole blocks: a K-quant row is whole super-blocks, a row of a 32-element type
// may end in a short one. The 8-bit types only where the VNNI kernel runs.
int gemm_q8_supports(int32_t type, int64_t cols) {
    return cols > 0 && largest_quant(type) > 0 && type_row_bytes(type, cols) > 0 &&
           (gemm_q8_run(type) > 0 || gemm_q8_has_vnni());
}

int gemm_q8_run(int32_t type) {
    const int qmax = largest_quant(type);
    if (!qmax) return 0;
    const int run = 32767 / (2 * 127 * qmax);
    return run > 8 ? 8 : run;
}

// A super-block of a 32-element type: n_groups of its blocks. 0 for another type.
static int unpack_small_blocks(int32_t type, const uint8_t *src, pk_weight *o, uint8_t *q, int n_groups) {
    const int64_t block_bytes = type_row_bytes(type, 32);
    unit_scales(o);
    for (int g = 0; g < n_groups; g++)
        if (!unpack_small_block(type, src + g * block_bytes, &o->dw[g], &o->dm[g], q + 32 * g)) return 0;
    return 1;
}

// A super-block of a type of 256-element blocks. 0 for another type.
static int unpack_super_block(int32_t type, const uint8_t *src, pk_weight *o, uint8_t *q) {
    switch (type) {
    case PYKV_TYPE_Q2_K: unpack_q2_K((const block_q2_K *)src, o, q); return 1;
    case PYKV_TYPE_Q3_K: unpack_q3_K((const block_q3_K *)src, o, q); return 1;
    case PYKV_TYPE_Q4_K: unpack_q4_K((const block_q4_K *)src, o, q); return 1;
    case PYKV_TYPE_Q5_K: unpack_q5_K((const block_q5_K *)src, o, q); return 1;
    case PYKV_TYPE_Q6_K: unpack_q6_K((const block_q6_K *)src, o, q); return 1;
    case PYKV_TYPE_IQ4_XS: unpack_iq4_xs((const block_iq4_xs *)src, o, q); return 1;
    default: return 0;
    }
}

void pack_weight_row(int32_t type, const void *row, pk_weight *out, int64_t cols) {
    const int64_t bytes = type_row_bytes(type, PK_ELEMS);
    const uint8_t *src = row;
    int64_t s = 0;
    for (; s < cols / PK_ELEMS; s++, src += bytes) {
        uint8_t q[PK_ELEMS];
        if (!unpack_small_blocks(type, src, out + s, q, 8) && !unpack_super_block(type, src, out + s, q)) return;
        interleave(out[s].q, q, PK_ELEMS);
    }
    const int tail = (int)(cols % PK_ELEMS);   // a short last super-block, zero-padded
    if (tail == 0) return;
    uint8_t q[PK_ELEMS] = { 0 };
    memset(out + s, 0, sizeof *out);
    if (!unpack_small_blocks(type, src, out + s, q, tail / 32)) return;
    spread_weight_scales(out + s, pk_tail_width(tail));
    interleave(out[s].q, q, pk_tail_width(tail));
}

// One super-block of activations, `n` elements of it real (a short block is zero-padded).
static void pack_act_block(const float *x, int n, pk_act *a) {
    const int width = pk_tail_width(n);   // 256 for a whole one
    block_q8_act b[Q8_ACT_BLOCKS(PK_ELEMS)];
    uint8_t natural[PK_ELEMS] = { 0 };
    memset(a, 0, sizeof *a);
    quantize_row_q8_act(x, b, n);   // n is a multiple of 32
    const q8_act_side side = q8_side(b, n);
    for (int g = 0; g < n / 32; g++) {
        a->dx[g] = b[g].d;
        memcpy(natural + 32 * g, b[g].qs, 32);
    }
    for (int p = 0; p < n / 16; p++) a->bsum[p] = side.sum16[p];   // the padding's stay 0
    if (width < PK_ELEMS) spread_act_scales(a, width);
    interleave((uint8_t *)a->q, natural, width);
}

void pack_act_rows(const float *x, int T, int64_t cols, pk_act *out) {
    const int64_t n_blocks = pk_blocks(cols);
    for (int t = 0; t < T; t++)
        for (int64_t s = 0; s < n_blocks; s++) {
            const int64_t n = cols - s * PK_ELEMS < PK_ELEMS ? cols - s * PK_ELEMS : PK_ELEMS;
            pack_act_block(x + t * cols + s * PK_ELEMS, (int)n, out + t * n_blocks + s);
        }
}
