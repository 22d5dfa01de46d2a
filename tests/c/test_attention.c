// test_attention.c - attention over merged entries (EMS) equals attention over the same
// tokens written out one by one: member i of a merged entry has key norm_i * unit_key and
// the entry's value. Also: compaction and single drops move member lists with their
// entries and the byte count follows every allocation.
#include "cpu/attention.h"
#include "check.h"
#include "kv/kv-cache.h"

#include <math.h>
#include <stdlib.h>

#define D 64   // a multiple of 64: the AVX2 path (the tiny-model tests cover the generic one)

static float frand(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }

static void unit(float *x) {
    double s = 0;
    for (int i = 0; i < D; i++) s += (double)x[i] * x[i];
    for (int i = 0; i < D; i++) x[i] /= (float)sqrt(s);
}

// A longer list: merged entries of 2, 3, 4, 8, 11, 17 and 300 members (small ones packed
// several to a vector, in full and partial groups; vector tails, full vectors, many vectors)
// among single tokens, groups of eight entries with none, one or several merged; whole (attention_head) and in segments (attention_group_partial, the
// decode path), one query row or a tile of three sharing the list.
static void check_wide_list(void) {
    enum { N = 90 };
    int members[N], total = 0;
    for (int j = 0; j < N; j++) {
        members[j] = j == 5 ? 8 : j == 40 ? 17 : j == 60 ? 300 : j % 11 == 4 ? 11 : j % 7 == 1 ? 3
                   : j % 5 == 2 ? 2 : j % 13 == 6 ? 4 : 1;
        total += members[j];
    }
    struct kv_cache merged, expanded;
    CHECK(kv_cache_init(&merged, 1, 1, D, 256, 0, 0) == PYKV_OK);
    CHECK(kv_cache_init(&expanded, 1, 1, D, 1024, 0, 0) == PYKV_OK);
    struct kv_list *lm = kv_cache_list(&merged, 0, 0), *le = kv_cache_list(&expanded, 0, 0);
    CHECK(kv_list_reserve(&merged, lm, N) == PYKV_OK && kv_list_reserve(&expanded, le, total) == PYKV_OK);
    CHECK(kv_list_enable_members(&merged, lm) == PYKV_OK);
    int pos = 0;
    for (int j = 0; j < N; j++) {
        float k[D], v[D], norms[300], km[D];
        for (int i = 0; i < D; i++) { k[i] = frand(); v[i] = frand(); }
        if (members[j] > 1) unit(k);
        kv_list_push(&merged, lm, k, v, j);
        for (int m = 0; m < members[j]; m++) {
            norms[m] = members[j] > 1 ? 0.5f + 2.0f * (float)rand() / (float)RAND_MAX : 1.0f;
            for (int i = 0; i < D; i++) km[i] = norms[m] * k[i];
            kv_list_push(&expanded, le, km, v, pos++);
        }
        if (members[j] > 1) CHECK(kv_list_set_members(&merged, lm, j, norms, members[j]) == PYKV_OK);
    }
    float q[D], wm[N], *we = malloc((size_t)total * sizeof(float)), om[D], oe[D];
    for (int trial = 0; trial < 10; trial++) {
        for (int i = 0; i < D; i++) q[i] = 3.0f * frand();
        attention_head(q, lm, lm->n, D, wm, om);
        attention_head(q, le, le->n, D, we, oe);
        for (int i = 0; i < D; i++) CHECK_NEAR(om[i], oe[i], 1e-5);
        for (int j = 0, e = 0; j < N; j++) {
            double s = 0;
            for (int m = 0; m < members[j]; m++) s += we[e++];
            CHECK_NEAR(wm[j], s, 1e-6 + 1e-5 * s);
        }
        // the decode path: the list in segments (the 300-member entry alone in one), merged
        // by log-sum-exp
        const int cut[4] = { 0, 37, 61, N };
        float pm[3], pl[3], po[3 * D], w2[N], out[D];
        for (int p = 0; p < 3; p++)
            attention_group_partial(q, 1, lm, cut[p], cut[p + 1], D, w2, po + p * D, pm + p, pl + p);
        attention_merge(3, pm, pl, po, D, out);
        for (int i = 0; i < D; i++) CHECK_NEAR(out[i], oe[i], 1e-5);
    }
    // a tile of three query rows: each row as the expanded list's attention for that query
    enum { NQ = 3 };
    float q3[NQ * D], w3[NQ * N], pm3[3 * NQ], pl3[3 * NQ], po3[3 * NQ * D], oe3[NQ * D];
    for (int i = 0; i < NQ * D; i++) q3[i] = 3.0f * frand();
    for (int r = 0; r < NQ; r++) attention_head(q3 + r * D, le, le->n, D, we, oe3 + r * D);
    const int cut3[4] = { 0, 37, 61, N };
    for (int p = 0; p < 3; p++)
        attention_group_partial(q3, NQ, lm, cut3[p], cut3[p + 1], D, w3, po3 + p * NQ * D, pm3 + p * NQ, pl3 + p * NQ);
    for (int r = 0; r < NQ; r++) {
        float m[3], ls[3], o[3 * D], out[D];
        for (int p = 0; p < 3; p++) {
            m[p] = pm3[p * NQ + r];
            ls[p] = pl3[p * NQ + r];
            for (int i = 0; i < D; i++) o[p * D + i] = po3[(p * NQ + r) * D + i];
        }
        attention_merge(3, m, ls, o, D, out);
        for (int i = 0; i < D; i++) CHECK_NEAR(out[i], oe3[r * D + i], 1e-5);
    }
    free(we);
    kv_cache_free(&merged);
    kv_cache_free(&expanded);
}

