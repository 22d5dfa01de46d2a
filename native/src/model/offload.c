// offload.c - copying the offloaded layers' weights to the GPU (offload.h).
#include "model/offload.h"
#include "core/error.h"
#include "core/log.h"
#include "cpu/quant.h"
#include "model/types.h"

#include <stdlib.h>
#include <string.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/kernels.h"

#define ARENA_ALIGN 256

static size_t align_up(size_t n) { return (n + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN; }

// The type a weight takes on the GPU: its own, or F16 where no kernel reads it.
static int32_t device_type(int32_t type) { return cuda_matmul_supported(type) ? type : PYKV_TYPE_F16; }

static size_t tensor_bytes(const struct tensor *t) {
    return align_up((size_t)type_row_bytes(device_type(t->type), t->ne[0]) * (size_t)t->ne[1]);
}

// Places tensors in the arena one after another; counts only while base is NULL.
struct arena {
    char  *base;
    size_t used;
};

static void *arena_take(struct arena *a, size_t bytes) {
    void *p = a->base ? a->base + a->used : NULL;
    a->used += align_up(bytes);
    return p;
}

// Copy a weight, converting it to F16 row by row when the kernels do not read its type.
static pykv_status put_tensor(struct arena *a, struct gpu_tensor *g, const struct tensor *t) {
    g->type = device_type(t->type);
    g->ne[0] = t->ne[0];
    g->ne[1] = t->ne[1];
    g->data = arena_take(a, tensor_bytes(t));
    if (!a->base) return PYKV_OK;
    const size_t src_row = (size_t)type_row_bytes(t->type, t->ne[0]);
    if (g->type == t->type) return cuda_upload(g->data, t->data, src_row * (size_t)t->ne[1]);
    float *row = malloc((size_t)t->ne[0] * sizeof(float));
    uint16_t *half = malloc((size_t)t->ne[0] * sizeof(uint16_t));
    pykv_status st = row && half ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory converting a weight to f16");
    for (int64_t r = 0; r < t->ne[1] && st == PYKV_OK; r++) {
        st = dequant_row(t->type, (const char *)t->data + (size_t)r * src_row, row, t->ne[0]);
        if (st != PYKV_OK) break;
        fp32_to_fp16_row(row, half, t->ne[0]);
        st = cuda_upload((char *)g->data + (size_t)r * (size_t)t->ne[0] * 2, half, (size_t)t->ne[0] * 2);
    }
    free(row);
    free(half);
    return st;
}

// Weights with the same row length and a quantised type the kernels read as is, stored back
// to back as one matrix (their rows in order) when the arena is placed; *whole names it.
// Otherwise each is placed on its own and whole->data stays NULL.
static pykv_status put_group(struct arena *a, struct gpu_tensor *whole, struct gpu_tensor *const *g,
                             const struct tensor *const *t, int n) {
    int same = device_type(t[0]->type) == t[0]->type && cuda_type_quantised(t[0]->type);
    for (int i = 1; i < n; i++) same = same && t[i]->type == t[0]->type && t[i]->ne[0] == t[0]->ne[0];
    memset(whole, 0, sizeof(*whole));
    if (!same) {
        for (int i = 0; i < n; i++) PYKV_TRY(put_tensor(a, g[i], t[i]));
        return PYKV_OK;
    }
    const size_t row = (size_t)type_row_bytes(t[0]->type, t[0]->ne[0]);
    int64_t rows = 0;
    for (int i = 0; i < n; i++) rows += t[i]->ne[1];
    char *base = arena_take(a, row * (size_t)rows);
    whole->data = base;
    whole->type = t[0]->type;
    whole->ne[0] = t[0]->ne[0];
    whole->ne[1] = rows;
    for (int i = 0, r = 0; i < n; r += (int)t[i]->ne[1], i++) {
        g[i]->type = t[i]->type;
        g[i]->ne[0] = t[i]->ne[0];
        g[i]->ne[1] = t[i]->ne[1];
        g[i]->data = base ? base + (size_t)r * row : NULL;
        if (base) PYKV_TRY(cuda_upload(g[i]->data, t[i]->data, row * (size_t)t[i]->ne[1]));
    }
    return PYKV_OK;
}

static pykv_status put_vector(struct arena *a, float **g, const float *x, int64_t n) {
    *g = arena_take(a, (size_t)n * sizeof(float));
    return a->base ? cuda_upload(*g, x, (size_t)n * sizeof(float)) : PYKV_OK;
}

// Lay out (or, with a->base set, copy) every offloaded tensor.
static pykv_status place_all(const pykv_model *m, struct model_gpu *g, struct arena *a) {
    const struct hparams *hp = &m->hp;
    for (int l = g->first_layer; l < hp->n_layer; l++) {
        const struct layer_weights *w = &m->layers[l];
        struct gpu_layer *d = &g->layers[l - g->first_layer];
        PYKV_TRY(put_vector(a, &d->attn_norm, w->attn_norm, hp->n_embd));
        PYKV_TRY(put_vector(a, &d->ffn_norm, w->ffn_norm, hp->n_embd));
        struct gpu_tensor *qkv[3] = { &d->wq, &d->wk, &d->wv }, *gate_up[2] = { &d->w_gate, &d->w_up };
        const struct tensor *qkv_src[3] = { &w->wq, &w->wk, &w->wv }, *gate_up_src[2] = { &w->w_gate, &w->w_up };
        PYKV_TRY(put_group(a, &d->wqkv, qkv, qkv_src, 3));
        PYKV_TRY(put_tensor(a, &d->wo, &w->wo));
        PYKV_TRY(put_group(a, &d->w_gate_up, gate_up, gate_up_src, 2));
        PYKV_TRY(put_tensor(a, &d->w_down, &w->w_down));
    }
    if (g->output) {
        PYKV_TRY(put_vector(a, &g->output_norm, m->output_norm, hp->n_embd));
        PYKV_TRY(put_tensor(a, &g->out, &m->output));
    }
    return PYKV_OK;
}

pykv_status model_offload(pykv_model *m, int32_t n_gpu_layers, int32_t main_gpu) {
    if (n_gpu_layers == 0 || m->vocab_only) return PYKV_OK;
    const int n_dev = cuda_device_count();
    if (n_dev == 0) {
        LOG_WARN("n_gpu_layers = %d, but %s: every layer runs on the CPU", n_gpu_layers, cuda_unavailable_reason());
        return PYKV_OK;
    }
    if (main_gpu < 0 || main_gpu >= n_dev)
        return pykv_error(PYKV_ERR_INVALID_ARG, "main_gpu = %d, but this machine has %d CUDA device%s (0..%d)", main_gpu,
                          n_dev, n_dev == 1 ? "" : "s", n_dev - 1);
    PYKV_TRY(cuda_set_device(main_gpu));
    const int n_layer = m->hp.n_layer;
    const int n = n_gpu_layers < 0 || n_gpu_layers > n_layer ? n_layer + 1 : n_gpu_layers;
    struct model_gpu *g = calloc(1, sizeof(*g));
    if (!g) return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    g->device = main_gpu;
    g->first_layer = n_layer - (n < n_layer ? n : n_layer);
    g->output = n > n_layer;
    g->layers = calloc((size_t)(n_layer - g->first_layer) + 1, sizeof(*g->layers));
    if (!g->layers) {
        free(g);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory");
    }
    // sized first, so that too little GPU memory is an error before anything is copied
    struct arena a = { NULL, 0 };
    pykv_status st = place_all(m, g, &a);
    size_t free_b = 0, total_b = 0;
    if (st == PYKV_OK) st = cuda_mem_info(&free_b, &total_b);
    if (st == PYKV_OK && a.used > free_b)
        st = pykv_error(PYKV_ERR_NOMEM, "not enough GPU memory to offload %d layer%s%s: %.1f MiB needed, %.1f MiB free "
                        "of %.1f MiB (give fewer GPU layers)", n_layer - g->first_layer,
                        n_layer - g->first_layer == 1 ? "" : "s", g->output ? " and the classifier" : "",
                        (double)a.used / (1 << 20), (double)free_b / (1 << 20), (double)total_b / (1 << 20));
    if (st == PYKV_OK) st = cuda_alloc(&g->arena, a.used, "the model's weights");
    if (st == PYKV_OK) {
        g->bytes = a.used;
        a = (struct arena){ g->arena, 0 };
        st = place_all(m, g, &a);
    }
    m->gpu = g;
    if (st != PYKV_OK) {
        model_offload_free(m);
        return st;
    }
    LOG_INFO("offloaded %d of %d layers%s to CUDA device %d (%.1f MiB)", n_layer - g->first_layer, n_layer,
             g->output ? " and the classifier" : "", main_gpu, (double)g->bytes / (1 << 20));
    return PYKV_OK;
}

void model_offload_free(pykv_model *m) {
    if (!m->gpu) return;
    cuda_free(m->gpu->arena);
    free(m->gpu->layers);
    free(m->gpu);
    m->gpu = NULL;
}

#else

pykv_status model_offload(pykv_model *m, int32_t n_gpu_layers, int32_t main_gpu) {
    (void)main_gpu;
    if (n_gpu_layers != 0 && !m->vocab_only)
        LOG_WARN("n_gpu_layers = %d, but this build of pykv has no CUDA backend (build it with -DPYKV_CUDA=ON): "
                 "every layer runs on the CPU", n_gpu_layers);
    return PYKV_OK;
}

void model_offload_free(pykv_model *m) { (void)m; }

#endif
