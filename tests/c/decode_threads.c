// decode_threads.c - every KV policy on two threads, for ThreadSanitizer (tests/run.sh builds
// the library with -DPYKV_TSAN=ON and runs this on a tiny model written by the Python
// fixtures): a chunked prefill, then decode steps, where each list's policy work runs on
// whichever thread finishes the list while the other keeps attending.
//
//   decode_threads MODEL.gguf
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pykv.h"

#define N_PROMPT 300
#define N_DECODE 24

static int fail(const char *policy, const char *what) {
    fprintf(stderr, "decode_threads: %s: %s: %s\n", policy, what, pykv_last_error());
    return 1;
}

static int run_policy(pykv_model *model, const char *policy, int32_t n_vocab) {
    struct pykv_context_params cp;
    pykv_context_default_params(&cp);
    cp.n_ctx = N_PROMPT + N_DECODE;
    cp.n_threads = 2;
    cp.n_ubatch = 64;
    cp.policy = policy;
    cp.budget = strcmp(policy, "full") == 0 ? 0 : 48;   // a budget with full is an error
    pykv_context *ctx = NULL;
    if (pykv_context_init(model, &cp, &ctx) != PYKV_OK) return fail(policy, "context");
    pykv_token prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (pykv_token)((i * 7919 + 11) % n_vocab);
    int rc = pykv_decode(ctx, prompt, N_PROMPT) != PYKV_OK ? fail(policy, "prefill") : 0;
    for (int i = 0; i < N_DECODE && !rc; i++) {
        const pykv_token t = (pykv_token)((i * 31 + 5) % n_vocab);
        if (pykv_decode(ctx, &t, 1) != PYKV_OK) rc = fail(policy, "decode step");
    }
    if (!rc) printf("decode_threads: %-12s ok, %d tokens\n", policy, pykv_n_past(ctx));
    pykv_context_free(ctx);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    pykv_model *model = NULL;
    if (pykv_model_load(argv[1], NULL, &model) != PYKV_OK) return fail("-", "load");
    struct pykv_model_info info = { .struct_size = sizeof(info) };
    if (pykv_model_get_info(model, &info) != PYKV_OK) return fail("-", "info");
    int rc = 0;
    for (int32_t i = 0; i < pykv_policy_count(); i++) rc |= run_policy(model, pykv_policy_name(i), info.n_vocab);
    pykv_model_free(model);
    return rc;
}
