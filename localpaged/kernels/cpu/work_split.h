/* Items [0, n) of a loop shared by an OpenMP team: each thread walks its own contiguous share
 * front to back (its weight stream stays one run for the prefetchers and the kernels' prefetch
 * ahead), and a thread done with its share takes the back half of what is left of another's.
 * A static split leaves the team waiting on its slowest thread at every matmul's end: on a
 * 2-core VM whose cores run at different speeds from moment to moment, the OpenMP worker of a
 * chat's prompt spent 11% of its time waiting at those barriers (Zen 3, perf per thread).
 * OpenMP's own dynamic schedule balances but breaks the streams (decode steps 18% slower at 8
 * tiles a chunk); guided leaves the first thread's half-sized chunk unshared.
 *
 *     struct work_split split;
 *     work_split_init(&split, n, threads);
 *     #pragma omp parallel num_threads(threads)
 *     {
 *         int begin, end;
 *         while (work_split_take(&split, omp_get_thread_num(), &begin, &end))
 *             for (int i = begin; i < end; i++) ...
 *     }
 *
 * A team smaller than `threads` (or a build without OpenMP) is fine: the missing threads'
 * shares are taken by the others. */
#ifndef WORK_SPLIT_H
#define WORK_SPLIT_H
#include <stdatomic.h>
#include <stdint.h>

#include "omp_compat.h"

#define WORK_SPLIT_MAX 64 /* shares; more threads than this split as if there were this many */
#define WORK_SPLIT_OWN 2  /* items a thread takes from its own share at a time */

/* One share, [begin, end) packed as begin << 32 | end, on its own cache line. */
struct work_share {
    _Alignas(64) _Atomic uint64_t range;
};

struct work_split {
    struct work_share share[WORK_SPLIT_MAX];
    int parts;
};

static inline uint64_t work_range(uint32_t begin, uint32_t end) {
    return (uint64_t)begin << 32 | end;
}

static inline void work_split_init(struct work_split *w, int n, int threads) {
    w->parts = threads < 1 ? 1 : threads > WORK_SPLIT_MAX ? WORK_SPLIT_MAX : threads;
    for (int i = 0; i < w->parts; i++)
        atomic_init(&w->share[i].range,
                    work_range((uint32_t)((int64_t)n * i / w->parts),
                               (uint32_t)((int64_t)n * (i + 1) / w->parts)));
}

/* The next items for thread `me`: [*begin, *end) from the front of its own share, else the
 * back half (rounded up) of another's. 0 when every share is empty. */
static inline int work_split_take(struct work_split *w, int me, int *begin, int *end) {
    me %= w->parts;
    for (int v = 0; v < w->parts; v++) {
        _Atomic uint64_t *range = &w->share[(me + v) % w->parts].range;
        uint64_t r = atomic_load_explicit(range, memory_order_relaxed);
        for (;;) {
            const uint32_t lo = (uint32_t)(r >> 32), hi = (uint32_t)r;
            if (lo >= hi) break;
            const uint32_t left = hi - lo;
            const uint32_t take = v == 0 ? (left < WORK_SPLIT_OWN ? left : WORK_SPLIT_OWN)
                                         : (left + 1) / 2;
            const uint64_t next = v == 0 ? work_range(lo + take, hi) : work_range(lo, hi - take);
            if (atomic_compare_exchange_weak_explicit(range, &r, next, memory_order_relaxed,
                                                      memory_order_relaxed)) {
                *begin = (int)(v == 0 ? lo : hi - take);
                *end = *begin + (int)take;
                return 1;
            }
        }
    }
    return 0;
}
#endif
