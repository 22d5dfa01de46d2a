// kv-cache.h - the ragged KV cache: one list of entries per (layer, KV head).
//
// Each list owns its keys (post-RoPE), values and the original position of every entry,
// and has its own length, so eviction policies can keep different numbers of entries per
// head and per layer. Storage grows by an eighth and shrinks when a policy compacts a list,
// so the bytes reported are the bytes really allocated. An offloaded list's keys and values
// sit in GPU rows that grow in larger steps (device_bytes counts them): a new buffer there
// costs a copy and a new recording of the decode step. Keys and values are stored as
// IEEE halves (the default, as llama.cpp), as floats (the exact path) or as Q8_0 blocks
// (llama.cpp's `-ctk q8_0`/`-ctv q8_0`: 32 int8 and one half scale, 34 bytes per 32
// values); keys and values may differ, as llama.cpp's -ctk and -ctv may. Code outside
// kv-cache.c and the attention kernels reads them through the accessors below.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "pykv.h"

#define PYKV_MAX_HEAD_DIM 512   // the model loader refuses larger heads

// How a cache stores its keys and values (the kernels are compiled once per format).
enum kv_format { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2, KV_N_FORMATS };
#define KV_Q8_BLOCK 32        // values per Q8_0 block
#define KV_Q8_BLOCK_BYTES 34  // its half scale, then 32 int8

// The tensor type (enum pykv_type) of each format, as pykv_context_params.kv_type names it.
static inline int32_t kv_format_type(int fmt) {
    return fmt == KV_F16 ? PYKV_TYPE_F16 : fmt == KV_Q8_0 ? PYKV_TYPE_Q8_0 : PYKV_TYPE_F32;
}
// The format that stores a tensor type; -1 when no cache format does.
static inline int kv_format_of_type(int32_t type) {
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++)
        if (kv_format_type(fmt) == type) return fmt;
    return -1;
}

static inline const char *kv_format_name(int fmt) {
    return fmt == KV_F32 ? "f32" : fmt == KV_F16 ? "f16" : fmt == KV_Q8_0 ? "q8_0" : "unknown";
}

// The key and value formats as one integer (a saved state's header): the format alone when
// they are the same, as in the states written before they could differ.
static inline int32_t kv_formats_code(int fmt_k, int fmt_v) {
    return fmt_k == fmt_v ? fmt_k : fmt_k + KV_N_FORMATS * (fmt_v + 1);
}
// Its inverse: 0 when code names no pair of formats.
static inline int kv_formats_of_code(int32_t code, int *fmt_k, int *fmt_v) {
    if (code < 0 || code >= KV_N_FORMATS * (KV_N_FORMATS + 1)) return 0;
    *fmt_k = code % KV_N_FORMATS;
    *fmt_v = code < KV_N_FORMATS ? code : code / KV_N_FORMATS - 1;
    return 1;
}

// Bytes of one stored row of d values (d a multiple of KV_Q8_BLOCK for Q8_0).
static inline size_t kv_format_row_bytes(int fmt, int d) {
    return fmt == KV_Q8_0 ? (size_t)(d / KV_Q8_BLOCK) * KV_Q8_BLOCK_BYTES : (size_t)d * (fmt == KV_F16 ? 2 : 4);
}

#define KV_MEMBER_RANGES 4   // changed ranges of a list's merged entries tracked before all of them go up

