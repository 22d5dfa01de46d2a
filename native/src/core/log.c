// log.c - leveled logging to stderr.
#include "core/log.h"
#include "pykv.h"

#include <stdarg.h>
#include <stdio.h>

static int log_level = 0;

void pykv_log_set_level(int32_t level) { log_level = level; }

void pykv_log(int level, const char *fmt, ...) {
    if (level > log_level) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("pykv: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}
