// kv-cache.c - per-(layer, KV head) entry lists with real allocation accounting.
#include "kv/kv-cache.h"
#include "core/error.h"
#include "core/pages.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant.h"
#include "kv/kv-device.h"
#include "kv/kv-device-batch.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define KV_MIN_CAP 16
#define KV_DECODE_DROP 2   // evictions this small are decode steps (see kv_list_retain)

// Bytes per allocated entry: key, value, position, and the merge bookkeeping if enabled.
static int64_t entry_bytes(const struct kv_cache *c, const struct kv_list *l) {
    int64_t b = (int64_t)(kv_cache_key_bytes(c) + kv_cache_value_bytes(c)) + (int64_t)sizeof(int32_t);
    if (l->n_members) b += (int64_t)2 * sizeof(int32_t);
    return b;
}

static void account(struct kv_cache *c, int64_t delta) {
    const int64_t now = atomic_fetch_add_explicit(&c->bytes, delta, memory_order_relaxed) + delta;
    int64_t peak = atomic_load_explicit(&c->peak_bytes, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(&c->peak_bytes, &peak, now, memory_order_relaxed,
                                                                memory_order_relaxed)) {}
}

static void pool_free(struct kv_cache *c, struct kv_list *l) {
    account(c, -(int64_t)l->pool_cap * (int64_t)sizeof(float));
    free(l->member_pool);
    l->member_pool = NULL;
    l->pool_used = l->pool_cap = l->pool_live = 0;
    l->members_stale = 1;
}

// Entries [lo, hi) of a device list's merged-entry arrays changed: one more range to send,
// joined to one it touches, or everything once there are too many.
static void members_touch(struct kv_list *l, int32_t lo, int32_t hi) {
    if (l->members_stale || hi <= lo) return;
    for (int i = 0; i < l->members_dirty; i++)
        if (lo <= l->dirty_hi[i] && hi >= l->dirty_lo[i]) {
            l->dirty_lo[i] = lo < l->dirty_lo[i] ? lo : l->dirty_lo[i];
            l->dirty_hi[i] = hi > l->dirty_hi[i] ? hi : l->dirty_hi[i];
            return;
        }
    if (l->members_dirty == KV_MEMBER_RANGES) {
        l->members_stale = 1;
        return;
    }
    l->dirty_lo[l->members_dirty] = lo;
    l->dirty_hi[l->members_dirty++] = hi;
}

// Entry j becomes a single token again; its norms leave a gap in the pool (the pool goes
// when nothing in it is used any more).
static void free_members(struct kv_cache *c, struct kv_list *l, int32_t j) {
    if (!l->n_members || l->n_members[j] <= 1) return;
    l->pool_live -= l->n_members[j];
    l->n_members[j] = 1;
    if (l->pool_live == 0) pool_free(c, l);
}

// A new pool of cap floats (at least the live ones) holding the merged entries' norms
// without gaps, in entry order.
static pykv_status pool_rebuild(struct kv_cache *c, struct kv_list *l, int32_t cap) {
    float *pool = malloc((size_t)(cap > 0 ? cap : 1) * sizeof(float));
    if (!pool) return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
    int32_t used = 0;
    for (int32_t j = 0; j < l->n; j++) {
        if (l->n_members[j] <= 1) continue;
        memcpy(pool + used, l->member_pool + l->member_at[j], (size_t)l->n_members[j] * sizeof(float));
        l->member_at[j] = used;
        used += l->n_members[j];
    }
    free(l->member_pool);
    account(c, (int64_t)(cap - l->pool_cap) * (int64_t)sizeof(float));
    l->member_pool = pool;
    l->pool_used = used;
    l->pool_cap = cap;
    l->members_stale = 1;   // every offset changed
    return PYKV_OK;
}

// A device list's rows in GPU memory for a room of cap entries, given its room (old_cap) and
// rows before. Growing past the rows takes at least half as much again, and the rest of a
// prefill that keeps every entry (device_ahead), in steps of KV_DEVICE_ROOM_STEP rows: a new
// buffer means copying the list and recording the decode step's CUDA graph again, so a list
// growing a token at a time (decode) or a chunk at a time (prefill) moves every few hundred
// tokens, not every few. A room that shrinks to half the rows or less gives the rest back (a
// policy's compaction); one that grows within them keeps them.
int32_t kv_device_rows(const struct kv_cache *c, int32_t cap, int32_t old_cap, int32_t rows) {
    if (cap == 0) return 0;
    if (cap <= rows && (cap >= old_cap || cap > rows / 2)) return rows;
    int64_t want = cap;   // a shrink: the room, rounded up
    if (cap > rows) {     // growth: the room and what is ahead, at least half again the rows
        want = (int64_t)cap + c->device_ahead;
        if (want < (int64_t)rows + rows / 2) want = (int64_t)rows + rows / 2;
    }
    want = (want + KV_DEVICE_ROOM_STEP - 1) / KV_DEVICE_ROOM_STEP * KV_DEVICE_ROOM_STEP;
    if (want > c->max_entries) want = cap > c->max_entries ? cap : c->max_entries;
    return (int32_t)want;
}

