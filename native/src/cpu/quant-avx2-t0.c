// quant-avx2-t0.c - the float-path kernels of quant-avx2.c again, prefetching the weights
// with the T0 hint instead of the non-temporal one; the CPUs that take them are chosen at
// run time (simd-avx2.h says which, and why).
#define WEIGHT_PREFETCH_T0
#include "cpu/quant-avx2.c"