struct kv_list {
    int32_t  n;     // entries in use
    int32_t  cap;   // entries allocated
    void    *k;     // (cap, head_dim) halves or floats
    void    *v;     // (cap, head_dim)
    int32_t *pos;   // (cap) original sequence positions
    // Merged entries (EMS): NULL until a merging policy calls kv_list_enable_members. Entry
    // j then stands for n_members[j] tokens; when that is more than one, its key is a unit
    // direction and its members' key norms, in ascending order (kept by kv_list_set_members,
    // whatever order it is given), are member_pool[member_at[j] ..] (kv_member_norms):
    // attention expands the entry into one logit per member, norm * (q . key) / sqrt(d),
    // all sharing its value. One pool per list, so that attention reads the norms of a
    // list's merged entries from one block instead of one allocation each.
    int32_t *n_members;     // (cap)
    int32_t *member_at;     // (cap) offset of a merged entry's norms in member_pool
    float   *member_pool;   // (pool_cap) norms; a merge appends, a drop leaves a gap
    int32_t  pool_used;     // floats appended since the pool was last rebuilt
    int32_t  pool_cap;      // floats allocated
    int32_t  pool_live;     // floats that belong to entries (the rest are gaps)
    int32_t  fmt_k;         // enum kv_format of the cache's keys, copied here for the kernels
    int32_t  fmt_v;         // and of its values
    // An offloaded layer's list: k and v are GPU memory (kv-device.h), written and read by
    // the CUDA kernels only; pos and the counts stay here. Set by kv_cache_set_device on an
    // empty list.
    int32_t  on_device;
    int32_t  device_cap;   // a device list's rows allocated in GPU memory: cap or more (kv_device_rows)
    // A device list's merged entries as the attention kernels read them (kv_list_sync_members):
    // n_members, member_at (member_block_cap ints each) and the pool, in GPU memory; stale
    // once the host's change wholesale. Changes to a few entries (a merge, a decode step's
    // drop) are kept as ranges of entries [lo, hi), with the pool's floats from pool_sent on,
    // so that only those go up (kv_list_sync_members_batched).
    void    *member_block;
    size_t   member_block_bytes;
    int32_t  member_block_cap;
    int32_t  members_stale;
    int32_t  members_dirty;                          // ranges in use
    int32_t  dirty_lo[KV_MEMBER_RANGES], dirty_hi[KV_MEMBER_RANGES];
    int32_t  pool_sent;
    // A device list's host buffers for kv_layer_stage (room stage_cap), kept from one staging
    // to the next so that a decode step does not map and fault in fresh pages; freed with the
    // list's room.
    void    *stage_k, *stage_v;
    int32_t  stage_cap;
};

struct kv_cache {
    int32_t         n_layer;
    int32_t         n_head_kv;
    int32_t         head_dim;
    int32_t         max_entries;   // per list (n_ctx)
    int32_t         fmt_k;         // enum kv_format of the keys
    int32_t         fmt_v;         // of the values
    struct kv_list *lists;         // (n_layer * n_head_kv)
    // Counters: atomic, as a policy may evict from different lists on different threads.
    _Atomic int64_t bytes;
    _Atomic int64_t peak_bytes;
    _Atomic int64_t evicted;
    _Atomic int64_t merged;
    _Atomic int64_t device_bytes;   // GPU memory of the device lists' keys and values (their rows)
    int32_t         device;         // the CUDA device of the device lists
    void           *device_stream;  // the context's stream (a cuda_stream) their memory work runs on
    int64_t         device_moves;   // counts the device lists' reallocations (a recorded decode
                                    // step holds their addresses: forward-gpu.c)
    int32_t         device_ahead;   // entries every list will take after this chunk (the rest of a
                                    // prefill that keeps every entry): a device list growing now
                                    // takes GPU rows for them too
};

pykv_status     kv_cache_init(struct kv_cache *c, int n_layer, int n_head_kv, int head_dim, int max_entries,
                              int fmt_k, int fmt_v);
void            kv_cache_free(struct kv_cache *c);
void            kv_cache_clear(struct kv_cache *c);   // drops every entry and its memory

// Bytes of one key, of one value, as stored.
static inline size_t kv_cache_key_bytes(const struct kv_cache *c) { return kv_format_row_bytes(c->fmt_k, c->head_dim); }
static inline size_t kv_cache_value_bytes(const struct kv_cache *c) { return kv_format_row_bytes(c->fmt_v, c->head_dim); }

static inline struct kv_list *kv_cache_list(struct kv_cache *c, int layer, int head) {
    return &c->lists[(size_t)layer * c->n_head_kv + head];
}

// Entry j's member norms (ascending, n_members[j] of them), or NULL for a single token.
static inline const float *kv_member_norms(const struct kv_list *l, int32_t j) {
    return l->n_members && l->n_members[j] > 1 ? l->member_pool + l->member_at[j] : NULL;
}

