// gguf.c - GGUF v2/v3 parsing with every read bounds-checked against the file size.
#include "model/gguf.h"
#include "core/error.h"
#include "model/types.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC 0x46554747u  // "GGUF" little-endian
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4

// A read cursor over the file; every take checks the bytes left.
struct cursor {
    const uint8_t *data;
    size_t         size;
    size_t         pos;
    const char    *what;   // what is being read, for error messages
};

static pykv_status truncated(const struct cursor *c) {
    return pykv_error(PYKV_ERR_FORMAT, "GGUF is truncated or corrupt: %s at byte %zu runs past the end of the file (%zu bytes)",
                      c->what, c->pos, c->size);
}

static pykv_status take(struct cursor *c, size_t n, const uint8_t **out) {
    if (n > c->size - c->pos) return truncated(c);
    *out = c->data + c->pos;
    c->pos += n;
    return PYKV_OK;
}

static pykv_status take_u32(struct cursor *c, uint32_t *v) {
    const uint8_t *p = NULL;
    PYKV_TRY(take(c, 4, &p));
    memcpy(v, p, 4);
    return PYKV_OK;
}

static pykv_status take_u64(struct cursor *c, uint64_t *v) {
    const uint8_t *p = NULL;
    PYKV_TRY(take(c, 8, &p));
    memcpy(v, p, 8);
    return PYKV_OK;
}

static pykv_status take_str(struct cursor *c, struct gguf_str *s) {
    uint64_t len;
    PYKV_TRY(take_u64(c, &len));
    if (len > c->size - c->pos) return truncated(c);
    const uint8_t *p = NULL;
    PYKV_TRY(take(c, (size_t)len, &p));
    s->ptr = (const char *)p;
    s->len = len;
    return PYKV_OK;
}

static char *dup_str(struct gguf_str s) {
    char *r = malloc(s.len + 1);
    if (!r) return NULL;
    memcpy(r, s.ptr, s.len);
    r[s.len] = '\0';
    return r;
}

// Size in bytes of a fixed-size scalar type, 0 for string/array, -1 for an unknown type.
static int scalar_size(int32_t type) {
    switch (type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    case GGUF_TYPE_STRING: case GGUF_TYPE_ARRAY: return 0;
    default: return -1;
    }
}

const char *gguf_type_name(int32_t type) {
    static const char *names[] = { "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                   "str", "arr", "u64", "i64", "f64" };
    return (type >= 0 && type <= 12) ? names[type] : "?";
}

// Widen a packed little-endian scalar.
static void read_scalar(int32_t type, const uint8_t *p, struct gguf_kv *kv) {
    switch (type) {
    case GGUF_TYPE_UINT8:  kv->val.u64 = p[0]; break;
    case GGUF_TYPE_BOOL:   kv->val.u64 = p[0] != 0; break;
    case GGUF_TYPE_INT8:   kv->val.i64 = (int8_t)p[0]; break;
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); kv->val.u64 = v; break; }
    case GGUF_TYPE_INT16:  { int16_t v;  memcpy(&v, p, 2); kv->val.i64 = v; break; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); kv->val.u64 = v; break; }
    case GGUF_TYPE_INT32:  { int32_t v;  memcpy(&v, p, 4); kv->val.i64 = v; break; }
    case GGUF_TYPE_FLOAT32:{ float v;    memcpy(&v, p, 4); kv->val.f64 = v; break; }
    case GGUF_TYPE_UINT64: { uint64_t v; memcpy(&v, p, 8); kv->val.u64 = v; break; }
    case GGUF_TYPE_INT64:  { int64_t v;  memcpy(&v, p, 8); kv->val.i64 = v; break; }
    case GGUF_TYPE_FLOAT64:{ double v;   memcpy(&v, p, 8); kv->val.f64 = v; break; }
    default: break;
    }
}