// A device list's keys and values are resized in GPU memory (kv-device.h) when its room
// outgrows their rows or falls to half of them.
static pykv_status device_resize(struct kv_cache *c, struct kv_list *l, int32_t cap) {
    const int32_t rows = kv_device_rows(c, cap, l->cap, l->device_cap);
    if (rows == l->device_cap) return PYKV_OK;
    const size_t kb = kv_cache_key_bytes(c), vb = kv_cache_value_bytes(c), old = (size_t)l->device_cap;
    c->device_moves++;   // even a failed resize may have moved the keys
    PYKV_TRY(kv_device_resize(c->device, c->device_stream, &l->k, old * kb, (size_t)rows * kb));
    pykv_status st = kv_device_resize(c->device, c->device_stream, &l->v, old * vb, (size_t)rows * vb);
    if (st != PYKV_OK) {   // k already has the new size: bring it back so both agree with device_cap
        kv_device_resize(c->device, c->device_stream, &l->k, (size_t)rows * kb, old * kb);
        return st;
    }
    c->device_bytes += (int64_t)(rows - l->device_cap) * (int64_t)(kb + vb);
    l->device_cap = rows;
    return PYKV_OK;
}

// Everything of a resize but a device list's keys and values.
static pykv_status host_resize(struct kv_cache *c, struct kv_list *l, int32_t cap) {
    if (cap == 0) {
        if (l->member_pool) pool_free(c, l);
        if (!l->on_device) {
            pages_free(l->k);
            pages_free(l->v);
        }
        pages_free(l->pos);
        free(l->n_members); free(l->member_at);
        l->k = l->v = NULL;
        l->pos = NULL;
        account(c, -(int64_t)l->cap * entry_bytes(c, l));
        l->n_members = NULL;
        l->member_at = NULL;
        l->cap = 0;
        return PYKV_OK;
    }
    if (!l->on_device) {
        void *k = pages_realloc(l->k, (size_t)cap * kv_cache_key_bytes(c));
        if (!k) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
        l->k = k;
        void *v = pages_realloc(l->v, (size_t)cap * kv_cache_value_bytes(c));
        if (!v) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
        l->v = v;
    }
    int32_t *pos = pages_realloc(l->pos, (size_t)cap * sizeof(int32_t));
    if (!pos) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache to %d entries per head", cap);
    l->pos = pos;
    if (l->n_members) {
        int32_t *nm = realloc(l->n_members, (size_t)cap * sizeof(int32_t));
        if (!nm) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache");
        l->n_members = nm;
        int32_t *at = realloc(l->member_at, (size_t)cap * sizeof(int32_t));
        if (!at) return pykv_error(PYKV_ERR_NOMEM, "out of memory growing the KV cache");
        l->member_at = at;
    }
    account(c, (int64_t)(cap - l->cap) * entry_bytes(c, l));
    l->cap = cap;
    return PYKV_OK;
}

// A device list's staging buffers (kv_layer_stage) go with its room. While the list is staged
// they are its k and v, which host_resize frees itself.
static void stage_free(struct kv_list *l) {
    if (!l->on_device) return;
    pages_free(l->stage_k);
    pages_free(l->stage_v);
    l->stage_k = l->stage_v = NULL;
    l->stage_cap = 0;
}

static pykv_status list_resize(struct kv_cache *c, struct kv_list *l, int32_t cap) {
    if (cap == 0) stage_free(l);
    if (cap == l->cap) return PYKV_OK;
    if (l->on_device) PYKV_TRY(device_resize(c, l, cap));
    if (cap == 0 && l->member_block) {
        kv_device_resize(c->device, c->device_stream, &l->member_block, l->member_block_bytes, 0);
        l->member_block_bytes = 0;
    }
    l->members_stale = 1;   // the member arrays follow the room
    return host_resize(c, l, cap);
}

pykv_status kv_cache_init(struct kv_cache *c, int n_layer, int n_head_kv, int head_dim, int max_entries,
                          int fmt_k, int fmt_v) {
    memset(c, 0, sizeof(*c));
    for (int i = 0; i < 2; i++) {
        const int fmt = i ? fmt_v : fmt_k;
        if (fmt < 0 || fmt >= KV_N_FORMATS) return pykv_error(PYKV_ERR_INVALID_ARG, "unknown KV cache format %d", fmt);
        if (fmt == KV_Q8_0 && head_dim % KV_Q8_BLOCK != 0)
            return pykv_error(PYKV_ERR_INVALID_ARG, "a q8_0 KV cache needs a head size that is a multiple of %d; "
                              "this model's is %d (q8_0 was asked for the %s)", KV_Q8_BLOCK, head_dim, i ? "values" : "keys");
    }
    c->fmt_k = fmt_k;
    c->fmt_v = fmt_v;
    c->n_layer = n_layer;
    c->n_head_kv = n_head_kv;
    c->head_dim = head_dim;
    c->max_entries = max_entries;
    c->lists = calloc((size_t)n_layer * n_head_kv, sizeof(struct kv_list));
    if (!c->lists) return pykv_error(PYKV_ERR_NOMEM, "out of memory creating the KV cache");
    for (int i = 0; i < n_layer * n_head_kv; i++) {
        c->lists[i].fmt_k = fmt_k;
        c->lists[i].fmt_v = fmt_v;
    }
    return PYKV_OK;
}

