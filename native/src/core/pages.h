// pages.h - memory for the KV cache's lists: blocks that live long and grow and shrink
// often. A large block is mapped from the system on its own pages (grown and shrunk with
// mremap on Linux) and its pages go back the moment it shrinks, instead of leaving holes in
// the malloc heap that the process keeps (pages.c says why).
#pragma once
#include <stddef.h>

// realloc's contract: NULL p allocates; on failure NULL, and p is untouched.
void *pages_realloc(void *p, size_t bytes);
void  pages_free(void *p);
