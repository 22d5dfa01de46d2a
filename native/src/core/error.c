// error.c - per-thread error messages.
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[1024];

pykv_status pykv_error(pykv_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof(last_error), fmt, ap);
    va_end(ap);
    return status;
}

void pykv_clear_error(void) { last_error[0] = '\0'; }

const char *pykv_last_error(void) { return last_error; }

int32_t pykv_abi_version(void) { return PYKV_ABI_VERSION; }