void kv_cache_clear(struct kv_cache *c) {
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) {
        list_resize(c, &c->lists[i], 0);
        c->lists[i].n = 0;
    }
    c->bytes = 0;
    c->device_bytes = 0;
    c->peak_bytes = 0;
    c->evicted = 0;
    c->merged = 0;
}

void kv_cache_free(struct kv_cache *c) {
    if (!c->lists) return;
    kv_cache_clear(c);
    free(c->lists);
    c->lists = NULL;
}

pykv_status kv_list_reserve(struct kv_cache *c, struct kv_list *l, int32_t extra) {
    int64_t need = (int64_t)l->n + extra;
    if (need <= l->cap) return PYKV_OK;
    if (need > c->max_entries)
        return pykv_error(PYKV_ERR_CONTEXT_FULL, "a KV cache list is full: %lld entries needed, room for %d "
                          "(n_ctx and one prefill chunk); give a smaller budget or a larger n_ctx",
                          (long long)need, c->max_entries);
    // Grow by an eighth (amortised O(1) appends) so the slack stays small next to a budget.
    int64_t cap = l->cap + l->cap / 8;
    if (cap < need) cap = need;
    if (cap < KV_MIN_CAP) cap = KV_MIN_CAP;
    if (cap > c->max_entries) cap = c->max_entries;
    return list_resize(c, l, (int32_t)cap);
}