// kv_list_drop with a tail: the last `tail` entries stay last and in order, the entry just
// before them fills the freed slot, members travel with their entries.
static void check_tail_drop(void) {
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, D, 16, 1, 1) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&c, 0, 0);
    CHECK(kv_list_reserve(&c, l, 7) == PYKV_OK && kv_list_enable_members(&c, l) == PYKV_OK);
    for (int j = 0; j < 7; j++) {
        float k[D], v[D];
        for (int i = 0; i < D; i++) { k[i] = (float)(10 * j + i % 3); v[i] = -k[i]; }
        kv_list_push(&c, l, k, v, 100 + j);
    }
    const float norms[2] = { 1.0f, 2.0f };
    CHECK(kv_list_set_members(&c, l, 4, norms, 2) == PYKV_OK);
    // drop entry 1 of 7, tail 2: entry 4 (merged) moves into slot 1, entries 5 and 6 down
    CHECK(kv_list_drop(&c, l, 1, 2) == PYKV_OK);
    const int want[6] = { 100, 104, 102, 103, 105, 106 };
    float tmp[D];
    for (int j = 0; j < 6; j++) {
        CHECK(l->pos[j] == want[j]);
        CHECK_NEAR(kv_key_f32(l, j, D, tmp)[1], (float)(10 * (want[j] - 100) + 1), 0);
        CHECK_NEAR(kv_value_f32(l, j, D, tmp)[2], -(float)(10 * (want[j] - 100) + 2), 0);
        CHECK(l->n_members[j] == (want[j] == 104 ? 2 : 1) && (kv_member_norms(l, j) != NULL) == (want[j] == 104));
    }
    CHECK(kv_member_norms(l, 1)[0] == 1.0f && kv_member_norms(l, 1)[1] == 2.0f);
    CHECK(l->n_members[6] == 1 && c.evicted == 1);
    // inside the tail, or just before it: an ordered drop
    CHECK(kv_list_drop(&c, l, 4, 2) == PYKV_OK && l->pos[4] == 106 && l->pos[3] == 103);
    CHECK(kv_list_drop(&c, l, 3, 1) == PYKV_OK && l->n == 4 && l->pos[3] == 106 && l->pos[1] == 104);
    kv_cache_free(&c);
}

// Member norms in the list's pool under a long run of merges, drops and compactions: each
// entry keeps its own norms (checked against a copy kept by position), and the bytes are
// the entries' plus the pool's allocation.
static void check_member_pool(void) {
    enum { N = 40, MAXM = 6, MAXPOS = 16384 };
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, D, 4 * N, 1, 1) == PYKV_OK);
    struct kv_list *l = kv_cache_list(&c, 0, 0);
    CHECK(kv_list_reserve(&c, l, N) == PYKV_OK && kv_list_enable_members(&c, l) == PYKV_OK);
    static float want[MAXPOS][MAXM];   // by position
    static int count[MAXPOS];
    int next_pos = 0;
    float k[D] = { 0 }, v[D] = { 0 };
    for (int round = 0; round < 400; round++) {
        while (l->n < N && next_pos < MAXPOS) {
            CHECK(kv_list_reserve(&c, l, 1) == PYKV_OK);
            kv_list_push(&c, l, k, v, next_pos);
            count[next_pos++] = 1;
        }
        const int j = rand() % l->n, op = rand() % 4;
        if (op < 2) {   // merge: new norms (ascending) for entry j
            float norms[MAXM];
            const int n = 1 + rand() % MAXM;
            for (int m = 0; m < n; m++) norms[m] = (float)(m + 1) + 0.01f * (float)(rand() % 100);
            CHECK(kv_list_set_members(&c, l, j, norms, n) == PYKV_OK);
            count[l->pos[j]] = n;
            for (int m = 0; m < n; m++) want[l->pos[j]][m] = norms[m];
        } else if (op == 2) {
            CHECK(kv_list_drop(&c, l, j, rand() % 8) == PYKV_OK);
        } else {   // keep every other entry
            int32_t keep[N];
            int nk = 0;
            for (int i = 0; i < l->n; i += 2) keep[nk++] = i;
            CHECK(kv_list_retain(&c, l, keep, nk) == PYKV_OK);
            CHECK(l->pool_cap == l->pool_live);   // a compaction leaves no gaps or spare room
        }
        int64_t live = 0;
        for (int i = 0; i < l->n; i++) {
            const int p = l->pos[i];
            const float *norms = kv_member_norms(l, i);
            CHECK(l->n_members[i] == count[p] && (norms != NULL) == (count[p] > 1));
            for (int m = 0; norms && m < count[p]; m++) CHECK(norms[m] == want[p][m]);
            live += count[p] > 1 ? count[p] : 0;
        }
        CHECK(l->pool_live == live && l->pool_used <= l->pool_cap);
        CHECK(c.bytes == (int64_t)l->cap * (2 * D * 2 + 3 * 4) + (int64_t)l->pool_cap * 4);
    }
    kv_cache_free(&c);
}

