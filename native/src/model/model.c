// model.c - reading hyperparameters and weights of the `llama` architecture from GGUF.
#include "model/model.h"
#include "kv/kv-cache.h"
#include "core/error.h"
#include "core/log.h"
#include "cpu/quant.h"
#include "model/offload.h"
#include "model/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Architectures whose GGUF layout is the llama one (Mistral files say "llama" too).
static const char *const llama_like_archs[] = { "llama", "mistral" };

struct arch_keys {
    char prefix[32];
};

static const char *key(const struct arch_keys *a, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%s.%s", a->prefix, suffix);
    return buf;
}

static pykv_status get_i32(const struct gguf_file *f, const struct arch_keys *a, const char *suffix,
                           int required, int32_t *out) {
    char k[128];
    int64_t v = *out;
    PYKV_TRY(gguf_get_int(f, key(a, suffix, k, sizeof(k)), required, &v));
    if (v < 0 || v > INT32_MAX) return pykv_error(PYKV_ERR_FORMAT, "GGUF metadata %s = %lld is out of range", k, (long long)v);
    *out = (int32_t)v;
    return PYKV_OK;
}

static pykv_status get_f32(const struct gguf_file *f, const struct arch_keys *a, const char *suffix,
                           float *out) {
    char k[128];
    double v = *out;
    PYKV_TRY(gguf_get_float(f, key(a, suffix, k, sizeof(k)), 0, &v));
    if (!isfinite(v) || v <= 0) return pykv_error(PYKV_ERR_FORMAT, "GGUF metadata %s = %g is invalid", k, v);
    *out = (float)v;
    return PYKV_OK;
}

static pykv_status read_hparams(pykv_model *m, const struct arch_keys *a) {
    const struct gguf_file *f = m->file;
    struct hparams *hp = &m->hp;
    hp->n_ctx_train = 2048;
    hp->rope_freq_base = 10000.0f;
    hp->rms_eps = 1e-5f;
    PYKV_TRY(get_i32(f, a, "context_length", 0, &hp->n_ctx_train));
    PYKV_TRY(get_i32(f, a, "embedding_length", 1, &hp->n_embd));
    PYKV_TRY(get_i32(f, a, "block_count", 1, &hp->n_layer));
    PYKV_TRY(get_i32(f, a, "attention.head_count", 1, &hp->n_head));
    hp->n_head_kv = hp->n_head;
    PYKV_TRY(get_i32(f, a, "attention.head_count_kv", 0, &hp->n_head_kv));
    PYKV_TRY(get_i32(f, a, "feed_forward_length", !m->vocab_only, &hp->n_ff));
    PYKV_TRY(get_f32(f, a, "rope.freq_base", &hp->rope_freq_base));
    PYKV_TRY(get_f32(f, a, "attention.layer_norm_rms_epsilon", &hp->rms_eps));

    if (hp->n_embd <= 0 || hp->n_head <= 0)
        return pykv_error(PYKV_ERR_FORMAT, "invalid model shape: n_embd=%d n_head=%d", hp->n_embd, hp->n_head);
    hp->head_dim = hp->n_embd / hp->n_head;
    PYKV_TRY(get_i32(f, a, "attention.key_length", 0, &hp->head_dim));
    hp->n_rot = hp->head_dim;
    PYKV_TRY(get_i32(f, a, "rope.dimension_count", 0, &hp->n_rot));
    if (hp->n_ctx_train <= 0) hp->n_ctx_train = 2048;

    if (hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv != 0)
        return pykv_error(PYKV_ERR_FORMAT, "invalid model shape: %d attention heads is not a multiple of %d KV heads",
                          hp->n_head, hp->n_head_kv);
    if (hp->head_dim > PYKV_MAX_HEAD_DIM)
        return pykv_error(PYKV_ERR_UNSUPPORTED, "head_dim %d is larger than the %d pykv supports", hp->head_dim, PYKV_MAX_HEAD_DIM);
    if (hp->head_dim <= 0 || hp->head_dim % 2 != 0 || hp->n_rot <= 0 || hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0)
        return pykv_error(PYKV_ERR_FORMAT, "invalid model shape: head_dim=%d rope dims=%d", hp->head_dim, hp->n_rot);
    if (hp->n_layer > 4096 || hp->n_embd > (1 << 20) || hp->n_head > 4096)
        return pykv_error(PYKV_ERR_FORMAT, "implausible model shape: %d layers, n_embd %d, %d heads",
                          hp->n_layer, hp->n_embd, hp->n_head);
    return PYKV_OK;
}

