// policy-args.c - "k=v,k=v" policy argument strings: splitting, typed values, errors.
#include "kv/policies/common/policy-args.h"
#include "core/error.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ARG_MAX 256

// Copy [b, e) trimmed of spaces into dst (size ARG_MAX); 0 when it does not fit.
static int copy_trimmed(char *dst, const char *b, const char *e) {
    while (b < e && isspace((unsigned char)*b)) b++;
    while (e > b && isspace((unsigned char)e[-1])) e--;
    if (e - b >= ARG_MAX) return 0;
    memcpy(dst, b, (size_t)(e - b));
    dst[e - b] = '\0';
    return 1;
}

pykv_status policy_args_parse(const char *policy, const char *args, const char *accepted,
                              policy_arg_fn fn, void *state) {
    if (!args) return PYKV_OK;
    const char *p = args;
    while (*p) {
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        const char *eq = memchr(p, '=', (size_t)(end - p));
        char key[ARG_MAX], value[ARG_MAX];
        if (end == p || (!eq && strspn(p, " \t") == (size_t)(end - p))) {   // empty item: skip
            p = *end ? end + 1 : end;
            continue;
        }
        if (!eq)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': argument '%.*s' is not of the form key=value "
                              "(accepted keys: %s)", policy, (int)(end - p), p, accepted);
        if (!copy_trimmed(key, p, eq) || !copy_trimmed(value, eq + 1, end))
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': argument '%.*s' is too long", policy,
                              (int)(end - p > 64 ? 64 : end - p), p);
        if (!key[0])
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': argument '%.*s' has an empty key "
                              "(accepted keys: %s)", policy, (int)(end - p), p, accepted);
        PYKV_TRY(fn(state, key, value));
        p = *end ? end + 1 : end;
    }
    return PYKV_OK;
}

pykv_status policy_arg_unknown(const char *policy, const char *key, const char *accepted) {
    return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s' has no argument '%s' (accepted: %s)", policy, key, accepted);
}

pykv_status policy_arg_int(const char *policy, const char *key, const char *value,
                           int64_t lo, int64_t hi, int32_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(value, &end, 10);
    if (!value[0] || *end || errno || v < lo || v > hi)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': %s must be an integer in [%lld, %lld], got '%s'",
                          policy, key, (long long)lo, (long long)hi, value);
    *out = (int32_t)v;
    return PYKV_OK;
}

pykv_status policy_arg_double(const char *policy, const char *key, const char *value,
                              double lo, double hi, double *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(value, &end);
    if (!value[0] || *end || errno || !isfinite(v) || v < lo || v > hi)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': %s must be a number in [%g, %g], got '%s'",
                          policy, key, lo, hi, value);
    *out = v;
    return PYKV_OK;
}

pykv_status policy_arg_choice(const char *policy, const char *key, const char *value,
                              const char *choices, int *out) {
    size_t n = strlen(value);
    int i = 0;
    for (const char *c = choices; *c; i++) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, value, n) == 0) {
            *out = i;
            return PYKV_OK;
        }
        c += len + (bar ? 1 : 0);
    }
    return pykv_error(PYKV_ERR_INVALID_ARG, "policy '%s': %s must be one of %s, got '%s'", policy, key, choices, value);
}
