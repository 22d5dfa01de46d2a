// random.c - Random (docs/policies.md#random): at the end of each prefill call every list
// keeps B entries chosen at random; a baseline for the scored policies.
//
// Entry j of list (layer, KV head g) scores u = a hash of (seed, layer, g, its position)
// mapped to [0, 1) (splitmix64's finaliser): the same seed keeps the same entries, whatever
// the chunking, the threads or a later prefill call, and every list draws on its own.
// kvpress's RandomPress draws torch.rand from a generator seeded with its seed: the same
// rule (uniform scores, top B kept), but its kept set cannot be pykv's, whose scores come
// from its own generator. kvpress's default seed is None (a fresh draw each time); here the
// default is seed=0, so a run is reproducible unless another seed is given.
//
// Options: seed=0 (any integer in [0, 2^31 - 1]), evict_every_chunk=0.
// Schedule: as Knorm (no protected entries): the last chunk of a multi-token call cuts every
// list longer than B to its top B; decode steps append without eviction.
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stddef.h>
#include <stdint.h>

extern const struct policy_ops policy_random;

struct random_policy {
    struct kv_policy base;
    int32_t          seed;
};

static const struct policy_opt random_opts[] = {
    { .key = "seed", .type = POLICY_OPT_INT, .offset = offsetof(struct random_policy, seed), .lo = 0, .hi = INT32_MAX },
};

static const struct policy_maker random_maker = {
    .ops = &policy_random,
    .size = sizeof(struct random_policy),
    .accepted = "seed",
    .opts = random_opts,
    .n_opts = (int)(sizeof(random_opts) / sizeof(random_opts[0])),
};

static pykv_status random_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&random_maker, cfg, out);
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 bits, so every value is a distinct float.
static float entry_draw(int32_t seed, int32_t layer, int32_t g, int32_t pos) {
    uint64_t h = mix64((uint64_t)(uint32_t)seed);
    h = mix64(h ^ (uint64_t)(uint32_t)layer);
    h = mix64(h ^ (uint64_t)(uint32_t)g);
    h = mix64(h ^ (uint64_t)(uint32_t)pos);
    return (float)(h >> 40) * (1.0f / 16777216.0f);
}

static void random_score(const struct kv_policy *base, const struct policy_event *ev, int32_t g,
                         const struct kv_list *l, float *s, float *tmp) {
    (void)tmp;
    const int32_t seed = ((const struct random_policy *)base)->seed;
    for (int32_t j = 0; j < l->n; j++) s[j] = entry_draw(seed, ev->layer, g, l->pos[j]);
}

static pykv_status random_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    if (!ws_is_prefill_end(ev)) return PYKV_OK;
    static const struct es_device by_position = { .rule = ES_POSITIONS };
    return es_layer_keep_top(base, ev, ws_budget(&base->cfg, ev), random_score, &by_position);
}

const struct policy_ops policy_random = {
    .name = "random",
    .description = "Random: each KV head keeps entries drawn at random (seeded); a baseline",
    .init = random_init,
    .free = policy_free_state,
    .after_layer = random_after_layer,
    .options = "seed=0, evict_every_chunk=0",
    .choose = "a baseline only: what any scored policy must beat at the same budget",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
