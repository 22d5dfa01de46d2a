// policy-args.h - parsing of a policy's "k=v,k=v" argument string (--policy-arg).
//
// Each policy names the keys it accepts; an unknown key, a missing '=' or a value that does
// not parse is a PYKV_ERR_INVALID_ARG whose message names the policy and the accepted keys.
#pragma once
#include <stdint.h>
#include "pykv.h"

// Called once per "key=value" pair (both NUL-terminated, whitespace trimmed); it returns
// policy_arg_unknown(...) for a key it does not know.
typedef pykv_status (*policy_arg_fn)(void *state, const char *key, const char *value);

// Walk args (NULL or "" = nothing); `accepted` ("window, pool, kernel") is used in messages.
pykv_status policy_args_parse(const char *policy, const char *args, const char *accepted,
                              policy_arg_fn fn, void *state);

// The error for a key the policy does not accept.
pykv_status policy_arg_unknown(const char *policy, const char *key, const char *accepted);

// Typed values: the whole string must parse and lie in [lo, hi], else an error naming key.
pykv_status policy_arg_int(const char *policy, const char *key, const char *value,
                           int64_t lo, int64_t hi, int32_t *out);
pykv_status policy_arg_double(const char *policy, const char *key, const char *value,
                              double lo, double hi, double *out);
// One of the '|'-separated choices ("max|avg"); *out = its index.
pykv_status policy_arg_choice(const char *policy, const char *key, const char *value,
                              const char *choices, int *out);
