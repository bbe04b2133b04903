#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
static long long cur = 0, peak = 0;
static inline void add(long long n) {
  long long c = __atomic_add_fetch(&cur, n, __ATOMIC_RELAXED);
  long long p = __atomic_load_n(&peak, __ATOMIC_RELAXED);
  while (c > p && !__atomic_compare_exchange_n(&peak, &p, c, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static inline void *track(void *p) { if (p) add((long long)malloc_usable_size(p)); return p; }
void *malloc(size_t n) { return track(__libc_malloc(n)); }
void *calloc(size_t a, size_t b) { return track(__libc_calloc(a, b)); }
void free(void *p) { if (p) { add(-(long long)malloc_usable_size(p)); __libc_free(p); } }
void *realloc(void *p, size_t n) {
  long long old = p ? (long long)malloc_usable_size(p) : 0;
  void *q = __libc_realloc(p, n);
  if (q || n == 0) { add(-old); if (q) add((long long)malloc_usable_size(q)); }
  return q;
}
void *memalign(size_t a, size_t n) { return track(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return track(__libc_memalign(a, n)); }
void *valloc(size_t n) { return track(__libc_memalign(4096, n)); }
int posix_memalign(void **out, size_t a, size_t n) {
  if (a % sizeof(void *) || (a & (a - 1))) return EINVAL;
  void *p = __libc_memalign(a, n);
  if (!p && n) return ENOMEM;
  *out = track(p);
  return 0;
}
long long gpmem_current(void) { return __atomic_load_n(&cur, __ATOMIC_RELAXED); }
long long gpmem_peak(void) { return __atomic_load_n(&peak, __ATOMIC_RELAXED); }
void gpmem_reset_peak(void) { __atomic_store_n(&peak, __atomic_load_n(&cur, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
