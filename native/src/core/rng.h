// rng.h - a small seeded PRNG (xorshift64*, seeded through splitmix64) for sampling.
#pragma once
#include <stdint.h>

struct pykv_rng {
    uint64_t state;  // never 0
};

// Seed deterministically; the same seed always gives the same stream.
void     rng_seed(struct pykv_rng *rng, uint64_t seed);
// A seed from /dev/urandom, or from the clock when that cannot be read.
uint64_t rng_entropy_seed(void);
uint64_t rng_next_u64(struct pykv_rng *rng);
// Uniform in [0, 1) with 53 random bits.
double   rng_next_double(struct pykv_rng *rng);