// Skip over an array's elements (used for nested arrays, whose contents pykv never needs),
// still checking every length against the file.
static pykv_status skip_array(struct cursor *c, int depth) {
    uint32_t elem_type;
    uint64_t n;
    if (depth > 8) return pykv_error(PYKV_ERR_FORMAT, "GGUF %s: arrays nested too deeply", c->what);
    PYKV_TRY(take_u32(c, &elem_type));
    PYKV_TRY(take_u64(c, &n));
    int sz = scalar_size((int32_t)elem_type);
    if (sz < 0) return pykv_error(PYKV_ERR_FORMAT, "GGUF %s: unknown array element type %u", c->what, elem_type);
    if (sz > 0) {
        if (n > (c->size - c->pos) / (uint64_t)sz) return truncated(c);
        c->pos += (size_t)(n * (uint64_t)sz);
        return PYKV_OK;
    }
    for (uint64_t i = 0; i < n; i++) {
        if (elem_type == GGUF_TYPE_STRING) {
            struct gguf_str s;
            PYKV_TRY(take_str(c, &s));
        } else {
            PYKV_TRY(skip_array(c, depth + 1));
        }
    }
    return PYKV_OK;
}

static pykv_status parse_value(struct cursor *c, struct gguf_kv *kv) {
    int sz = scalar_size(kv->type);
    if (sz < 0) return pykv_error(PYKV_ERR_FORMAT, "GGUF key '%s' has unknown value type %d", kv->key, kv->type);
    if (sz > 0) {
        const uint8_t *p = NULL;
        PYKV_TRY(take(c, (size_t)sz, &p));
        read_scalar(kv->type, p, kv);
        return PYKV_OK;
    }
    if (kv->type == GGUF_TYPE_STRING) return take_str(c, &kv->val.str);

    // array
    uint32_t elem_type;
    PYKV_TRY(take_u32(c, &elem_type));
    PYKV_TRY(take_u64(c, &kv->arr_n));
    kv->arr_type = (int32_t)elem_type;
    int esz = scalar_size(kv->arr_type);
    if (esz < 0) return pykv_error(PYKV_ERR_FORMAT, "GGUF key '%s': unknown array element type %u", kv->key, elem_type);
    if (esz > 0) {
        if (kv->arr_n > (c->size - c->pos) / (uint64_t)esz) return truncated(c);
        kv->arr_data = c->data + c->pos;
        c->pos += (size_t)(kv->arr_n * (uint64_t)esz);
    } else if (kv->arr_type == GGUF_TYPE_STRING) {
        // each string takes at least its 8-byte length, which bounds a sane count
        if (kv->arr_n > (c->size - c->pos) / 8) return truncated(c);
        kv->arr_strs = malloc((kv->arr_n ? kv->arr_n : 1) * sizeof(struct gguf_str));
        if (!kv->arr_strs) return pykv_error(PYKV_ERR_NOMEM, "out of memory reading GGUF key '%s'", kv->key);
        for (uint64_t i = 0; i < kv->arr_n; i++) PYKV_TRY(take_str(c, &kv->arr_strs[i]));
    } else {
        for (uint64_t i = 0; i < kv->arr_n; i++) PYKV_TRY(skip_array(c, 1));
    }
    return PYKV_OK;
}