// Look up a weight and check its type and shape (ne0 = input features, ne1 = output features).
static pykv_status bind_tensor(pykv_model *m, struct tensor *t, const char *name, int64_t ne0, int64_t ne1,
                               int required) {
    const struct gguf_tensor *gt = gguf_find_tensor(m->file, name);
    if (!gt) {
        if (!required) return PYKV_OK;
        return pykv_error(PYKV_ERR_FORMAT, "model is missing tensor '%s'", name);
    }
    if (gt->ne[0] != ne0 || gt->ne[1] != ne1 || gt->ne[2] != 1 || gt->ne[3] != 1)
        return pykv_error(PYKV_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                          name, (long long)gt->ne[0], (long long)gt->ne[1], (long long)gt->ne[2],
                          (long long)gt->ne[3], (long long)ne0, (long long)ne1);
    if (!vec_dot_for(gt->type))
        return pykv_error(PYKV_ERR_UNSUPPORTED, "tensor '%s' has type %s, which pykv cannot compute with",
                          name, pykv_type_name(gt->type) ? pykv_type_name(gt->type) : "unknown");
    t->data = gt->data;
    t->type = gt->type;
    t->ne[0] = gt->ne[0];
    t->ne[1] = gt->ne[1];
    return PYKV_OK;
}

// A 1-D float vector (norm weights, rope factors), converted to float32 once at load.
static pykv_status load_vector(pykv_model *m, float **out, const char *name, int64_t n, int required) {
    struct tensor t = { 0 };
    PYKV_TRY(bind_tensor(m, &t, name, n, 1, required));
    if (!t.data) return PYKV_OK;
    *out = malloc((size_t)n * sizeof(float));
    if (!*out) return pykv_error(PYKV_ERR_NOMEM, "out of memory loading '%s'", name);
    return dequant_row(t.type, t.data, *out, n);
}

static pykv_status bind_weights(pykv_model *m) {
    const struct hparams *hp = &m->hp;
    int64_t q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    char name[96];
    PYKV_TRY(bind_tensor(m, &m->tok_embd, "token_embd.weight", hp->n_embd, hp->n_vocab, 1));
    PYKV_TRY(load_vector(m, &m->output_norm, "output_norm.weight", hp->n_embd, 1));
    PYKV_TRY(bind_tensor(m, &m->output, "output.weight", hp->n_embd, hp->n_vocab, 0));
    if (!m->output.data) {
        m->output = m->tok_embd;
        m->tied_output = 1;
    }
    PYKV_TRY(load_vector(m, &m->rope_freqs, "rope_freqs.weight", hp->n_rot / 2, 0));

    m->layers = calloc((size_t)hp->n_layer, sizeof(struct layer_weights));
    if (!m->layers) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    for (int l = 0; l < hp->n_layer; l++) {
        struct layer_weights *w = &m->layers[l];
#define BLK(suffix) (snprintf(name, sizeof(name), "blk.%d.%s", l, suffix), name)
        PYKV_TRY(load_vector(m, &w->attn_norm, BLK("attn_norm.weight"), hp->n_embd, 1));
        PYKV_TRY(bind_tensor(m, &w->wq, BLK("attn_q.weight"), hp->n_embd, q_dim, 1));
        PYKV_TRY(bind_tensor(m, &w->wk, BLK("attn_k.weight"), hp->n_embd, kv_dim, 1));
        PYKV_TRY(bind_tensor(m, &w->wv, BLK("attn_v.weight"), hp->n_embd, kv_dim, 1));
        PYKV_TRY(bind_tensor(m, &w->wo, BLK("attn_output.weight"), q_dim, hp->n_embd, 1));
        PYKV_TRY(load_vector(m, &w->ffn_norm, BLK("ffn_norm.weight"), hp->n_embd, 1));
        PYKV_TRY(bind_tensor(m, &w->w_gate, BLK("ffn_gate.weight"), hp->n_embd, hp->n_ff, 1));
        PYKV_TRY(bind_tensor(m, &w->w_up, BLK("ffn_up.weight"), hp->n_embd, hp->n_ff, 1));
        PYKV_TRY(bind_tensor(m, &w->w_down, BLK("ffn_down.weight"), hp->n_ff, hp->n_embd, 1));
#undef BLK
    }
    return PYKV_OK;
}