// d floats as Q8_0 blocks, as llama.cpp quantizes its cache: scale max|x| / 127 (stored
// as a half), each value x * (1 / scale) rounded to the nearest int8, ties to even (as
// the activation quantizer and the SIMD rounding do).
static void quantize_row_q8_0(const float *x, block_q8_0 *y, int32_t d) {
    for (int32_t b = 0; b < d / QK8_0; b++, x += QK8_0) {
        float amax = 0.0f;
        for (int i = 0; i < QK8_0; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        y[b].d = fp32_to_fp16(scale);
        for (int i = 0; i < QK8_0; i++) {
            const float q = nearbyintf(x[i] * inv);
            y[b].qs[i] = (int8_t)(q >= -127.0f && q <= 127.0f ? q : 0.0f);   // NaN (an inf in the block): 0
        }
    }
}
_Static_assert(KV_Q8_BLOCK == QK8_0 && KV_Q8_BLOCK_BYTES == sizeof(block_q8_0), "the cache's Q8_0 is GGUF's");

void kv_row_store(void *dst, int fmt, const float *x, int32_t d) {
    if (fmt == KV_F16) fp32_to_fp16_row(x, dst, d);
    else if (fmt == KV_Q8_0) quantize_row_q8_0(x, dst, d);
    else memcpy(dst, x, (size_t)d * sizeof(float));
}

void kv_list_set_kv(struct kv_list *l, int32_t j, const float *k, const float *v, int32_t d) {
    kv_row_store((void *)kv_key_row(l, j, d), l->fmt_k, k, d);
    kv_row_store((void *)kv_value_row(l, j, d), l->fmt_v, v, d);
}

const float *kv_row_f32(const void *src, int fmt, int32_t d, float *tmp) {
    if (fmt == KV_F32) return src;
    if (fmt == KV_F16) fp16_to_fp32_row(src, tmp, d);
    else dequant_row(kv_format_type(fmt), src, tmp, d);
    return tmp;
}

const float *kv_key_f32(const struct kv_list *l, int32_t j, int32_t d, float *tmp) {
    return kv_row_f32(kv_key_row(l, j, d), l->fmt_k, d, tmp);
}
const float *kv_value_f32(const struct kv_list *l, int32_t j, int32_t d, float *tmp) {
    return kv_row_f32(kv_value_row(l, j, d), l->fmt_v, d, tmp);
}

pykv_status kv_list_rows_f32(const struct kv_cache *c, const struct kv_list *l, int values, int32_t n, float *out) {
    const int fmt = values ? l->fmt_v : l->fmt_k;
    const int32_t d = c->head_dim;
    const size_t rb = kv_format_row_bytes(fmt, d);
    const void *base = values ? l->v : l->k;
    void *copy = NULL;
    if (l->on_device) {   // the stored rows come down once, then convert as a host list's
        if (!(copy = malloc((size_t)n * rb + 1))) return pykv_error(PYKV_ERR_NOMEM, "out of memory reading the KV cache");
        const pykv_status st = kv_list_read_rows(c, l, values, n, copy);
        if (st != PYKV_OK) {
            free(copy);
            return st;
        }
        base = copy;
    }
    for (int32_t j = 0; j < n; j++) {
        float *dst = out + (size_t)j * d;
        const float *row = kv_row_f32((const char *)base + (size_t)j * rb, fmt, d, dst);
        if (row != dst) memcpy(dst, row, (size_t)d * sizeof(float));
    }
    free(copy);
    return PYKV_OK;
}

// A device list's merged-entry block as the kernels read it: n_members, member_at (cap ints
// each), then the pool's used part. Its device room follows the pool's room, so that merges
// appending to the pool do not move it (a recorded decode step holds its address).
static size_t members_block_bytes(const struct kv_list *l) {
    return 2 * (size_t)l->cap * sizeof(int32_t) + (size_t)l->pool_used * sizeof(float);
}
static void members_block_fill(const struct kv_list *l, char *block) {
    const size_t ints = (size_t)l->cap * sizeof(int32_t);
    memcpy(block, l->n_members, ints);
    memcpy(block + ints, l->member_at, ints);
    if (l->pool_used) memcpy(block + 2 * ints, l->member_pool, (size_t)l->pool_used * sizeof(float));
}
static pykv_status members_block_room(struct kv_cache *c, struct kv_list *l) {
    const size_t bytes = members_block_bytes(l);
    if (bytes <= l->member_block_bytes) return PYKV_OK;
    const size_t room = 2 * (size_t)l->cap * sizeof(int32_t) + (size_t)(l->pool_cap > l->pool_used ? l->pool_cap : l->pool_used) * sizeof(float);
    PYKV_TRY(kv_device_resize(c->device, c->device_stream, &l->member_block, 0, room));   // the old contents are not kept
    l->member_block_bytes = room;
    c->device_moves++;
    return PYKV_OK;
}

// The block has gone up whole, or the changes since it last did.
static void members_sent(struct kv_list *l) {
    l->member_block_cap = l->cap;
    l->members_stale = 0;
    l->members_dirty = 0;
    l->pool_sent = l->pool_used;
}

pykv_status kv_list_sync_members(struct kv_cache *c, struct kv_list *l) {
    if (!l->on_device || !l->n_members || (!l->members_stale && !l->members_dirty && l->pool_sent == l->pool_used))
        return PYKV_OK;
    const size_t bytes = members_block_bytes(l);
    char *block = malloc(bytes + 1);
    if (!block) return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
    members_block_fill(l, block);
    pykv_status st = members_block_room(c, l);
    if (st == PYKV_OK) st = kv_device_write(c->device_stream, l->member_block, block, bytes);
    free(block);
    if (st == PYKV_OK) members_sent(l);
    return st;
}

pykv_status kv_list_sync_members_batched(struct kv_cache *c, struct kv_list *l, struct kv_batch *b) {
    if (!l->on_device || !l->n_members) return PYKV_OK;
    if (l->member_block_cap != l->cap || l->pool_used < l->pool_sent || members_block_bytes(l) > l->member_block_bytes)
        l->members_stale = 1;   // the block's layout or room changed: all of it
    if (l->members_stale) {
        PYKV_TRY(members_block_room(c, l));
        const size_t bytes = members_block_bytes(l);
        char *block = kv_batch_upload(b, &l->member_block, 0, bytes);
        if (!block) return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
        members_block_fill(l, block);
        members_sent(l);
        return PYKV_OK;
    }
    const size_t ints = (size_t)l->cap * sizeof(int32_t);
    for (int i = 0; i < l->members_dirty; i++) {   // the changed entries' counts and offsets
        const int32_t lo = l->dirty_lo[i], hi = l->dirty_hi[i];
        const size_t at = (size_t)lo * sizeof(int32_t), bytes = (size_t)(hi - lo) * sizeof(int32_t);
        for (int a = 0; a < 2; a++) {   // each written before the next upload, which may move the staging
            char *up = kv_batch_upload(b, &l->member_block, (int64_t)(a * ints + at), bytes);
            if (!up) return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
            memcpy(up, (a ? l->member_at : l->n_members) + lo, bytes);
        }
    }
    if (l->pool_used > l->pool_sent) {   // the norms appended since
        const size_t bytes = (size_t)(l->pool_used - l->pool_sent) * sizeof(float);
        char *norms = kv_batch_upload(b, &l->member_block, (int64_t)(2 * ints + (size_t)l->pool_sent * sizeof(float)), bytes);
        if (!norms) return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
        memcpy(norms, l->member_pool + l->pool_sent, bytes);
    }
    members_sent(l);
    return PYKV_OK;
}

// The list's staging buffers, with room for its entries (the ones it had when they have).
static pykv_status stage_buffers(const struct kv_cache *c, struct kv_list *l) {
    const int32_t cap = l->cap ? l->cap : 1;
    if (l->stage_k && l->stage_v && l->stage_cap >= cap) return PYKV_OK;
    pages_free(l->stage_k);
    pages_free(l->stage_v);
    l->stage_k = pages_realloc(NULL, (size_t)cap * kv_cache_key_bytes(c));
    l->stage_v = pages_realloc(NULL, (size_t)cap * kv_cache_value_bytes(c));
    l->stage_cap = l->stage_k && l->stage_v ? cap : 0;
    return l->stage_cap ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory bringing the KV cache to the host");
}

pykv_status kv_layer_stage(struct kv_cache *c, int layer, struct kv_staged *saved) {
    for (int g = 0; g < c->n_head_kv; g++) {
        struct kv_list *l = kv_cache_list(c, layer, g);
        saved[g] = (struct kv_staged){ l->k, l->v, l->cap, l->device_cap };
        pykv_status st = stage_buffers(c, l);
        if (st == PYKV_OK) st = kv_list_read_rows(c, l, 0, l->n, l->stage_k);
        if (st == PYKV_OK) st = kv_list_read_rows(c, l, 1, l->n, l->stage_v);
        if (st != PYKV_OK) {
            kv_layer_unstage(c, layer, saved);   // the lists staged before this one go back
            return st;
        }
        l->k = l->stage_k;
        l->v = l->stage_v;
        l->on_device = 0;
    }
    return PYKV_OK;
}

pykv_status kv_layer_unstage(struct kv_cache *c, int layer, struct kv_staged *saved) {
    const size_t kb = kv_cache_key_bytes(c), vb = kv_cache_value_bytes(c);
    pykv_status first = PYKV_OK;
    for (int g = 0; g < c->n_head_kv; g++) {
        struct kv_list *l = kv_cache_list(c, layer, g);
        if (l->on_device) continue;   // not staged (a failed kv_layer_stage stops early)
        void *dk = saved[g].k, *dv = saved[g].v;
        pykv_status st = PYKV_OK;
        const int32_t rows = kv_device_rows(c, l->cap, saved[g].cap, saved[g].device_cap);
        if (rows != saved[g].device_cap) {   // its room changed on the host past the device rows: new buffers
            void *nk = NULL, *nv = NULL;
            st = kv_device_resize(c->device, c->device_stream, &nk, 0, (size_t)rows * kb);
            if (st == PYKV_OK) st = kv_device_resize(c->device, c->device_stream, &nv, 0, (size_t)rows * vb);
            if (st == PYKV_OK) {
                kv_device_resize(c->device, c->device_stream, &dk, 0, 0);   // the old ones, after the work queued
                kv_device_resize(c->device, c->device_stream, &dv, 0, 0);
                dk = nk;
                dv = nv;
                c->device_bytes += (int64_t)(rows - saved[g].device_cap) * (int64_t)(kb + vb);
                c->device_moves++;
                l->device_cap = rows;
            } else {
                kv_device_resize(c->device, c->device_stream, &nk, 0, 0);
                kv_device_resize(c->device, c->device_stream, &nv, 0, 0);
                if (l->cap <= saved[g].device_cap) {
                    st = PYKV_OK;   // out of memory to shrink: the larger buffers hold the rows as well
                } else {            // out of memory to grow: the list keeps what the old rows hold
                    kv_list_truncate(c, l, l->n < saved[g].device_cap ? l->n : saved[g].device_cap);
                    host_resize(c, l, saved[g].device_cap);
                }
            }
        }
        void *hk = l->k, *hv = l->v;   // the host rows, as the list holds them now
        l->k = dk;
        l->v = dv;
        l->on_device = 1;
        l->members_stale = 1;
        pykv_status up = kv_list_write_rows(c, l, 0, l->n, hk);   // what the list holds, whatever happened
        if (up == PYKV_OK) up = kv_list_write_rows(c, l, 1, l->n, hv);
        if (up == PYKV_OK) up = kv_list_sync_members(c, l);
        if (st == PYKV_OK) st = up;
        l->stage_k = hk;   // the host buffers as the list left them (its room moves them), for next time
        l->stage_v = hv;
        l->stage_cap = hk && hv ? l->cap : 0;
        if (first == PYKV_OK) first = st;
    }
    return first;
}

pykv_status kv_layer_host_copy(const struct kv_cache *c, int layer, int values, struct kv_list *copy) {
    for (int g = 0; g < c->n_head_kv; g++) {
        copy[g] = c->lists[(size_t)layer * c->n_head_kv + g];
        copy[g].k = copy[g].v = NULL;
        copy[g].on_device = 0;
    }
    for (int g = 0; g < c->n_head_kv; g++) {
        const struct kv_list *l = &c->lists[(size_t)layer * c->n_head_kv + g];
        copy[g].k = malloc((size_t)l->n * kv_cache_key_bytes(c) + 1);
        if (values) copy[g].v = malloc((size_t)l->n * kv_cache_value_bytes(c) + 1);
        if (!copy[g].k || (values && !copy[g].v))
            return pykv_error(PYKV_ERR_NOMEM, "out of memory copying layer %d's KV cache to host memory", layer);
        PYKV_TRY(kv_list_read_rows(c, l, 0, l->n, copy[g].k));
        if (values) PYKV_TRY(kv_list_read_rows(c, l, 1, l->n, copy[g].v));
    }
    return PYKV_OK;
}

void kv_layer_host_copy_free(const struct kv_cache *c, struct kv_list *copy) {
    for (int g = 0; copy && g < c->n_head_kv; g++) {
        free(copy[g].k);
        free(copy[g].v);
    }
}

float kv_key_dot(const struct kv_list *l, int32_t j, const float *q, int32_t d) {
    const void *k = kv_key_row(l, j, d);
    if (l->fmt_k == KV_F32) return dot_f32(q, k, d);
    return vec_dot_for(kv_format_type(l->fmt_k))(k, q, d);
}

void kv_list_push(struct kv_cache *c, struct kv_list *l, const float *k, const float *v, int32_t pos) {
    kv_list_set_kv(l, l->n, k, v, c->head_dim);
    l->pos[l->n] = pos;
    if (l->n_members) l->n_members[l->n] = 1;
    l->n++;
}

void kv_list_push_positions(struct kv_list *l, int32_t pos0, int32_t T) {
    for (int32_t t = 0; t < T; t++) l->pos[l->n + t] = pos0 + t;
    if (l->n_members) {
        for (int32_t t = 0; t < T; t++) l->n_members[l->n + t] = 1;
        // a device list's block counts the entries past n as single tokens already, as the
        // host's arrays do; one made for a smaller room must be made again
        if (l->n + T > l->member_block_cap) l->members_stale = 1;
    }
    l->n += T;
}

void kv_cache_set_device(struct kv_cache *c, int first_layer, int device, void *stream) {
    c->device = device;
    c->device_stream = stream;
    for (int i = first_layer * c->n_head_kv; i < c->n_layer * c->n_head_kv; i++) c->lists[i].on_device = 1;
}

pykv_status kv_list_read_rows(const struct kv_cache *c, const struct kv_list *l, int values, int32_t n, void *dst) {
    const size_t bytes = (size_t)n * (values ? kv_cache_value_bytes(c) : kv_cache_key_bytes(c));
    const void *src = values ? l->v : l->k;
    if (l->on_device) return kv_device_read(c->device_stream, dst, src, bytes);
    if (bytes) memcpy(dst, src, bytes);
    return PYKV_OK;
}

pykv_status kv_list_write_rows(const struct kv_cache *c, struct kv_list *l, int values, int32_t n, const void *src) {
    const size_t bytes = (size_t)n * (values ? kv_cache_value_bytes(c) : kv_cache_key_bytes(c));
    void *dst = values ? l->v : l->k;
    if (l->on_device) return kv_device_write(c->device_stream, dst, src, bytes);
    if (bytes) memcpy(dst, src, bytes);
    return PYKV_OK;
}

pykv_status kv_list_enable_members(struct kv_cache *c, struct kv_list *l) {
    if (l->n_members) return PYKV_OK;
    int32_t cap = l->cap ? l->cap : 1;
    l->n_members = malloc((size_t)cap * sizeof(int32_t));
    l->member_at = calloc((size_t)cap, sizeof(int32_t));
    if (!l->n_members || !l->member_at) {
        free(l->n_members); free(l->member_at);
        l->n_members = NULL;
        l->member_at = NULL;
        return pykv_error(PYKV_ERR_NOMEM, "out of memory for merged KV entries");
    }
    for (int32_t j = 0; j < cap; j++) l->n_members[j] = 1;
    account(c, (int64_t)l->cap * (int64_t)(2 * sizeof(int32_t)));
    l->members_stale = 1;
    return PYKV_OK;
}

pykv_status kv_list_set_members(struct kv_cache *c, struct kv_list *l, int32_t j, const float *norms, int32_t n) {
    if (!l->n_members || j < 0 || j >= l->n || n < 1)
        return pykv_error(PYKV_ERR_INTERNAL, "kv_list_set_members: bad entry %d or count %d", j, n);
    int32_t before = l->n_members[j];
    free_members(c, l, j);
    if (n > 1) {
        // appended; when full, the pool is rebuilt without its gaps at twice what is live
        if (l->pool_used + (int64_t)n > l->pool_cap) PYKV_TRY(pool_rebuild(c, l, 2 * (l->pool_live + n)));
        float *copy = l->member_pool + l->pool_used;
        memcpy(copy, norms, (size_t)n * sizeof(float));
        // ascending, so attention finds a merged entry's largest logit at either end; an
        // insertion sort, as a merge appends a few norms to an already sorted list
        for (int32_t a = 1; a < n; a++) {
            const float x = copy[a];
            int32_t b = a;
            for (; b > 0 && copy[b - 1] > x; b--) copy[b] = copy[b - 1];
            copy[b] = x;
        }
        l->member_at[j] = l->pool_used;
        l->n_members[j] = n;
        l->pool_used += n;
        l->pool_live += n;
    }
    if (n > before) c->merged += n - before;
    members_touch(l, j, j + 1);
    return PYKV_OK;
}

// The list now holds n_keep entries: count the rest as evicted and give their memory back
// now, as the bytes reported are the bytes held. A decode step that drops an entry or two
// keeps the room (at most one growth step of an eighth), so a fixed-budget policy reuses it
// on the next token instead of shrinking and regrowing every list on every step.
static int32_t cap_after_drop(const struct kv_list *l, int32_t n_keep) {
    const int32_t dropped = l->n - n_keep, cap = n_keep > KV_MIN_CAP ? n_keep : KV_MIN_CAP;
    if (dropped <= KV_DECODE_DROP && l->cap - n_keep <= n_keep / 8 + KV_DECODE_DROP) return l->cap;
    return cap < l->cap ? cap : l->cap;
}
static pykv_status shrink_after_drop(struct kv_cache *c, struct kv_list *l, int32_t n_keep) {
    const int32_t cap = cap_after_drop(l, n_keep);
    c->evicted += l->n - n_keep;
    l->n = n_keep;
    return list_resize(c, l, cap);
}

// kv_drop_row's split: rows [h, n) move down by one, and row h - 1 fills slot j first.
static int32_t drop_split(int32_t n, int32_t j, int32_t tail) { return n - tail > j + 1 ? n - tail : j + 1; }

void kv_drop_row(void *base, size_t row_bytes, int32_t n, int32_t j, int32_t tail) {
    char *b = base;
    const int32_t h = drop_split(n, j, tail);
    if (h - 1 > j) memcpy(b + (size_t)j * row_bytes, b + (size_t)(h - 1) * row_bytes, row_bytes);
    memmove(b + (size_t)(h - 1) * row_bytes, b + (size_t)h * row_bytes, (size_t)(n - h) * row_bytes);
}

// keep ascends, so keep[x] - x never decreases, and a run of consecutive rows is a stretch of
// x where it stays the same: its end is found by galloping then bisecting rather than row by
// row (a decode step's eviction keeps all but one row: two runs, found in a few dozen probes).
static int32_t run_end(const int32_t *keep, int32_t n_keep, int32_t j) {
    const int32_t off = keep[j] - j;
    int32_t lo = j, step = 1;   // keep[lo] - lo == off
    while (lo + step < n_keep && keep[lo + step] - (lo + step) == off) {
        lo += step;
        step *= 2;
    }
    int32_t hi = lo + step < n_keep ? lo + step : n_keep;   // the first row past the run is below hi
    while (hi - lo > 1) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (keep[mid] - mid == off) lo = mid;
        else hi = mid;
    }
    return lo + 1;
}

