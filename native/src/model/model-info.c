// model-info.c - the read-only model queries of pykv.h: hparams, metadata, tensor table.
#include "core/error.h"
#include "model/model.h"
#include "model/offload.h"
#include "model/types.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

// Copy n bytes into (buf, cap); PYKV_ERR_BUFFER_TOO_SMALL with the size needed (with NUL).
static pykv_status put_bytes(const char *s, size_t n, char *buf, int32_t cap, int32_t *n_out) {
    if (n_out) *n_out = (int32_t)n;
    if (!buf || cap < 0 || (size_t)cap < n + 1) {
        if (n_out) *n_out = (int32_t)(n + 1);
        return PYKV_ERR_BUFFER_TOO_SMALL;
    }
    memcpy(buf, s, n);
    buf[n] = '\0';
    return PYKV_OK;
}

pykv_status pykv_model_get_info(const pykv_model *m, struct pykv_model_info *info) {
    if (!m || !info) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_get_info: NULL argument");
    if (info->struct_size != sizeof(*info))
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_info.struct_size mismatch (header/library mismatch)");
    const struct hparams *hp = &m->hp;
    info->n_vocab = hp->n_vocab;
    info->n_ctx_train = hp->n_ctx_train;
    info->n_embd = hp->n_embd;
    info->n_layer = hp->n_layer;
    info->n_head = hp->n_head;
    info->n_head_kv = hp->n_head_kv;
    info->head_dim = hp->head_dim;
    info->n_ff = hp->n_ff;
    info->rope_freq_base = hp->rope_freq_base;
    info->rms_eps = hp->rms_eps;
    info->tied_output = m->tied_output;
    info->gguf_version = (int32_t)m->file->version;
    info->vocab_only = m->vocab_only;
    info->n_gpu_layers = m->gpu ? m->hp.n_layer - m->gpu->first_layer : 0;
    info->gpu_output = m->gpu ? m->gpu->output : 0;
    info->gpu_device = m->gpu ? m->gpu->device : -1;
    info->gpu_bytes = m->gpu ? (int64_t)m->gpu->bytes : 0;
    info->n_params = 0;
    info->n_bytes = 0;
    for (uint64_t i = 0; i < m->file->n_tensors; i++) {
        const struct gguf_tensor *t = &m->file->tensors[i];
        info->n_params += t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        info->n_bytes += (int64_t)t->n_bytes;
    }
    return PYKV_OK;
}

int32_t pykv_model_meta_count(const pykv_model *m) { return m ? (int32_t)m->file->n_kv : 0; }

static const struct gguf_kv *meta_at(const pykv_model *m, int32_t i) {
    if (!m || i < 0 || (uint64_t)i >= m->file->n_kv) {
        pykv_error(PYKV_ERR_INVALID_ARG, "metadata index %d out of range", i);
        return NULL;
    }
    return &m->file->kvs[i];
}

pykv_status pykv_model_meta_key(const pykv_model *m, int32_t i, char *buf, int32_t cap, int32_t *n_out) {
    const struct gguf_kv *kv = meta_at(m, i);
    if (!kv) return PYKV_ERR_INVALID_ARG;
    return put_bytes(kv->key, strlen(kv->key), buf, cap, n_out);
}

// Render one scalar (or array element at p) as text.
static int render_scalar(const struct gguf_kv *kv, char *out, size_t cap) {
    switch (kv->type) {
    case GGUF_TYPE_FLOAT32: case GGUF_TYPE_FLOAT64: return snprintf(out, cap, "%.9g", kv->val.f64);
    case GGUF_TYPE_BOOL: return snprintf(out, cap, "%s", kv->val.u64 ? "true" : "false");
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
        return snprintf(out, cap, "%" PRId64, kv->val.i64);
    default: return snprintf(out, cap, "%" PRIu64, kv->val.u64);
    }
}

#define META_ARRAY_SHOWN 8