// The largest member logit of a merged entry for q . key = s, from its smallest and largest
// norms (a loop over several query rows reads them once): with positive norms it is s times
// the largest norm for s >= 0, the smallest otherwise, i.e. the larger of the two products
// (exactly: rounding is monotone).
static inline float kv_member_logit_max_of(float lo_norm, float hi_norm, float s) {
    const float lo = s * lo_norm, hi = s * hi_norm;
    return lo > hi ? lo : hi;
}
// The same for entry j of a list (s itself for a single token). Norms are kept ascending,
// so the smallest and largest are the first and the last.
static inline float kv_member_logit_max(const struct kv_list *l, int32_t j, float s) {
    const float *norm = kv_member_norms(l, j);
    return norm ? kv_member_logit_max_of(norm[0], norm[l->n_members[j] - 1], s) : s;
}

// Make room for `extra` more entries in a list.
pykv_status kv_list_reserve(struct kv_cache *c, struct kv_list *l, int32_t extra);
// The GPU rows of a device list whose room goes from old_cap to cap entries, holding rows now.
#define KV_DEVICE_ROOM_STEP 256
int32_t     kv_device_rows(const struct kv_cache *c, int32_t cap, int32_t old_cap, int32_t rows);

// Key j, value j of a list, in the stored type.
static inline const void *kv_key_row(const struct kv_list *l, int32_t j, int32_t d) {
    return (const char *)l->k + (size_t)j * kv_format_row_bytes(l->fmt_k, d);
}
static inline const void *kv_value_row(const struct kv_list *l, int32_t j, int32_t d) {
    return (const char *)l->v + (size_t)j * kv_format_row_bytes(l->fmt_v, d);
}
// Key (or value) j as d floats: a pointer into the list when stored as floats, otherwise
// converted into tmp (d floats).
const float *kv_key_f32(const struct kv_list *l, int32_t j, int32_t d, float *tmp);
const float *kv_value_f32(const struct kv_list *l, int32_t j, int32_t d, float *tmp);
// The first n keys (values = 0) or values (values = 1) of a list as floats, (n, head_dim) in
// out, wherever they are stored (a device list's come down once).
pykv_status kv_list_rows_f32(const struct kv_cache *c, const struct kv_list *l, int values, int32_t n, float *out);
// copy[g] = list g of `layer` with its keys (and its values when asked; v is NULL otherwise)
// copied into host memory: a list that reads as a host list (kv_key_f32 and the rest) for
// code that scores a layer on the GPU on the host. The copy's rows are freed by
// kv_layer_host_copy_free (also after a failure); the rest belongs to the cache.
pykv_status kv_layer_host_copy(const struct kv_cache *c, int layer, int values, struct kv_list *copy);
void        kv_layer_host_copy_free(const struct kv_cache *c, struct kv_list *copy);
// q . key j
float kv_key_dot(const struct kv_list *l, int32_t j, const float *q, int32_t d);
// Overwrite entry j's key and value (d floats each, stored in the list's type).
void kv_list_set_kv(struct kv_list *l, int32_t j, const float *k, const float *v, int32_t d);
// One row of d floats stored in format fmt at dst, as a list stores it; and a stored row as
// d floats (src itself for f32, otherwise converted into tmp).
void         kv_row_store(void *dst, int fmt, const float *x, int32_t d);
const float *kv_row_f32(const void *src, int fmt, int32_t d, float *tmp);

// Append one entry (copies head_dim floats of k and v). Host lists only.
void kv_list_push(struct kv_cache *c, struct kv_list *l, const float *k, const float *v, int32_t pos);
// A device list's bookkeeping for the T entries a kernel has just stored after its last one:
// their positions pos0, pos0 + 1, ...
void kv_list_push_positions(struct kv_list *l, int32_t pos0, int32_t T);

// Keep the keys and values of every list of layers [first_layer, n_layer) in the memory of
// CUDA device `device`, allocated, copied and freed in order on `stream` (a cuda_stream, the
// context's). The cache must be empty.
void kv_cache_set_device(struct kv_cache *c, int first_layer, int device, void *stream);
// Copy n entries' keys (values = 0) or values (values = 1) of a list, wherever they are
// stored, from or to host memory (saved states).
pykv_status kv_list_read_rows(const struct kv_cache *c, const struct kv_list *l, int values, int32_t n, void *dst);
pykv_status kv_list_write_rows(const struct kv_cache *c, struct kv_list *l, int values, int32_t n, const void *src);

