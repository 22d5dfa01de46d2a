// quant-pack.c - weight rows and activation rows into gemm-q8.h's interleaved super-blocks.
// Each weight type is first read into natural order (its quants as unsigned integers, the
// scales of its sub-blocks of 16 and groups of 32), then interleaved.
#include <string.h>

#include "gemm-q8.h"
#include "quant-blocks.h"
#include "types.h"

// Element 16p + w (sub-block p, 0..15; w 0..15) goes to byte 32 * (w / 2) + 2p + w % 2.
static void interleave(uint8_t *dst, const uint8_t *src) {
    for (int p = 0; p < 16; p++)
        for (int w = 0; w < 16; w += 2) {
            dst[16 * w + 2 * p] = src[16 * p + w];
            dst[16 * w + 2 * p + 1] = src[16 * p + w + 1];
        }
}

// The natural-order contents of one super-block before interleaving.
struct unpacked {
    uint8_t q[PK_ELEMS];
    float   dw[8], dm[8];
    int16_t sc[16], mn[16];
};

static void store(pk_weight *o, const struct unpacked *u) {
    memcpy(o->dw, u->dw, sizeof o->dw);
    memcpy(o->dm, u->dm, sizeof o->dm);
    memcpy(o->sc, u->sc, sizeof o->sc);
    memcpy(o->mn, u->mn, sizeof o->mn);
    interleave(o->q, u->q);
}

// The 32-element types: x = d * q - dm with one scale per block and sc = mn = 1.
static void unit_scales(struct unpacked *u) {
    for (int p = 0; p < 16; p++) u->sc[p] = u->mn[p] = 1;
}

// Q4_0 and Q4_1: byte j holds element j in its low nibble, element j + 16 in its high one.
static void q4_quants(const uint8_t *qs, uint8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = qs[j] & 0xF;
        q[j + 16] = qs[j] >> 4;
    }
}

static void unpack_q4_0(const block_q4_0 *b, struct unpacked *u) {
    unit_scales(u);
    for (int g = 0; g < 8; g++) {
        const float d = fp16_to_fp32(b[g].d);
        u->dw[g] = d;
        u->dm[g] = 8.0f * d;   // x = (q - 8) * d
        q4_quants(b[g].qs, u->q + 32 * g);
    }
}

static void unpack_q4_1(const block_q4_1 *b, struct unpacked *u) {
    unit_scales(u);
    for (int g = 0; g < 8; g++) {
        u->dw[g] = fp16_to_fp32(b[g].d);
        u->dm[g] = -fp16_to_fp32(b[g].m);   // x = q * d + m
        q4_quants(b[g].qs, u->q + 32 * g);
    }
}

static uint32_t qh_bits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

// Q5_0 and Q5_1: bit j of qh is element j's fifth bit.
static void q5_quants(const uint8_t *qs, const uint8_t qh4[4], uint8_t *q) {
    const uint32_t qh = qh_bits(qh4);
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
        q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}

static void unpack_q5_0(const block_q5_0 *b, struct unpacked *u) {
    unit_scales(u);
    for (int g = 0; g < 8; g++) {
        const float d = fp16_to_fp32(b[g].d);
        u->dw[g] = d;
        u->dm[g] = 16.0f * d;   // x = (q - 16) * d
        q5_quants(b[g].qs, b[g].qh, u->q + 32 * g);
    }
}

static void unpack_q5_1(const block_q5_1 *b, struct unpacked *u) {
    unit_scales(u);
    for (int g = 0; g < 8; g++) {
        u->dw[g] = fp16_to_fp32(b[g].d);
        u->dm[g] = -fp16_to_fp32(b[g].m);
        q5_quants(b[g].qs, b[g].qh, u->q + 32 * g);
    }
}

// K-quants: one super-block scale (dw) and min scale (dm) for all eight groups.
static void k_scales(struct unpacked *u, float d, float dmin) {
    for (int g = 0; g < 8; g++) { u->dw[g] = d; u->dm[g] = dmin; }
}

// Q4_K and Q5_K: sub-block j of 32 is sub-blocks 2j and 2j + 1 of 16 here.
static void k4_sub_scales(const uint8_t *scales, struct unpacked *u) {
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        k4_scale_min(j, scales, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = sc;
        u->mn[2 * j] = u->mn[2 * j + 1] = m;
    }
}

static void unpack_q4_K(const block_q4_K *b, struct unpacked *u) {
    k_scales(u, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin));
    k4_sub_scales(b->scales, u);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            u->q[64 * c + l] = b->qs[32 * c + l] & 0xF;
            u->q[64 * c + 32 + l] = b->qs[32 * c + l] >> 4;
        }
}

static void unpack_q5_K(const block_q5_K *b, struct unpacked *u) {
    k_scales(u, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin));
    k4_sub_scales(b->scales, u);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            const uint8_t ql = b->qs[32 * c + l], qh = b->qh[l];
            u->q[64 * c + l] = (uint8_t)((ql & 0xF) | ((qh >> (2 * c)) & 1) << 4);
            u->q[64 * c + 32 + l] = (uint8_t)((ql >> 4) | ((qh >> (2 * c + 1)) & 1) << 4);
        }
}

