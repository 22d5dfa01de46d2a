// policy.h - the KV eviction policy interface and registry.
//
// A policy is a vtable plus its own state. The context calls its hooks at fixed points of
// the forward pass; each policy declares which hooks it needs (DESIGN.md item 4):
//   after_layer   - a layer of a prefill chunk has appended its K/V (cascading policies)
//   after_chunk   - every layer of a prefill chunk is done (chunked policies such as TAKE)
//   after_prefill - the last chunk of a multi-token pykv_decode() is done (SnapKV-style)
//   after_decode  - a single-token step is done (H2O, decode-time eviction)
// A NULL hook is never called. Policies see the cache and the context's configuration.
#pragma once
#include <stdint.h>
#include "kv-cache.h"
#include "pykv.h"

struct policy_config {
    int32_t     budget;        // entries per (layer, KV head) on average; 0 = from budget_frac
    float       budget_frac;   // fraction of the prompt
    int32_t     window;        // -1 = the policy's default
    int32_t     sink;          // -1 = the policy's default
    const char *args;          // "k=v,k=v" or NULL
};

struct policy_event {
    struct kv_cache *cache;
    int32_t          layer;       // after_layer only
    int32_t          n_past;      // tokens in the sequence so far, this chunk included
    int32_t          n_prompt;    // tokens of the current multi-token call
};

struct kv_policy;

struct policy_ops {
    const char *name;
    const char *description;
    pykv_status (*init)(const struct policy_config *cfg, struct kv_policy **out);
    void        (*free)(struct kv_policy *p);
    pykv_status (*after_layer)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_chunk)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_prefill)(struct kv_policy *p, const struct policy_event *ev);
    pykv_status (*after_decode)(struct kv_policy *p, const struct policy_event *ev);
};

// Every policy state starts with its ops.
struct kv_policy {
    const struct policy_ops *ops;
};

// The registry; NULL when name is unknown (pykv_last_error lists the names).
const struct policy_ops *policy_find(const char *name);
int                      policy_registry_count(void);
const struct policy_ops *policy_registry_get(int i);
