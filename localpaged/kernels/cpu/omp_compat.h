/* OpenMP's thread number, or a build without OpenMP (Apple's clang): the pragmas are then
 * ignored and every call runs on one thread. */
#ifndef OMP_COMPAT_H
#define OMP_COMPAT_H
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
#endif
#endif