static pykv_status load(pykv_model *m) {
    struct gguf_str arch = { 0 };
    PYKV_TRY(gguf_get_str(m->file, "general.architecture", 1, &arch));
    struct arch_keys a = { { 0 } };
    for (size_t i = 0; i < sizeof(llama_like_archs) / sizeof(llama_like_archs[0]); i++)
        if (gguf_str_eq(arch, llama_like_archs[i])) snprintf(a.prefix, sizeof(a.prefix), "%s", llama_like_archs[i]);
    if (!a.prefix[0])
        return pykv_error(PYKV_ERR_UNSUPPORTED, "model architecture '%.*s' is not supported (pykv runs llama and mistral)",
                          (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
    PYKV_TRY(read_hparams(m, &a));
    PYKV_TRY(vocab_load(m->file, &m->vocab));
    m->hp.n_vocab = vocab_n_tokens(m->vocab);
    if (m->vocab_only) return PYKV_OK;
    return bind_weights(m);
}

void pykv_model_default_params(struct pykv_model_params *p) {
    if (!p) return;
    memset(p, 0, sizeof(*p));
    p->struct_size = sizeof(*p);
    p->use_mmap = 1;
}

pykv_status pykv_model_load(const char *path, const struct pykv_model_params *params, pykv_model **out) {
    pykv_clear_error();
    if (!out) return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_load: out is NULL");
    *out = NULL;
    struct pykv_model_params p;
    pykv_model_default_params(&p);
    if (params) {
        if (params->struct_size != sizeof(p))
            return pykv_error(PYKV_ERR_INVALID_ARG, "pykv_model_params.struct_size is %zu, expected %zu (header/library mismatch)",
                              params->struct_size, sizeof(p));
        p = *params;
    }
    pykv_model *m = calloc(1, sizeof(*m));
    if (!m) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    m->vocab_only = p.vocab_only != 0;
    pykv_status st = gguf_open(path, p.use_mmap, &m->file);
    if (st == PYKV_OK) st = load(m);
    if (st == PYKV_OK) st = model_offload(m, p.n_gpu_layers, p.main_gpu);
    if (st != PYKV_OK) {
        pykv_model_free(m);
        return st;
    }
    LOG_INFO("loaded %s: %d layers, n_embd %d, %d heads (%d KV), vocab %d", path, m->hp.n_layer, m->hp.n_embd,
             m->hp.n_head, m->hp.n_head_kv, m->hp.n_vocab);
    *out = m;
    return PYKV_OK;
}

void pykv_model_free(pykv_model *m) {
    if (!m) return;
    model_offload_free(m);
    if (m->layers) {
        for (int l = 0; l < m->hp.n_layer; l++) {
            free(m->layers[l].attn_norm);
            free(m->layers[l].ffn_norm);
        }
        free(m->layers);
    }
    free(m->output_norm);
    free(m->rope_freqs);
    vocab_free(m->vocab);
    gguf_close(m->file);
    free(m);
}

const struct vocab *model_vocab(const pykv_model *m) { return m->vocab; }
