// gguf.h - a read-only GGUF v2/v3 reader over mmap (read() fallback).
//
// Every count, length, offset and size is checked against the file while parsing, so a
// truncated or corrupt file is an error here and never a wild read later. After
// gguf_open() the structure is immutable. Strings point into the file: they are not
// NUL-terminated (use the len), except keys and tensor names, which are copied.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "pykv.h"

enum gguf_value_type {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
};

struct gguf_str {
    const char *ptr;
    uint64_t    len;
};

struct gguf_kv {
    char    *key;          // NUL-terminated copy
    int32_t  type;         // enum gguf_value_type
    union {
        uint64_t        u64;
        int64_t         i64;
        double          f64;
        struct gguf_str str;
    } val;                 // scalars, widened (integers to i64/u64, floats to f64)
    // arrays (type == GGUF_TYPE_ARRAY)
    int32_t          arr_type;   // element type; GGUF_TYPE_ARRAY for nested arrays
    uint64_t         arr_n;
    const uint8_t   *arr_data;   // fixed-size elements, packed little-endian
    struct gguf_str *arr_strs;   // string elements (allocated), NULL otherwise
};

struct gguf_tensor {
    char       *name;      // NUL-terminated copy
    int32_t     type;      // pykv_type
    int32_t     n_dims;
    int64_t     ne[4];     // ne[0] is the row length; unused dims are 1
    uint64_t    offset;    // from the start of the file
    uint64_t    n_bytes;
    const void *data;
};

struct gguf_file {
    const uint8_t      *data;       // the whole file
    size_t              size;
    int                 mmapped;
    uint32_t            version;
    uint32_t            alignment;
    uint64_t            n_kv;
    struct gguf_kv     *kvs;
    uint64_t            n_tensors;
    struct gguf_tensor *tensors;
};

pykv_status gguf_open(const char *path, int use_mmap, struct gguf_file **out);
void        gguf_close(struct gguf_file *f);

const struct gguf_kv     *gguf_find_kv(const struct gguf_file *f, const char *key);
const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name);

// Typed getters. An absent key leaves *out untouched and returns OK unless required;
// a present key of the wrong type is a PYKV_ERR_FORMAT naming the key.
pykv_status gguf_get_int(const struct gguf_file *f, const char *key, int required, int64_t *out);
pykv_status gguf_get_float(const struct gguf_file *f, const char *key, int required, double *out);
pykv_status gguf_get_bool(const struct gguf_file *f, const char *key, int required, int *out);
pykv_status gguf_get_str(const struct gguf_file *f, const char *key, int required, struct gguf_str *out);
// An array whose elements have elem_type (-1: any); *out stays NULL when absent.
pykv_status gguf_get_arr(const struct gguf_file *f, const char *key, int32_t elem_type,
                         int required, const struct gguf_kv **out);

// Element i of a numeric array, widened.
int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i);
double  gguf_arr_float(const struct gguf_kv *kv, uint64_t i);

// Does a counted string equal a C string?
int gguf_str_eq(struct gguf_str s, const char *cstr);

const char *gguf_type_name(int32_t type);
