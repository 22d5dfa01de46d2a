// ctest-label: cuda
// test_cuda_take.c - TAKE's probe average on the GPU (take_ema_update_device: the forward
// pass's RoPE kernel undoing and redoing the rotation, cuda_take_ema mixing into a state kept
// in device memory) against take_ema_update on the host, one line per chunk: a run of chunks
// whose probe rows change in number (more, fewer, the same; the state restarting), head_dim
// 64 and 128, n_rot below head_dim too; the mixed probe and the state after each chunk within
// NMSE 1e-10 (the rotation's products may round differently on the device).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv-cache.h"
#include "kv/policies/take/take-score.h"
#include "model/model.h"

#define CUDA_CHECK_SEED 0xBB67AE8584CAA73Bull
#include "cuda-check.h"

static void test_chunks(int n_head, int d, int n_rot, const int32_t *rows, int n_chunks) {
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, 1, d, 64, KV_F16, KV_F16) == PYKV_OK);
    c.device = 0;
    c.device_stream = NULL;   // the default stream
    struct hparams hp = { .n_layer = 1, .n_head = n_head, .n_head_kv = 1, .head_dim = d, .n_rot = n_rot };
    float inv_freq[PYKV_MAX_HEAD_DIM / 2];
    for (int i = 0; i < n_rot / 2; i++) inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)n_rot);
    const size_t width = (size_t)n_head * d;
    struct take_ema host = { 0 }, dev = { 0 };
    int32_t pos = 100;
    for (int k = 0; k < n_chunks; k++) {
        const int32_t r = rows[k], T = r + 7;   // the probe: the chunk's last r rows
        if (r == 0) {                           // a new call: the average restarts
            host.rows = dev.rows = 0;
            continue;
        }
        float *q = malloc((size_t)T * width * sizeof(float)), *want = malloc((size_t)r * width * sizeof(float));
        float *got = malloc((size_t)r * width * sizeof(float)), *state = malloc((size_t)r * width * sizeof(float));
        for (size_t i = 0; i < (size_t)T * width; i++) q[i] = uniform(-2.0f, 2.0f);
        float *dq = dev_upload(q, (size_t)T * width * sizeof(float)), *dout = dev_alloc((size_t)r * width * sizeof(float));
        struct policy_event ev = { .cache = &c, .hp = &hp, .layer = 0, .q_device = dq, .T = T };
        ev.probe.rope_inv_freq = inv_freq;
        const int32_t pos0 = pos + T - r;
        CHECK(take_ema_update(&host, q + (size_t)(T - r) * width, r, pos0, 0.6, &ev, want) == PYKV_OK);
        CHECK(take_ema_update_device(&dev, r, pos0, 0.6, &ev, dout) == PYKV_OK);
        double e_out = 1.0, e_state = 1.0;
        if (fetch(got, dout, (size_t)r * width * sizeof(float), "take_ema_update_device") &&
            fetch(state, dev.d_q[dev.d_cur], (size_t)r * width * sizeof(float), "the device state")) {
            e_out = nmse(got, want, (size_t)r * width);
            e_state = nmse(state, host.q, (size_t)r * width);
        }
        printf("take ema d=%d n_rot=%d chunk %d: %d rows at %d: NMSE probe %.2e, state %.2e\n", d, n_rot, k, r, pos0,
               e_out, e_state);
        CHECK(e_out <= 1e-10);
        CHECK(e_state <= 1e-10);
        CHECK(dev.rows == host.rows);
        cuda_free(dq);
        cuda_free(dout);
        free(q); free(want); free(got); free(state);
        pos += T;
    }
    take_ema_free(&host);
    take_ema_free(&dev);
    kv_cache_free(&c);
}

int main(void) {
    if (!cuda_test_start("test_cuda_take")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);
    const int32_t rows[] = { 32, 32, 20, 40, 40, 8, 0, 16, 64 };
    const int n = (int)(sizeof(rows) / sizeof(rows[0]));
    test_chunks(4, 64, 64, rows, n);
    test_chunks(3, 128, 128, rows, n);
    test_chunks(2, 64, 32, rows, n);
    return check_report("test_cuda_take");
}