// Keep only the entries whose indices are listed in keep (ascending, n_keep of them), and
// give back the memory no longer needed (a decode step's one or two dropped entries leave
// their room for the next token). Counts the dropped entries as evicted. A device list's keys
// and values are moved by kernels queued on the cache's stream; its merged-entry block is
// then stale, for kv_list_sync_members to send whole.
pykv_status kv_list_retain(struct kv_cache *c, struct kv_list *l, const int32_t *keep, int32_t n_keep);
// Whether kv_list_retain of n_keep entries of a device list without merged entries compacts
// it into smaller buffers (a prompt's eviction, not a decode step's drop): then the kept
// indices may come from device memory, kv_list_retain_device_indices.
int         kv_list_retain_gathers(const struct kv_list *l, int32_t n_keep);
// kv_list_retain with the kept indices in device memory (d_keep, ascending; freed by the
// caller on the stream), where kv_list_retain_gathers: the rows are gathered by a kernel
// queued on the stream, the list's length, room, byte counts and evictions change at once,
// and nothing waits. The positions of entries [0, n_keep) are the caller's to write once it
// has the indices (until then they are stale; positions past the new room are gone).
pykv_status kv_list_retain_device_indices(struct kv_cache *c, struct kv_list *l, const int32_t *d_keep,
                                          int32_t n_keep);

// Drop entry j alone (a decode step's eviction). The last `tail` entries (a window) stay
// last and in order; the entry just before them fills slot j, so a step moves tail + 1
// entries instead of every entry after j (the others' order changes). tail = n makes it
// an ordered drop. Counts it as evicted; keeps the room for the next token, as
// kv_list_retain does; on a device list too.
pykv_status kv_list_drop(struct kv_cache *c, struct kv_list *l, int32_t j, int32_t tail);
// The same, a device list's row moves queued on b (kv_batch_run sends them) rather than
// launched now; the list keeps its room whatever it holds.
struct kv_batch;
pykv_status kv_list_drop_batched(struct kv_cache *c, struct kv_list *l, int32_t j, int32_t tail,
                                 struct kv_batch *b);

// Move rows keep[0..n_keep) (ascending) of an array of rows to its front, in order: one
// memmove per run of consecutive indices. kv_drop_row: remove row j of n as kv_list_drop
// does (the last `tail` rows stay last, in order).
void kv_compact_rows(void *base, size_t row_bytes, const int32_t *keep, int32_t n_keep);
void kv_drop_row(void *base, size_t row_bytes, int32_t n, int32_t j, int32_t tail);

// Turn on merged-entry bookkeeping for a list (every existing entry is a single token).
pykv_status kv_list_enable_members(struct kv_cache *c, struct kv_list *l);

// Make entry j stand for n tokens with these key norms (copied; not from the list's own
// pool, which may move); n == 1 makes it a plain entry again (its key must then be the
// token's own key). Counts new members as merged.
pykv_status kv_list_set_members(struct kv_cache *c, struct kv_list *l, int32_t j, const float *norms, int32_t n);

// Send a device list's merged-entry bookkeeping to its member_block when it changed: now, or
// queued on b.
pykv_status kv_list_sync_members(struct kv_cache *c, struct kv_list *l);
pykv_status kv_list_sync_members_batched(struct kv_cache *c, struct kv_list *l, struct kv_batch *b);

// A layer of device lists brought to host memory for code that reads and changes them there
// (a policy with policy_ops.host_lists): kv_layer_stage copies every list's keys and values
// into host buffers that the list then uses (on_device 0; the list's stage_k and stage_v),
// keeping the device buffers in saved (n_head_kv of them); kv_layer_unstage sends each
// list's rows back, into device buffers of its room then (the lists' merged entries too),
// and keeps the host buffers for the next staging.
struct kv_staged { void *k, *v; int32_t cap, device_cap; };
pykv_status kv_layer_stage(struct kv_cache *c, int layer, struct kv_staged *saved);
pykv_status kv_layer_unstage(struct kv_cache *c, int layer, struct kv_staged *saved);

// Drop entries past n (rolls back a cancelled chunk); not counted as evicted.
void kv_list_truncate(struct kv_cache *c, struct kv_list *l, int32_t n);
// Drop the entries at positions n_pos and later from every list, which must hold its entries
// in position order (the `full` policy's); not counted as evicted. Every list is cut even when
// giving the room back fails (the status says so).
pykv_status kv_cache_keep_prefix(struct kv_cache *c, int32_t n_pos);

int64_t kv_cache_entries(const struct kv_cache *c);