void kv_compact_rows(void *base, size_t row_bytes, const int32_t *keep, int32_t n_keep) {
    for (int32_t j = 0; j < n_keep;) {
        const int32_t i = keep[j], end = run_end(keep, n_keep, j);
        if (i != j) memmove((char *)base + (size_t)j * row_bytes, (char *)base + (size_t)i * row_bytes, (size_t)(end - j) * row_bytes);
        j = end;
    }
}

// A device list's rows were gathered into new buffers of cap rows: its length, room and counts follow.
static pykv_status gathered(struct kv_cache *c, struct kv_list *l, int32_t n_keep, int32_t cap) {
    c->device_moves++;   // the kernels of a recorded decode step hold the old buffers
    c->device_bytes += (int64_t)(cap - l->device_cap) * (int64_t)(kv_cache_key_bytes(c) + kv_cache_value_bytes(c));
    l->device_cap = cap;
    c->evicted += l->n - n_keep;
    l->n = n_keep;
    return host_resize(c, l, cap);   // the positions' room follows
}

// A device list's keys and values follow keep on the GPU: in place, run by run, when the list
// keeps its room (a decode step), else gathered into buffers of the smaller size, which gives
// the memory back in the same pass. The host compacts the positions.
static pykv_status device_retain(struct kv_cache *c, struct kv_list *l, const int32_t *keep, int32_t n_keep) {
    const size_t kb = kv_cache_key_bytes(c), vb = kv_cache_value_bytes(c);
    const int32_t cap = cap_after_drop(l, n_keep);
    if (cap < l->cap) {
        PYKV_TRY(kv_device_gather(c->device, c->device_stream, &l->k, kb, &l->v, vb, keep, n_keep, cap));
        kv_compact_rows(l->pos, sizeof(int32_t), keep, n_keep);
        return gathered(c, l, n_keep, cap);
    }
    struct kv_row_move moves[KV_DECODE_DROP + 1];
    int n_moves = 0;
    for (int32_t j = 0; j < n_keep;) {
        const int32_t end = run_end(keep, n_keep, j);
        if (keep[j] != j) {
            if (n_moves == KV_DECODE_DROP + 1) {   // more runs than a decode step has: send these
                PYKV_TRY(kv_device_move_rows(c->device_stream, l->k, kb, moves, n_moves));
                PYKV_TRY(kv_device_move_rows(c->device_stream, l->v, vb, moves, n_moves));
                n_moves = 0;
            }
            moves[n_moves++] = (struct kv_row_move){ .dst = j, .src = keep[j], .len = end - j };
        }
        j = end;
    }
    PYKV_TRY(kv_device_move_rows(c->device_stream, l->k, kb, moves, n_moves));
    PYKV_TRY(kv_device_move_rows(c->device_stream, l->v, vb, moves, n_moves));
    kv_compact_rows(l->pos, sizeof(int32_t), keep, n_keep);
    return shrink_after_drop(c, l, n_keep);   // which keeps the room
}

