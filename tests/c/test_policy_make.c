// test_policy_make.c - kv/policies/common/policy-make.c: a policy's state from its table of
// options: defaults, typed values, the window policies' shared keys, the policy's own checks,
// the messages for bad arguments, and nothing left allocated when making fails (ASan).
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "check.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

struct fake {
    struct kv_policy base;
    struct ws_opts   o;
    int32_t          count;
    double           weight;
    int              mode;
    int32_t         *owned;   // allocated by finish: freed by fake_free on a later failure
    int              finished;
};

static void fake_free(struct kv_policy *base) {
    struct fake *p = (struct fake *)base;
    free(p->owned);
    free(p);
}

static const struct policy_ops fake_ops = { .name = "fake", .free = fake_free };

static const struct policy_opt fake_opts[] = {
    { .key = "count", .type = POLICY_OPT_INT, .offset = offsetof(struct fake, count), .lo = 1, .hi = 10 },
    { .key = "weight", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct fake, weight), .lo = 0.0, .hi = 1.0 },
    { .key = "mode", .type = POLICY_OPT_CHOICE, .offset = offsetof(struct fake, mode), .choices = "a|b|c" },
};

static void fake_defaults(struct kv_policy *base) {
    struct fake *p = (struct fake *)base;
    p->count = 3;
    p->weight = 0.25;
    p->o.kernel = 5;   // after the window defaults: overrides them
}

// count=7 is refused here, after the state took an allocation of its own.
static pykv_status fake_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct fake *p = (struct fake *)base;
    (void)cfg;
    p->owned = malloc(64);
    p->finished = 1;
    if (p->count == 7) return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'fake': count=7 is unlucky");
    return PYKV_OK;
}

static const struct policy_maker fake_maker = {
    .ops = &fake_ops,
    .size = sizeof(struct fake),
    .accepted = "window, pool, kernel, gqa, count, weight, mode",
    .opts = fake_opts,
    .n_opts = (int)(sizeof(fake_opts) / sizeof(fake_opts[0])),
    .window_opts = offsetof(struct fake, o),
    .defaults = fake_defaults,
    .finish = fake_finish,
};

static struct policy_config config(const char *args) {
    return (struct policy_config){ .window = -1, .sink = -1, .args = args };
}

static struct fake *make(const char *args, pykv_status *st) {
    struct policy_config cfg = config(args);
    struct kv_policy *p = NULL;
    *st = policy_make(&fake_maker, &cfg, &p);
    CHECK((*st == PYKV_OK) == (p != NULL));
    return (struct fake *)p;
}

static void test_defaults(void) {
    pykv_status st;
    struct fake *p = make(NULL, &st);
    CHECK(st == PYKV_OK);
    if (!p) return;
    CHECK(p->base.ops == &fake_ops);
    CHECK(p->count == 3 && p->weight == 0.25 && p->mode == 0 && p->finished);
    CHECK(p->o.window == 32 && p->o.kernel == 5 && p->o.pool == WS_POOL_MAX && p->o.gqa == WS_GQA_MEAN);
    fake_free(&p->base);
}

static void test_values(void) {
    pykv_status st;
    struct fake *p = make(" count = 9, weight=0.5,mode=c, window=8, pool=avg, gqa=max, kernel=3", &st);
    CHECK(st == PYKV_OK);
    if (!p) return;
    CHECK(p->count == 9 && p->weight == 0.5 && p->mode == 2);
    CHECK(p->o.window == 8 && p->o.kernel == 3 && p->o.pool == WS_POOL_AVG && p->o.gqa == WS_GQA_MAX);
    fake_free(&p->base);
}

// A bad argument: no policy, the given status, a message holding `says`.
static void expect_error(const char *args, const char *says) {
    pykv_status st;
    struct fake *p = make(args, &st);
    CHECK(p == NULL);
    CHECK(st == PYKV_ERR_INVALID_ARG);
    const char *msg = pykv_last_error();
    const int found = msg && strstr(msg, says) != NULL;
    CHECK(found);
    if (!found) fprintf(stderr, "  args '%s': message '%s' lacks '%s'\n", args, msg ? msg : "(none)", says);
}

static void test_errors(void) {
    expect_error("colour=red", "policy 'fake' has no argument 'colour' (accepted: window, pool, kernel, gqa, count");
    expect_error("count=11", "policy 'fake': count must be an integer in [1, 10], got '11'");
    expect_error("count=2.5", "count must be an integer");
    expect_error("weight=1.5", "policy 'fake': weight must be a number in [0, 1], got '1.5'");
    expect_error("mode=d", "policy 'fake': mode must be one of a|b|c, got 'd'");
    expect_error("pool=min", "pool must be one of max|avg");
    expect_error("kernel=4", "the pooling kernel must be odd");   // ws_opts_finish
    expect_error("count", "is not of the form key=value");
    expect_error("count=7", "count=7 is unlucky");                 // the policy's finish; its allocation freed
}

int main(void) {
    test_defaults();
    test_values();
    test_errors();
    return check_report("test_policy_make");
}
