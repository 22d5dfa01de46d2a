// perf.h - clocks and CPU facts.
#pragma once

double perf_now_ms(void);        // monotonic
int    perf_physical_cores(void); // physical cores (not SMT threads), at least 1
