// perf.c - monotonic clock, core counting and pykv_system_info().
#include "core/perf.h"
#include "pykv.h"
#include "cpu/gemm-q8.h"
#include "cpu/quant.h"

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

const char *pykv_system_info(void) {
    static char info[256];
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
                 "physical cores = %d | CUDA = 0",
                 avx2, fma, f16c, avx512, vnni, quant_simd_name(), gemm_q8_has_vnni() ? " vnni" : "",
                 perf_physical_cores());
    }
    return info;
}