pykv_status kv_list_retain(struct kv_cache *c, struct kv_list *l, const int32_t *keep, int32_t n_keep) {
    for (int32_t j = 0; j < n_keep; j++)   // checked first, so that a bad list changes nothing
        if (keep[j] < j || keep[j] >= l->n || (j > 0 && keep[j] <= keep[j - 1]))
            return pykv_error(PYKV_ERR_INTERNAL, "kv_list_retain: keep indices must be ascending and in range");
    if (l->n_members) {   // the dropped entries' members go first, then the counts follow the rows
        for (int32_t j = 0, d = 0; d < l->n; d++) {
            if (j < n_keep && keep[j] == d) j++;
            else free_members(c, l, d);
        }
        kv_compact_rows(l->n_members, sizeof(int32_t), keep, n_keep);
        kv_compact_rows(l->member_at, sizeof(int32_t), keep, n_keep);
        for (int32_t d = n_keep; d < l->n; d++) l->n_members[d] = 1;   // stale copies of moved entries
        l->members_stale = 1;   // a device list's block goes up whole (kv_list_sync_members)
    }
    if (l->on_device) {
        PYKV_TRY(device_retain(c, l, keep, n_keep));
    } else {
        kv_compact_rows(l->k, kv_cache_key_bytes(c), keep, n_keep);
        kv_compact_rows(l->v, kv_cache_value_bytes(c), keep, n_keep);
        kv_compact_rows(l->pos, sizeof(int32_t), keep, n_keep);
        PYKV_TRY(shrink_after_drop(c, l, n_keep));
    }
    // a compaction (end of a prefill) gives the pool's gaps and spare room back too
    return l->member_pool && l->pool_cap > l->pool_live ? pool_rebuild(c, l, l->pool_live) : PYKV_OK;
}

