// ems-redundancy.cu - EMS's redundancy R(i, c) = cos(k_i, k_c) * cos(v_i, v_c) on the stored
// rows, for many lists in one launch (twin: ems_redundancy_all and ems_redundancy of
// native/src/kv/policies/ems/ems-merge.c). Each warp holds the probe's key and value in
// registers (the window kernel's lane layout) and takes one centre at a time: its two dots
// with the probe and its own two squared norms, warp sums, then R as the CPU forms it (the
// inverse norms from the product of the squared norms in double, a pair with a negative
// cosine gets -|R|).
//  * cuda_ems_redundancy (a decode step's weakest centre): block (x, job) takes EMS_CENTRES
//    centres of one job and writes each R.
//  * cuda_ems_most_similar (a prompt's to-be-merged entries): a block per job takes every
//    centre, and only the largest R and its centre are written.
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

// Row c of a centre (the job's list of rows, or c itself).
static __device__ __forceinline__ int32_t centre_row(const struct cuda_ems_probe &job, int32_t c) {
    return job.centre ? job.centre[c] : c;
}

// The probe's key and value in the lane's registers and its inverse norms.
static __device__ __forceinline__ float load_probe(const struct cuda_ems_probe &job, int fmt_k, int fmt_v, int d,
                                                   int lane, float *pk, float *pv) {
    win_lane_key(kv_row(job.k, fmt_k, d, job.weak), fmt_k, d, lane, pk);
    win_lane_key(kv_row(job.v, fmt_v, d, job.weak), fmt_v, d, lane, pv);
    return inverse_norms(warp_sum(lane_dot(pk, pk, d, lane)), warp_sum(lane_dot(pv, pv, d, lane)));
}

// R of the probe to the entry at `row`, in every lane of the warp.
static __device__ __forceinline__ float redundancy_to(const struct cuda_ems_probe &job, int fmt_k, int fmt_v, int d,
                                                      int lane, const float *pk, const float *pv, float inv_p,
                                                      int32_t row) {
    float ck[WIN_KREG], cv[WIN_KREG];
    win_lane_key(kv_row(job.k, fmt_k, d, row), fmt_k, d, lane, ck);
    win_lane_key(kv_row(job.v, fmt_v, d, row), fmt_v, d, lane, cv);
    const float dk = warp_sum(lane_dot(pk, ck, d, lane)), dv = warp_sum(lane_dot(pv, cv, d, lane));
    const float inv_c = inverse_norms(warp_sum(lane_dot(ck, ck, d, lane)), warp_sum(lane_dot(cv, cv, d, lane)));
    const float x = __fmul_rn(__fmul_rn(__fmul_rn(dk, dv), inv_p), inv_c);
    return (dk < 0.0f || dv < 0.0f) ? -fabsf(x) : x;
}

static __global__ void __launch_bounds__(EMS_THREADS)
ems_redundancy_kernel(const struct cuda_ems_probe *__restrict__ jobs, int fmt_k, int fmt_v, int d,
                      float *__restrict__ r) {
    const struct cuda_ems_probe job = jobs[blockIdx.y];
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    const int32_t c0 = (int32_t)blockIdx.x * EMS_CENTRES;
    if (c0 >= job.nc) return;
    float pk[WIN_KREG], pv[WIN_KREG];
    const float inv_p = load_probe(job, fmt_k, fmt_v, d, lane, pk, pv);
    const int32_t c1 = c0 + EMS_CENTRES < job.nc ? c0 + EMS_CENTRES : job.nc;
    for (int32_t c = c0 + warp; c < c1; c += EMS_WARPS) {
        const float x = redundancy_to(job, fmt_k, fmt_v, d, lane, pk, pv, inv_p, centre_row(job, c));
        if (lane == 0) r[job.out + c] = x;
    }
}

// Each warp keeps the first largest R of the centres it takes (c = warp, warp + EMS_WARPS, ...);
// the block then takes the largest of those, ties to the lower centre: the first largest in
// centre order, as the CPU's loop finds it.
static __global__ void __launch_bounds__(EMS_THREADS)
ems_most_similar_kernel(const struct cuda_ems_probe *__restrict__ jobs, int fmt_k, int fmt_v, int d,
                        int32_t *__restrict__ best, float *__restrict__ r_best) {
    const struct cuda_ems_probe job = jobs[blockIdx.x];
    const int lane = threadIdx.x % CUDA_WARP, warp = threadIdx.x / CUDA_WARP;
    __shared__ float warp_r[EMS_WARPS];
    __shared__ int32_t warp_c[EMS_WARPS];
    float pk[WIN_KREG], pv[WIN_KREG];
    const float inv_p = load_probe(job, fmt_k, fmt_v, d, lane, pk, pv);
    float top = 0.0f;
    int32_t at = -1;
    for (int32_t c = warp; c < job.nc; c += EMS_WARPS) {
        const float x = redundancy_to(job, fmt_k, fmt_v, d, lane, pk, pv, inv_p, centre_row(job, c));
        if (at < 0 || x > top) {
            top = x;
            at = c;
        }
    }
    if (lane == 0) {
        warp_r[warp] = top;
        warp_c[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        top = 0.0f;
        at = -1;
        for (int w = 0; w < EMS_WARPS; w++) {
            const int32_t c = warp_c[w];
            if (c >= 0 && (at < 0 || warp_r[w] > top || (warp_r[w] == top && c < at))) {
                top = warp_r[w];
                at = c;
            }
        }
        best[job.out] = at < 0 ? -1 : centre_row(job, at);
        r_best[job.out] = top;
    }
}

extern "C" void cuda_ems_redundancy(cuda_stream s, const struct cuda_ems_probe *d_jobs, int32_t n_jobs,
                                    int32_t max_nc, int fmt_k, int fmt_v, int d, float *r) {
    if (n_jobs <= 0 || max_nc <= 0 || d > WIN_MAX_D || n_jobs > 65535) return;
    const dim3 grid((unsigned)((max_nc + EMS_CENTRES - 1) / EMS_CENTRES), (unsigned)n_jobs);
    ems_redundancy_kernel<<<grid, EMS_THREADS, 0, s>>>(d_jobs, fmt_k, fmt_v, d, r);
}

extern "C" void cuda_ems_most_similar(cuda_stream s, const struct cuda_ems_probe *d_jobs, int32_t n_jobs, int fmt_k,
                                      int fmt_v, int d, int32_t *best, float *r_best) {
    if (n_jobs <= 0 || d > WIN_MAX_D) return;
    ems_most_similar_kernel<<<(unsigned)n_jobs, EMS_THREADS, 0, s>>>(d_jobs, fmt_k, fmt_v, d, best, r_best);
}
