// types.c - block layouts of the GGUF tensor types pykv reads (sizes from ggml's block structs).
#include "model/types.h"

#include <stddef.h>

static const struct type_traits traits[] = {
    [PYKV_TYPE_F32]  = { "f32",  1,   4 },
    [PYKV_TYPE_F16]  = { "f16",  1,   2 },
    [PYKV_TYPE_Q4_0] = { "q4_0", 32,  18 },           // f16 d, 16 bytes of nibbles
    [PYKV_TYPE_Q4_1] = { "q4_1", 32,  20 },           // f16 d, f16 m, 16 bytes of nibbles
    [PYKV_TYPE_Q5_0] = { "q5_0", 32,  22 },           // f16 d, 4 bytes high bits, 16 bytes
    [PYKV_TYPE_Q5_1] = { "q5_1", 32,  24 },           // f16 d, f16 m, 4 bytes, 16 bytes
    [PYKV_TYPE_Q8_0] = { "q8_0", 32,  34 },           // f16 d, 32 int8
    [PYKV_TYPE_Q2_K] = { "q2_k", 256, 84 },           // 16 bytes scales, 64 bytes, 2 f16
    [PYKV_TYPE_Q3_K] = { "q3_k", 256, 110 },          // 32 high bits, 64 low, 12 scales, f16 d
    [PYKV_TYPE_Q4_K] = { "q4_k", 256, 144 },          // 2 f16, 12 bytes scales, 128 bytes
    [PYKV_TYPE_Q5_K] = { "q5_k", 256, 176 },          // 2 f16, 12 scales, 32 high, 128 low
    [PYKV_TYPE_Q6_K] = { "q6_k", 256, 210 },          // 128 low, 64 high, 16 scales, f16 d
    [PYKV_TYPE_IQ4_NL] = { "iq4_nl", 32, 18 },        // f16 d, 16 bytes of table indices
    [PYKV_TYPE_IQ4_XS] = { "iq4_xs", 256, 136 },      // f16 d, 2+4 bytes scales, 128 bytes
    [PYKV_TYPE_BF16] = { "bf16", 1,   2 },
};

const struct type_traits *type_traits_of(int32_t type) {
    if (type < 0 || (size_t)type >= sizeof(traits) / sizeof(traits[0])) return NULL;
    if (traits[type].name == NULL) return NULL;
    return &traits[type];
}

const char *type_ggml_name(int32_t type) {
    static const char *const ggml[] = {
        [9] = "q8_1", [15] = "q8_k", [16] = "iq2_xxs", [17] = "iq2_xs", [18] = "iq3_xxs", [19] = "iq1_s",
        [21] = "iq3_s", [22] = "iq2_s", [24] = "i8", [25] = "i16", [26] = "i32", [27] = "i64", [28] = "f64",
        [29] = "iq1_m", [34] = "tq1_0", [35] = "tq2_0", [39] = "mxfp4",
    };
    const struct type_traits *t = type_traits_of(type);
    if (t) return t->name;
    if (type < 0 || (size_t)type >= sizeof(ggml) / sizeof(ggml[0]) || !ggml[type]) return "unknown";
    return ggml[type];
}

int64_t type_row_bytes(int32_t type, int64_t n) {
    const struct type_traits *t = type_traits_of(type);
    if (!t || n < 0 || n % t->block_size != 0) return -1;
    return n / t->block_size * t->block_bytes;
}

const char *pykv_type_name(int32_t type) {
    const struct type_traits *t = type_traits_of(type);
    return t ? t->name : NULL;
}

int32_t pykv_type_block_size(int32_t type) {
    const struct type_traits *t = type_traits_of(type);
    return t ? t->block_size : 0;
}

int32_t pykv_type_block_bytes(int32_t type) {
    const struct type_traits *t = type_traits_of(type);
    return t ? t->block_bytes : 0;
}