int kv_list_retain_gathers(const struct kv_list *l, int32_t n_keep) {
    return l->on_device && !l->n_members && n_keep >= 0 && n_keep < l->n && cap_after_drop(l, n_keep) < l->cap;
}

pykv_status kv_list_retain_device_indices(struct kv_cache *c, struct kv_list *l, const int32_t *d_keep,
                                          int32_t n_keep) {
    if (!kv_list_retain_gathers(l, n_keep))
        return pykv_error(PYKV_ERR_INTERNAL, "kv_list_retain_device_indices: a list that does not compact");
    const int32_t cap = cap_after_drop(l, n_keep);
    PYKV_TRY(kv_device_gather_indices(c->device, c->device_stream, &l->k, kv_cache_key_bytes(c), &l->v,
                                      kv_cache_value_bytes(c), d_keep, n_keep, cap));
    return gathered(c, l, n_keep, cap);
}

// A dropped entry's merged-entry bookkeeping follows the rows (host arrays, any list).
static void drop_members(struct kv_cache *c, struct kv_list *l, int32_t j, int32_t tail) {
    if (!l->n_members) return;
    free_members(c, l, j);
    kv_drop_row(l->n_members, sizeof(int32_t), l->n, j, tail);
    kv_drop_row(l->member_at, sizeof(int32_t), l->n, j, tail);
    l->n_members[l->n - 1] = 1;   // a stale copy of the moved last entry
    const int32_t h = drop_split(l->n, j, tail);
    members_touch(l, j, j + 1);
    members_touch(l, h - 1, l->n);
}

