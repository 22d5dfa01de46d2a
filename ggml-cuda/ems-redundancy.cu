// ems-redundancy.cu - EMS's redundancy of a decode step's weakest centre to every other
// centre, R(w, c) = cos(k_w, k_c) * cos(v_w, v_c) on the stored rows, for many lists in one
// launch (twin: ems_redundancy_all of native/src/kv/policies/ems/ems-merge.c). Block (x, job)
// takes EMS_CENTRES centres of one job; each warp holds the probe's key and value in
// registers (the window kernel's lane layout) and takes one centre at a time: its two dots
// with the probe and its own two squared norms, warp sums, then R as the CPU forms it (the
// inverse norms from the product of the squared norms in double, a pair with a negative
// cosine gets -|R|).
#include "common.cuh"
#include "kv-rows.cuh"
#include "policy-kernels.h"
#include "window-math.cuh"

#define EMS_THREADS 256
#define EMS_WARPS (EMS_THREADS / CUDA_WARP)
#define EMS_CENTRES 64   // centres per block

static __device__ __forceinline__ float lane_dot(const float *a, const float *b, int d, int lane) {
    float acc = 0.0f;
    WIN_UNROLL
    for (int c = 0; c < WIN_KREG; c++)
        if (lane + CUDA_WARP * c < d) acc = fmaf(a[c], b[c], acc);
    return acc;
}

// 1 / (|k| |v|) from the squared norms, 0 when either is 0 (ems-merge.c's inverse_norms).
static __device__ __forceinline__ float inverse_norms(float kk, float vv) {
    const double nn = (double)kk * (double)vv;
    return nn > 0.0 ? (float)(1.0 / sqrt(nn)) : 0.0f;
}

static __global__ void __launch_bounds__(EMS_THREADS)
ems_redundancy_kernel(const struct cuda_ems_probe *__restrict__ jobs, int fmt_k, int fmt_v, int d,
                      float *__restrict__ r) {
    const struct cuda_ems_probe job = jobs[blockIdx.y];
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    const int32_t c0 = (int32_t)blockIdx.x * EMS_CENTRES;
    if (c0 >= job.nc) return;
    float pk[WIN_KREG], pv[WIN_KREG], ck[WIN_KREG], cv[WIN_KREG];
    win_lane_key(kv_row(job.k, fmt_k, d, job.weak), fmt_k, d, lane, pk);
    win_lane_key(kv_row(job.v, fmt_v, d, job.weak), fmt_v, d, lane, pv);
    const float inv_p = inverse_norms(warp_sum(lane_dot(pk, pk, d, lane)), warp_sum(lane_dot(pv, pv, d, lane)));
    const int32_t c1 = c0 + EMS_CENTRES < job.nc ? c0 + EMS_CENTRES : job.nc;
    for (int32_t c = c0 + warp; c < c1; c += EMS_WARPS) {
        win_lane_key(kv_row(job.k, fmt_k, d, c), fmt_k, d, lane, ck);
        win_lane_key(kv_row(job.v, fmt_v, d, c), fmt_v, d, lane, cv);
        const float dk = warp_sum(lane_dot(pk, ck, d, lane)), dv = warp_sum(lane_dot(pv, cv, d, lane));
        const float inv_c = inverse_norms(warp_sum(lane_dot(ck, ck, d, lane)), warp_sum(lane_dot(cv, cv, d, lane)));
        const float x = __fmul_rn(__fmul_rn(__fmul_rn(dk, dv), inv_p), inv_c);
        if (lane == 0) r[job.out + c] = (dk < 0.0f || dv < 0.0f) ? -fabsf(x) : x;
    }
}

extern "C" void cuda_ems_redundancy(cuda_stream s, const struct cuda_ems_probe *d_jobs, int32_t n_jobs,
                                    int32_t max_nc, int fmt_k, int fmt_v, int d, float *r) {
    if (n_jobs <= 0 || max_nc <= 0 || d > WIN_MAX_D || n_jobs > 65535) return;
    const dim3 grid((unsigned)((max_nc + EMS_CENTRES - 1) / EMS_CENTRES), (unsigned)n_jobs);
    ems_redundancy_kernel<<<grid, EMS_THREADS, 0, s>>>(d_jobs, fmt_k, fmt_v, d, r);
}