static pykv_status parse_tensor_info(struct cursor *c, struct gguf_tensor *t) {
    struct gguf_str name;
    uint32_t n_dims, type;
    PYKV_TRY(take_str(c, &name));
    t->name = dup_str(name);
    if (!t->name) return pykv_error(PYKV_ERR_NOMEM, "out of memory reading GGUF tensor names");
    c->what = t->name;
    PYKV_TRY(take_u32(c, &n_dims));
    if (n_dims == 0 || n_dims > GGUF_MAX_DIMS)
        return pykv_error(PYKV_ERR_FORMAT, "GGUF tensor '%s' has %u dimensions (1 to 4 allowed)", t->name, n_dims);
    t->n_dims = (int32_t)n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne;
        PYKV_TRY(take_u64(c, &ne));
        if (ne == 0 || ne > (uint64_t)1 << 40)
            return pykv_error(PYKV_ERR_FORMAT, "GGUF tensor '%s' has an invalid dimension %llu", t->name, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    PYKV_TRY(take_u32(c, &type));
    t->type = (int32_t)type;
    PYKV_TRY(take_u64(c, &t->offset));
    return PYKV_OK;
}

// Resolve data pointers and sizes once the data section's start is known.
static pykv_status place_tensors(struct gguf_file *f, size_t data_start) {
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        const struct type_traits *tt = type_traits_of(t->type);
        if (!tt)
            return pykv_error(PYKV_ERR_UNSUPPORTED, "tensor '%s' has tensor type %d (%s), which pykv does not support",
                              t->name, t->type, type_ggml_name(t->type));
        if (t->ne[0] % tt->block_size != 0)
            return pykv_error(PYKV_ERR_FORMAT, "tensor '%s': row length %lld is not a multiple of the %s block size %d",
                              t->name, (long long)t->ne[0], tt->name, tt->block_size);
        // each dimension is at most 2^40 (parse_tensor_info), but their product may wrap
        uint64_t size = (uint64_t)type_row_bytes(t->type, t->ne[0]);
        for (int d = 1; d < GGUF_MAX_DIMS; d++) {
            if (size > UINT64_MAX / (uint64_t)t->ne[d])
                return pykv_error(PYKV_ERR_FORMAT, "tensor '%s' of shape [%lld, %lld, %lld, %lld] is impossibly "
                                  "large: its size overflows 64 bits", t->name, (long long)t->ne[0],
                                  (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
            size *= (uint64_t)t->ne[d];
        }
        t->n_bytes = size;
        if (t->offset % f->alignment != 0)
            return pykv_error(PYKV_ERR_FORMAT, "tensor '%s' offset %llu is not aligned to %u", t->name,
                              (unsigned long long)t->offset, f->alignment);
        uint64_t avail = f->size - data_start;
        if (t->offset > avail || t->n_bytes > avail - t->offset)
            return pykv_error(PYKV_ERR_FORMAT,
                              "GGUF is truncated or corrupt: tensor '%s' (%llu bytes at data offset %llu) lies past the end of the file",
                              t->name, (unsigned long long)t->n_bytes, (unsigned long long)t->offset);
        t->offset += data_start;
        t->data = f->data + t->offset;
    }
    return PYKV_OK;
}

static pykv_status parse(struct gguf_file *f) {
    struct cursor c = { f->data, f->size, 0, "header" };
    uint32_t magic;
    PYKV_TRY(take_u32(&c, &magic));
    if (magic != GGUF_MAGIC) return pykv_error(PYKV_ERR_FORMAT, "not a GGUF file (bad magic 0x%08x)", magic);
    PYKV_TRY(take_u32(&c, &f->version));
    if (f->version == 1 || f->version > 3) {
        if (f->version > 0xffff) return pykv_error(PYKV_ERR_UNSUPPORTED, "big-endian GGUF files are not supported");
        return pykv_error(PYKV_ERR_UNSUPPORTED, "GGUF version %u is not supported (2 and 3 are)", f->version);
    }
    if (f->version == 0) return pykv_error(PYKV_ERR_FORMAT, "GGUF version 0 is invalid");
    PYKV_TRY(take_u64(&c, &f->n_tensors));
    PYKV_TRY(take_u64(&c, &f->n_kv));
    // Every kv takes at least 12 bytes and every tensor info at least 24: bound the counts
    // by the file size before allocating.
    if (f->n_kv > f->size / 12 || f->n_tensors > f->size / 24)
        return pykv_error(PYKV_ERR_FORMAT, "GGUF is truncated or corrupt: the header claims %llu keys and %llu tensors, more than the file can hold",
                          (unsigned long long)f->n_kv, (unsigned long long)f->n_tensors);
    f->kvs = calloc(f->n_kv ? f->n_kv : 1, sizeof(struct gguf_kv));
    f->tensors = calloc(f->n_tensors ? f->n_tensors : 1, sizeof(struct gguf_tensor));
    if (!f->kvs || !f->tensors) return pykv_error(PYKV_ERR_NOMEM, "out of memory reading the GGUF header");

    for (uint64_t i = 0; i < f->n_kv; i++) {
        struct gguf_kv *kv = &f->kvs[i];
        struct gguf_str key;
        c.what = "metadata key";
        PYKV_TRY(take_str(&c, &key));
        kv->key = dup_str(key);
        if (!kv->key) return pykv_error(PYKV_ERR_NOMEM, "out of memory reading GGUF metadata");
        c.what = kv->key;
        uint32_t type;
        PYKV_TRY(take_u32(&c, &type));
        kv->type = (int32_t)type;
        PYKV_TRY(parse_value(&c, kv));
    }

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const struct gguf_kv *al = gguf_find_kv(f, "general.alignment");
    if (al) {
        if (al->type != GGUF_TYPE_UINT32 || al->val.u64 == 0 || (al->val.u64 & (al->val.u64 - 1)) != 0)
            return pykv_error(PYKV_ERR_FORMAT, "general.alignment must be a power-of-two u32");
        f->alignment = (uint32_t)al->val.u64;
    }

    for (uint64_t i = 0; i < f->n_tensors; i++) {
        c.what = "tensor info";
        PYKV_TRY(parse_tensor_info(&c, &f->tensors[i]));
    }
    size_t data_start = (c.pos + f->alignment - 1) / f->alignment * f->alignment;
    if (data_start > f->size) {
        if (f->n_tensors == 0) data_start = f->size;
        else return pykv_error(PYKV_ERR_FORMAT, "GGUF is truncated: the tensor data section is missing");
    }
    return place_tensors(f, data_start);
}

static pykv_status load_bytes(const char *path, int use_mmap, struct gguf_file *f) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pykv_error(PYKV_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return pykv_error(PYKV_ERR_IO, "'%s' is not a regular file", path);
    }
    f->size = (size_t)st.st_size;
    if (f->size < 24) {
        close(fd);
        return pykv_error(PYKV_ERR_FORMAT, "'%s' is too small to be a GGUF file (%zu bytes)", path, f->size);
    }
    if (use_mmap) {
        void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p != MAP_FAILED) {
            close(fd);
            f->data = p;
            f->mmapped = 1;
            return PYKV_OK;
        }
    }
    uint8_t *buf = malloc(f->size);
    if (!buf) {
        close(fd);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory reading '%s' (%zu bytes)", path, f->size);
    }
    size_t got = 0;
    while (got < f->size) {
        ssize_t r = read(fd, buf + got, f->size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            free(buf);
            close(fd);
            return pykv_error(PYKV_ERR_IO, "error reading '%s': %s", path, r < 0 ? strerror(errno) : "unexpected end of file");
        }
        got += (size_t)r;
    }
    close(fd);
    f->data = buf;
    return PYKV_OK;
}