pykv_status kv_list_drop_batched(struct kv_cache *c, struct kv_list *l, int32_t j, int32_t tail,
                                 struct kv_batch *b) {
    if (j < 0 || j >= l->n || tail < 0) return pykv_error(PYKV_ERR_INTERNAL, "kv_list_drop: entry %d of %d", j, l->n);
    if (l->on_device) {
        const size_t kb = kv_cache_key_bytes(c), vb = kv_cache_value_bytes(c);
        const int32_t h = drop_split(l->n, j, tail);   // kv_drop_row's two moves
        const struct kv_row_move moves[2] = { { .dst = j, .src = h - 1, .len = h - 1 > j }, { .dst = h - 1, .src = h, .len = l->n - h } };
        if (b) {
            for (int i = 0; i < 2; i++) {
                PYKV_TRY(kv_batch_move(b, &l->k, kb, moves[i].dst, moves[i].src, moves[i].len));
                PYKV_TRY(kv_batch_move(b, &l->v, vb, moves[i].dst, moves[i].src, moves[i].len));
            }
        } else {
            PYKV_TRY(kv_device_move_rows(c->device_stream, l->k, kb, moves, 2));
            PYKV_TRY(kv_device_move_rows(c->device_stream, l->v, vb, moves, 2));
        }
        drop_members(c, l, j, tail);
        kv_drop_row(l->pos, sizeof(int32_t), l->n, j, tail);
        if (b) {   // the room stays: the queued moves read the rows where they are now
            c->evicted++;
            l->n--;
            return PYKV_OK;
        }
        return shrink_after_drop(c, l, l->n - 1);
    }
    kv_drop_row(l->k, kv_cache_key_bytes(c), l->n, j, tail);
    kv_drop_row(l->v, kv_cache_value_bytes(c), l->n, j, tail);
    kv_drop_row(l->pos, sizeof(int32_t), l->n, j, tail);
    drop_members(c, l, j, tail);
    return shrink_after_drop(c, l, l->n - 1);
}

pykv_status kv_list_drop(struct kv_cache *c, struct kv_list *l, int32_t j, int32_t tail) {
    return kv_list_drop_batched(c, l, j, tail, NULL);
}

void kv_list_truncate(struct kv_cache *c, struct kv_list *l, int32_t n) {
    for (int32_t j = n; j < l->n; j++) {
        if (l->n_members && l->n_members[j] > 1) l->members_stale = 1;   // past n counts as single again
        free_members(c, l, j);
    }
    if (n < l->n) l->n = n;
}

pykv_status kv_cache_keep_prefix(struct kv_cache *c, int32_t n_pos) {
    const int n_lists = c->n_layer * c->n_head_kv;
    for (int i = 0; i < n_lists; i++) {   // the cut itself cannot fail: every list is cut first
        struct kv_list *l = &c->lists[i];
        int32_t n = l->n;
        while (n > 0 && l->pos[n - 1] >= n_pos) n--;
        kv_list_truncate(c, l, n);
    }
    for (int i = 0; i < n_lists; i++) {   // then the room of a long cut goes back, so kv stats show what the prefix holds
        struct kv_list *l = &c->lists[i];
        const int32_t cap = l->n > KV_MIN_CAP ? l->n + l->n / 8 : KV_MIN_CAP;
        if (l->cap > cap) PYKV_TRY(list_resize(c, l, cap));
    }
    return PYKV_OK;
}

int64_t kv_cache_entries(const struct kv_cache *c) {
    int64_t total = 0;
    for (int i = 0; i < c->n_layer * c->n_head_kv; i++) total += c->lists[i].n;
    return total;
}
