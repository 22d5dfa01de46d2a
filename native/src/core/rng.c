// rng.c - xorshift64* (Vigna, "An experimental exploration of Marsaglia's xorshift
// generators", 2016) with splitmix64 to spread the seed over the 64-bit state.
#include "core/rng.h"

#include <stdio.h>
#include <time.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void rng_seed(struct pykv_rng *rng, uint64_t seed) {
    uint64_t x = seed;
    rng->state = splitmix64(&x);
    if (rng->state == 0) rng->state = 0x2545F4914F6CDD1Dull;  // xorshift's one forbidden state
}

uint64_t rng_entropy_seed(void) {
    uint64_t seed = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        size_t got = fread(&seed, 1, sizeof(seed), f);
        fclose(f);
        if (got == sizeof(seed)) return seed;
    }
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    uint64_t x = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^ (uint64_t)(uintptr_t)&ts;
    return splitmix64(&x);
}

uint64_t rng_next_u64(struct pykv_rng *rng) {
    uint64_t x = rng->state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng->state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

double rng_next_double(struct pykv_rng *rng) {
    return (double)(rng_next_u64(rng) >> 11) * (1.0 / 9007199254740992.0);  // / 2^53
}
