// perf.c - monotonic clock, core counting and pykv_system_info().
#include "core/perf.h"
#include "pykv.h"
#include "cpu/gemm-q8.h"
#include "cpu/quant.h"
#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#endif

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double perf_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

// Count distinct (package, core) pairs in sysfs; fall back to the online CPU count.
int perf_physical_cores(void) {
    long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (n_cpu < 1) n_cpu = 1;
    if (n_cpu > 1024) n_cpu = 1024;
    static long seen[1024];
    int n_seen = 0;
    for (long cpu = 0; cpu < n_cpu; cpu++) {
        char path[128];
        long core = -1, pkg = -1;
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%ld/topology/core_id", cpu);
        FILE *f = fopen(path, "r");
        if (!f) return (int)n_cpu;
        if (fscanf(f, "%ld", &core) != 1) core = cpu;
        fclose(f);
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%ld/topology/physical_package_id", cpu);
        f = fopen(path, "r");
        if (f) { if (fscanf(f, "%ld", &pkg) != 1) pkg = 0; fclose(f); }
        long id = pkg * 4096 + core;
        int dup = 0;
        for (int i = 0; i < n_seen; i++) if (seen[i] == id) dup = 1;
        if (!dup) seen[n_seen++] = id;
    }
    return n_seen > 0 ? n_seen : (int)n_cpu;
}

// " | CUDA = 1 | GPU 0 = NVIDIA H100 80GB HBM3 (sm_90, ...)" for each device of a CUDA build,
// " | CUDA = 0 (why)" for a CUDA build that finds none, " | CUDA = 0" without the backend.
static void describe_cuda(char *buf, size_t cap) {
#ifdef PYKV_CUDA
    const int n = cuda_device_count();
    if (n == 0) {
        snprintf(buf, cap, " | CUDA = 0 (%s)", cuda_unavailable_reason());
        return;
    }
    size_t used = (size_t)snprintf(buf, cap, " | CUDA = 1");
    for (int d = 0; d < n && used < cap; d++) {
        char name[192];
        if (cuda_device_describe(d, name, sizeof(name)) != PYKV_OK) snprintf(name, sizeof(name), "%s", pykv_last_error());
        used += (size_t)snprintf(buf + used, cap - used, " | GPU %d = %s", d, name);
    }
#else
    snprintf(buf, cap, " | CUDA = 0");
#endif
}

const char *pykv_system_info(void) {
    static char info[1024];
    if (!info[0]) {
        int avx2 = 0, fma = 0, f16c = 0, avx512 = 0, vnni = 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        avx2 = !!__builtin_cpu_supports("avx2");
        fma = !!__builtin_cpu_supports("fma");
        f16c = !!__builtin_cpu_supports("f16c");
        avx512 = !!__builtin_cpu_supports("avx512f");
        vnni = !!__builtin_cpu_supports("avx512vnni");
#endif
        // "vnni" among the kernels: the prefill GEMM takes AVX-512 VNNI (gemm-q8.h)
        snprintf(info, sizeof(info),
                 "AVX2 = %d | FMA = %d | F16C = %d | AVX512 = %d | AVX512_VNNI = %d | kernels = %s%s | "
                 "physical cores = %d",
                 avx2, fma, f16c, avx512, vnni, quant_simd_name(), gemm_q8_has_vnni() ? " vnni" : "",
                 perf_physical_cores());
        const size_t used = strlen(info);
        describe_cuda(info + used, sizeof(info) - used);
    }
    return info;
}
