// log.h - leveled logging to stderr; silent unless pykv_log_set_level() raised it.
#pragma once

enum pykv_log_level { PYKV_LOG_ERROR = 1, PYKV_LOG_WARN = 2, PYKV_LOG_INFO = 3, PYKV_LOG_DEBUG = 4 };

void pykv_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define LOG_WARN(...)  pykv_log(PYKV_LOG_WARN, __VA_ARGS__)
#define LOG_INFO(...)  pykv_log(PYKV_LOG_INFO, __VA_ARGS__)
#define LOG_DEBUG(...) pykv_log(PYKV_LOG_DEBUG, __VA_ARGS__)
