// state.h - the saved-state format shared by state.c (size, save) and state-load.c (check,
// load). Layout, native byte order:
//   "PYKVSTA2", u32 0x01020304 (byte order),
//   i32 n_layer, n_head_kv, head_dim, n_vocab, kv_f16, n_past, has_logits, single_run,
//   i64 evicted, merged (the cache's counters),
//   i32 length and the text of the policy's identity (state_identity),
//   the logits (n_vocab floats) when has_logits,
//   for each (layer, KV head) list: i32 n, i32 merged (1: member counts follow), n positions,
//     n keys and n values in the cache's type; when merged, n member counts, then the member
//     norms of each entry of more than one member, in entry order,
//   i64 length and the bytes of the policy's own state (policy.h state_write).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "graph/context.h"
#include "kv/state-io.h"

#define STATE_MAGIC_LEN 8
extern const char STATE_MAGIC[STATE_MAGIC_LEN];      // this format
extern const char STATE_MAGIC_V1[STATE_MAGIC_LEN];   // the first: no policy, no merged entries
#define STATE_BYTE_ORDER 0x01020304u

// The header's integers, in order.
enum { H_N_LAYER, H_N_HEAD_KV, H_HEAD_DIM, H_N_VOCAB, H_KV_F16, H_N_PAST, H_HAS_LOGITS, H_SINGLE_RUN, HEADER_I32 };

// The policy a state belongs to, as text: its name alone for a policy that keeps every entry;
// otherwise also its configuration and the context's probe (a hash of its tokens), which
// decided what the cache kept. Allocated (the caller frees it), its length in *len; NULL
// with the error set when out of memory.
char *state_identity(const pykv_context *ctx, size_t *len);