int main(void) {
    srand(7);
    struct kv_cache merged, expanded;
    CHECK(kv_cache_init(&merged, 1, 1, D, 64, 0, 0) == PYKV_OK);
    CHECK(kv_cache_init(&expanded, 1, 1, D, 64, 0, 0) == PYKV_OK);
    struct kv_list *lm = kv_cache_list(&merged, 0, 0), *le = kv_cache_list(&expanded, 0, 0);
    CHECK(kv_list_reserve(&merged, lm, 6) == PYKV_OK && kv_list_reserve(&expanded, le, 20) == PYKV_OK);
    CHECK(kv_list_enable_members(&merged, lm) == PYKV_OK);

    // six entries; entries 1 and 4 stand for 3 and 5 tokens
    const int members[6] = { 1, 3, 1, 1, 5, 1 };
    int pos = 0;
    for (int j = 0; j < 6; j++) {
        float k[D], v[D], norms[5];
        for (int i = 0; i < D; i++) { k[i] = frand(); v[i] = frand(); }
        if (members[j] > 1) unit(k);
        kv_list_push(&merged, lm, k, v, j);
        for (int m = 0; m < members[j]; m++) {
            float km[D];
            norms[m] = members[j] > 1 ? 0.5f + 2.0f * (float)rand() / (float)RAND_MAX : 1.0f;
            for (int i = 0; i < D; i++) km[i] = norms[m] * k[i];
            kv_list_push(&expanded, le, km, v, pos++);
        }
        if (members[j] > 1) CHECK(kv_list_set_members(&merged, lm, j, norms, members[j]) == PYKV_OK);
    }
    CHECK(le->n == 12 && lm->n == 6 && merged.merged == 6);

    float q[D], wm[6], we[12], om[D], oe[D];
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < D; i++) q[i] = 3.0f * frand();
        attention_head(q, lm, lm->n, D, wm, om);
        attention_head(q, le, le->n, D, we, oe);
        for (int i = 0; i < D; i++) CHECK_NEAR(om[i], oe[i], 1e-5);
        // entry weights are the sums of their members' weights
        int e = 0;
        for (int j = 0; j < 6; j++) {
            double s = 0;
            for (int m = 0; m < members[j]; m++) s += we[e++];
            CHECK_NEAR(wm[j], s, 1e-6);
        }
    }

    // compaction keeps member lists with their entries and frees the others' bytes
    const int64_t base = 2 * D * 4 + 4 + 4 + 4;   // float32 cache: K, V, pos, n_members, member_at
    CHECK(lm->pool_live == 3 + 5 && lm->pool_cap >= 8 && merged.bytes == (int64_t)lm->cap * base + lm->pool_cap * 4);
    int32_t keep[3] = { 0, 4, 5 };
    CHECK(kv_list_retain(&merged, lm, keep, 3) == PYKV_OK);
    CHECK(lm->n == 3 && lm->n_members[0] == 1 && lm->n_members[1] == 5 && lm->n_members[2] == 1);
    CHECK(kv_member_norms(lm, 1) != NULL && kv_member_norms(lm, 0) == NULL && lm->pos[1] == 4);
    CHECK(merged.bytes == (int64_t)lm->cap * base + 5 * 4);
    // dropping one entry (a decode step) with the whole list as tail moves the later ones
    // down, members included
    CHECK(kv_list_drop(&merged, lm, 0, 3) == PYKV_OK);
    CHECK(lm->n == 2 && lm->n_members[0] == 5 && kv_member_norms(lm, 0) != NULL && lm->pos[0] == 4 && lm->pos[1] == 5);
    CHECK(lm->n_members[1] == 1 && lm->n_members[2] == 1);
    CHECK(merged.evicted == 4 && merged.bytes == (int64_t)lm->cap * base + 5 * 4);
    CHECK(kv_list_drop(&merged, lm, 0, 2) == PYKV_OK);
    CHECK(lm->n == 1 && lm->pos[0] == 5 && kv_member_norms(lm, 0) == NULL && merged.bytes == (int64_t)lm->cap * base);
    CHECK(lm->member_pool == NULL);   // nothing merged is left: the pool is gone
    CHECK(kv_list_drop(&merged, lm, 1, 0) == PYKV_ERR_INTERNAL && lm->n == 1);
    kv_list_truncate(&merged, lm, 1);
    CHECK(merged.bytes == (int64_t)lm->cap * base);

    kv_cache_free(&merged);
    kv_cache_free(&expanded);
    check_tail_drop();
    check_member_pool();
    check_wide_list();
    attention_force_scalar(1);   // the scalar kernels against the same expanded lists
    check_wide_list();
    attention_force_scalar(0);
    return check_report("test_attention");
}
