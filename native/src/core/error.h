// error.h - the per-thread last error behind pykv_last_error().
#pragma once
#include "pykv.h"

// Record a formatted message and return status, so callers can write
// `return pykv_error(PYKV_ERR_FORMAT, "tensor %s: ...", name);`.
pykv_status pykv_error(pykv_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void        pykv_clear_error(void);

// Return the status of a call if it failed (the message is already set).
#define PYKV_TRY(expr) do { pykv_status try_status_ = (expr); if (try_status_ != PYKV_OK) return try_status_; } while (0)
