// types.h - traits of the tensor element types (block sizes), shared by the loader and kernels.
#pragma once
#include <stdint.h>
#include "pykv.h"

struct type_traits {
    const char *name;        // "q4_1"
    int32_t     block_size;  // elements per block
    int32_t     block_bytes; // bytes per block
};

// NULL for a type this build does not know.
const struct type_traits *type_traits_of(int32_t type);

// ggml's name of a tensor type pykv does not read ("iq2_xxs"), for error messages; "unknown"
// for a number ggml does not use either.
const char *type_ggml_name(int32_t type);

// Bytes of a row of n elements, or -1 when n is not a whole number of blocks.
int64_t type_row_bytes(int32_t type, int64_t n);
