// cake-budget.h - splitting a total budget over layers in proportion to layer weights
// (CAKE's P_l, LAVa's normalized entropies), capped by what each layer holds.
//
// Real shares by water-filling: x_l = min(cap_l, lambda * w_l) with lambda chosen so that
// sum x_l = min(total, sum cap_l). The excess of a capped layer therefore goes to the
// other layers in proportion to their weights ([decide]: the CAKE code spreads it evenly;
// proportional spreading keeps every x_l non-increasing when layers are added, which is
// what makes a cascade equal to one-shot allocation, CAKE Prop. 1 / Thm. 1).
// Weights are given as logarithms (-inf = weight 0); if every weight is 0 the split is
// equal. Integer budgets:
//   CAKE_SHARE_FINAL: floor(x_l), then the leftover units one each to the largest
//                     fractional parts (within 1e-9 = tie -> lower layer): the sum is exact;
//   CAKE_SHARE_BOUND: min(cap_l, floor(x_l (1 + 1e-9)) + 1), an upper bound of the FINAL
//                     budget of the same layer computed later with more layers.
#pragma once
#include <stdint.h>
#include "pykv.h"

enum cake_share_mode { CAKE_SHARE_FINAL = 0, CAKE_SHARE_BOUND = 1 };

// n layers; logw[n], cap[n] (>= 0), total >= 0; out[n]. Only fails for lack of memory.
pykv_status cake_share(int n, const double *logw, const int64_t *cap, int64_t total,
                       enum cake_share_mode mode, int64_t *out);