// Q2_K, Q3_K, Q6_K: element 128h + 32r + l (quant-blocks.h's runs), sub-block 8h + 2r + l/16.
// Q3_K and Q6_K centre their quants (q - 4, q - 32): the offset goes into mn, with dm = d.
static void unpack_q6_K(const block_q6_K *b, struct unpacked *u) {
    const float d = fp16_to_fp32(b->d);
    k_scales(u, d, d);
    for (int p = 0; p < 16; p++) { u->sc[p] = b->scales[p]; u->mn[p] = (int16_t)(32 * b->scales[p]); }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) u->q[128 * h + 32 * r + l] = (uint8_t)(q6k_quant(b, h, r, l) + 32);
}

static void unpack_q3_K(const block_q3_K *b, struct unpacked *u) {
    const float d = fp16_to_fp32(b->d);
    k_scales(u, d, d);
    for (int p = 0; p < 16; p++) { u->sc[p] = (int16_t)q3_scale(b->scales, p); u->mn[p] = (int16_t)(4 * u->sc[p]); }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) u->q[128 * h + 32 * r + l] = (uint8_t)(q3k_quant(b, h, r, l) + 4);
}

static void unpack_q2_K(const block_q2_K *b, struct unpacked *u) {
    k_scales(u, fp16_to_fp32(b->d), fp16_to_fp32(b->dmin));
    for (int p = 0; p < 16; p++) { u->sc[p] = b->scales[p] & 0xF; u->mn[p] = b->scales[p] >> 4; }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < 32; l++) u->q[128 * h + 32 * r + l] = (uint8_t)q2k_quant(b->qs, h, r, l);
}

// The bytes of 256 elements of `type`, and the largest quant its unpacked form holds.
static int type_info(int32_t type, int *qmax) {
    switch (type) {
    case PYKV_TYPE_Q4_0: *qmax = 15; return 8 * sizeof(block_q4_0);
    case PYKV_TYPE_Q4_1: *qmax = 15; return 8 * sizeof(block_q4_1);
    case PYKV_TYPE_Q5_0: *qmax = 31; return 8 * sizeof(block_q5_0);
    case PYKV_TYPE_Q5_1: *qmax = 31; return 8 * sizeof(block_q5_1);
    case PYKV_TYPE_Q2_K: *qmax = 3;  return sizeof(block_q2_K);
    case PYKV_TYPE_Q3_K: *qmax = 7;  return sizeof(block_q3_K);
    case PYKV_TYPE_Q4_K: *qmax = 15; return sizeof(block_q4_K);
    case PYKV_TYPE_Q5_K: *qmax = 31; return sizeof(block_q5_K);
    case PYKV_TYPE_Q6_K: *qmax = 63; return sizeof(block_q6_K);
    default: return 0;
    }
}

int gemm_q8_supports(int32_t type, int64_t cols) {
    int qmax;
    return cols > 0 && cols % PK_ELEMS == 0 && type_info(type, &qmax) > 0;
}

int gemm_q8_run(int32_t type) {
    int qmax = 0;
    if (!type_info(type, &qmax)) return 0;
    const int run = 32767 / (2 * 127 * qmax);
    return run > 8 ? 8 : run;
}

void pack_weight_row(int32_t type, const void *row, pk_weight *out, int64_t cols) {
    int qmax;
    const int bytes = type_info(type, &qmax);
    const uint8_t *src = row;
    struct unpacked u;
    for (int64_t s = 0; s < cols / PK_ELEMS; s++, src += bytes) {
        switch (type) {
        case PYKV_TYPE_Q4_0: unpack_q4_0((const block_q4_0 *)src, &u); break;
        case PYKV_TYPE_Q4_1: unpack_q4_1((const block_q4_1 *)src, &u); break;
        case PYKV_TYPE_Q5_0: unpack_q5_0((const block_q5_0 *)src, &u); break;
        case PYKV_TYPE_Q5_1: unpack_q5_1((const block_q5_1 *)src, &u); break;
        case PYKV_TYPE_Q2_K: unpack_q2_K((const block_q2_K *)src, &u); break;
        case PYKV_TYPE_Q3_K: unpack_q3_K((const block_q3_K *)src, &u); break;
        case PYKV_TYPE_Q4_K: unpack_q4_K((const block_q4_K *)src, &u); break;
        case PYKV_TYPE_Q5_K: unpack_q5_K((const block_q5_K *)src, &u); break;
        case PYKV_TYPE_Q6_K: unpack_q6_K((const block_q6_K *)src, &u); break;
        default: return;
        }
        store(out + s, &u);
    }
}

void pack_act_rows(const float *x, int T, int64_t cols, pk_act *out) {
    const int64_t n_super = cols / PK_ELEMS;
    for (int64_t i = 0; i < (int64_t)T * n_super; i++) {
        pk_act *a = out + i;
        block_q8_act b[8];
        uint8_t natural[PK_ELEMS];
        quantize_row_q8_act(x + i * PK_ELEMS, b, PK_ELEMS);   // rows are whole super-blocks
        for (int g = 0; g < 8; g++) {
            a->dx[g] = b[g].d;
            memcpy(natural + 32 * g, b[g].qs, 32);
        }
        for (int p = 0; p < 16; p++) {
            int sum = 0;
            for (int w = 0; w < 16; w++) sum += (int8_t)natural[16 * p + w];
            a->bsum[p] = (int16_t)sum;
        }
        interleave((uint8_t *)a->q, natural);
    }
}