pykv_status pykv_model_meta_value(const pykv_model *m, int32_t i, char *buf, int32_t cap, int32_t *n_out) {
    const struct gguf_kv *kv = meta_at(m, i);
    if (!kv) return PYKV_ERR_INVALID_ARG;
    if (kv->type == GGUF_TYPE_STRING) return put_bytes(kv->val.str.ptr, kv->val.str.len, buf, cap, n_out);
    char text[1024];
    size_t len = 0;
    if (kv->type != GGUF_TYPE_ARRAY) {
        len = (size_t)render_scalar(kv, text, sizeof(text));
    } else {
        len += (size_t)snprintf(text, sizeof(text), "[");
        uint64_t shown = kv->arr_n < META_ARRAY_SHOWN ? kv->arr_n : META_ARRAY_SHOWN;
        for (uint64_t j = 0; j < shown && len < sizeof(text) - 64; j++) {
            if (j) len += (size_t)snprintf(text + len, sizeof(text) - len, ", ");
            if (kv->arr_type == GGUF_TYPE_STRING) {
                struct gguf_str s = kv->arr_strs[j];
                len += (size_t)snprintf(text + len, sizeof(text) - len, "'%.*s'", (int)(s.len > 24 ? 24 : s.len), s.ptr);
            } else if (kv->arr_type == GGUF_TYPE_ARRAY) {
                len += (size_t)snprintf(text + len, sizeof(text) - len, "[...]");
            } else {
                struct gguf_kv el = { .type = kv->arr_type };
                if (kv->arr_type == GGUF_TYPE_FLOAT32 || kv->arr_type == GGUF_TYPE_FLOAT64) el.val.f64 = gguf_arr_float(kv, j);
                else el.val.i64 = gguf_arr_int(kv, j);
                len += (size_t)render_scalar(&el, text + len, sizeof(text) - len);
            }
        }
        if (len > sizeof(text) - 64) len = sizeof(text) - 64;
        len += (size_t)snprintf(text + len, sizeof(text) - len, "%s] (%" PRIu64 " %s)",
                                kv->arr_n > shown ? ", ..." : "", kv->arr_n, gguf_type_name(kv->arr_type));
    }
    if (len >= sizeof(text)) len = sizeof(text) - 1;
    return put_bytes(text, len, buf, cap, n_out);
}

pykv_status pykv_model_meta_string(const pykv_model *m, const char *key, char *buf, int32_t cap, int32_t *n_out) {
    if (!m || !key) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_meta_string: NULL argument");
    struct gguf_str s = { 0 };
    const struct gguf_kv *kv = gguf_find_kv(m->file, key);
    if (!kv) return pykv_error(PYKV_ERR_INVALID_ARG, "metadata key '%s' is not in the model", key);
    PYKV_TRY(gguf_get_str(m->file, key, 1, &s));
    return put_bytes(s.ptr, s.len, buf, cap, n_out);
}

int32_t pykv_model_tensor_count(const pykv_model *m) { return m ? (int32_t)m->file->n_tensors : 0; }

pykv_status pykv_model_tensor_info(const pykv_model *m, int32_t i, struct pykv_tensor_info *info) {
    if (!m || !info) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_tensor_info: NULL argument");
    if (info->struct_size != sizeof(*info))
        return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_tensor_info.struct_size mismatch (header/library mismatch)");
    if (i < 0 || (uint64_t)i >= m->file->n_tensors)
        return pykv_error(PYKV_ERR_INVALID_ARG, "tensor index %d out of range", i);
    const struct gguf_tensor *t = &m->file->tensors[i];
    info->name = t->name;
    info->type = t->type;
    info->n_dims = t->n_dims;
    for (int d = 0; d < 4; d++) info->ne[d] = t->ne[d];
    info->offset = t->offset;
    info->n_bytes = t->n_bytes;
    return PYKV_OK;
}