pykv_status gguf_open(const char *path, int use_mmap, struct gguf_file **out) {
    *out = NULL;
    if (!path) return pykv_error(PYKV_ERR_INVALID_ARG, "model path is NULL");
    struct gguf_file *f = calloc(1, sizeof(*f));
    if (!f) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    pykv_status st = load_bytes(path, use_mmap, f);
    if (st == PYKV_OK) st = parse(f);
    if (st != PYKV_OK) {
        gguf_close(f);
        return st;
    }
    *out = f;
    return PYKV_OK;
}

void gguf_close(struct gguf_file *f) {
    if (!f) return;
    if (f->kvs) {
        for (uint64_t i = 0; i < f->n_kv; i++) {
            free(f->kvs[i].key);
            free(f->kvs[i].arr_strs);
        }
        free(f->kvs);
    }
    if (f->tensors) {
        for (uint64_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
        free(f->tensors);
    }
    if (f->data) {
        if (f->mmapped) munmap((void *)f->data, f->size);
        else free((void *)f->data);
    }
    free(f);
}

const struct gguf_kv *gguf_find_kv(const struct gguf_file *f, const char *key) {
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (f->kvs[i].key && strcmp(f->kvs[i].key, key) == 0) return &f->kvs[i];
    return NULL;
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf_file *f, const char *name) {
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

static pykv_status missing(const char *key) {
    return pykv_error(PYKV_ERR_FORMAT, "GGUF metadata key '%s' is missing", key);
}

static pykv_status wrong_type(const struct gguf_kv *kv, const char *expected) {
    return pykv_error(PYKV_ERR_FORMAT, "GGUF metadata key '%s' has type %s, expected %s", kv->key,
                      gguf_type_name(kv->type), expected);
}

static int is_signed(int32_t t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_INT64;
}

static int is_unsigned(int32_t t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_UINT64 ||
           t == GGUF_TYPE_BOOL;
}

pykv_status gguf_get_int(const struct gguf_file *f, const char *key, int required, int64_t *out) {
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return required ? missing(key) : PYKV_OK;
    if (is_signed(kv->type)) *out = kv->val.i64;
    else if (is_unsigned(kv->type)) {
        if (kv->val.u64 > INT64_MAX) return wrong_type(kv, "an integer that fits in 63 bits");
        *out = (int64_t)kv->val.u64;
    } else return wrong_type(kv, "an integer");
    return PYKV_OK;
}

pykv_status gguf_get_float(const struct gguf_file *f, const char *key, int required, double *out) {
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return required ? missing(key) : PYKV_OK;
    if (kv->type == GGUF_TYPE_FLOAT32 || kv->type == GGUF_TYPE_FLOAT64) *out = kv->val.f64;
    else if (is_signed(kv->type)) *out = (double)kv->val.i64;
    else if (is_unsigned(kv->type)) *out = (double)kv->val.u64;
    else return wrong_type(kv, "a number");
    return PYKV_OK;
}

pykv_status gguf_get_bool(const struct gguf_file *f, const char *key, int required, int *out) {
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return required ? missing(key) : PYKV_OK;
    if (kv->type != GGUF_TYPE_BOOL && !is_unsigned(kv->type) && !is_signed(kv->type)) return wrong_type(kv, "bool");
    *out = kv->val.u64 != 0;
    return PYKV_OK;
}

pykv_status gguf_get_str(const struct gguf_file *f, const char *key, int required, struct gguf_str *out) {
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return required ? missing(key) : PYKV_OK;
    if (kv->type != GGUF_TYPE_STRING) return wrong_type(kv, "string");
    *out = kv->val.str;
    return PYKV_OK;
}

pykv_status gguf_get_arr(const struct gguf_file *f, const char *key, int32_t elem_type, int required,
                         const struct gguf_kv **out) {
    const struct gguf_kv *kv = gguf_find_kv(f, key);
    if (!kv) return required ? missing(key) : PYKV_OK;
    if (kv->type != GGUF_TYPE_ARRAY) return wrong_type(kv, "array");
    if (elem_type >= 0 && kv->arr_type != elem_type) {
        // integer arrays are accepted whatever their width or sign
        int both_int = (is_signed(elem_type) || is_unsigned(elem_type)) &&
                       (is_signed(kv->arr_type) || is_unsigned(kv->arr_type));
        int both_float = (elem_type == GGUF_TYPE_FLOAT32 || elem_type == GGUF_TYPE_FLOAT64) &&
                         (kv->arr_type == GGUF_TYPE_FLOAT32 || kv->arr_type == GGUF_TYPE_FLOAT64);
        if (!both_int && !both_float)
            return pykv_error(PYKV_ERR_FORMAT, "GGUF metadata key '%s' is an array of %s, expected %s", key,
                              gguf_type_name(kv->arr_type), gguf_type_name(elem_type));
    }
    *out = kv;
    return PYKV_OK;
}

int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i) {
    struct gguf_kv tmp = { 0 };
    int sz = scalar_size(kv->arr_type);
    if (sz <= 0 || i >= kv->arr_n) return 0;
    read_scalar(kv->arr_type, kv->arr_data + i * (uint64_t)sz, &tmp);
    return is_signed(kv->arr_type) ? tmp.val.i64 : (int64_t)tmp.val.u64;
}

double gguf_arr_float(const struct gguf_kv *kv, uint64_t i) {
    struct gguf_kv tmp = { 0 };
    int sz = scalar_size(kv->arr_type);
    if (sz <= 0 || i >= kv->arr_n) return 0;
    read_scalar(kv->arr_type, kv->arr_data + i * (uint64_t)sz, &tmp);
    if (kv->arr_type == GGUF_TYPE_FLOAT32 || kv->arr_type == GGUF_TYPE_FLOAT64) return tmp.val.f64;
    return is_signed(kv->arr_type) ? (double)tmp.val.i64 : (double)tmp.val.u64;
}

int gguf_str_eq(struct gguf_str s, const char *cstr) {
    size_t n = strlen(cstr);
    return s.len == n && memcmp(s.ptr, cstr, n) == 0;
}
