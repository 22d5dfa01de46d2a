// attention-schedule.h - a layer's attention over the thread pool (forward.c calls these
// between appending the chunk's keys and values and the output projection).
#pragma once
#include "graph/context.h"

// A decode step (T == 1) of one layer. ev: the policy's decode_list runs on each list as soon
// as it has attended (NULL: none).
pykv_status decode_attention(pykv_context *ctx, int layer, const struct policy_event *ev);

// A prefill chunk of T tokens of one layer: ctx->buf.att gets every query head's output.
void prefill_attention(pykv_context *ctx, int layer, int T);

// For policies that read every entry's attention during prefill (POLICY_NEEDS_ATTENTION_SUMS):
// ctx->buf.attn_colsum[h][j] = the attention query head h of the chunk pays entry j, summed
// over the chunk's tokens in order, so the sums do not depend on the thread count.
void prefill_attention_sums(pykv_context *ctx, int layer, int T);
