/* kernels.h — element-wise reductions used by every CPU transport. */
#ifndef DPTC_KERNELS_H
#define DPTC_KERNELS_H

#include "dptc.h"

/* dst[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) / divisor for i < count.
 *
 * dst may alias any srcs[k] (in-place reduction); the sources never alias
 * each other partially.  nsrc >= 1.  divisor divides the result before it
 * is stored, correctly rounded (1 for SUM/MAX/MIN/PRODUCT; n for AVG: see
 * [Note: AVG divides] in kernels.c); it must be 1 for integer types.
 * bfloat16 and float16 are accumulated in float32 across all sources,
 * divided in float32 and rounded once (round to nearest even).  AVG is never
 * passed here: callers pass SUM with divisor n.  BAND, BOR and BXOR take
 * integer and bool dtypes only.  Returns DPTC_ERR_INVALID for a dtype/op
 * pair that is not supported (divisor != 1 with ints, a bitwise op on a
 * floating dtype).  Runs without the GIL; allocates nothing. */
dptc_status dptc_reduce(void *dst, const void *const *srcs, int nsrc,
                        size_t count, dptc_dtype dtype, dptc_redop op,
                        int divisor, dptc_error *err);

/* buf[i] /= divisor, for floating dtypes (AVG after a cross-node step),
 * correctly rounded as in dptc_reduce.  DPTC_ERR_INVALID for integer
 * dtypes and a divisor < 1. */
dptc_status dptc_divide(void *buf, size_t count, dptc_dtype dtype, int divisor,
                        dptc_error *err);

/* dst[i] = src[i] converted, rounding to nearest even, between float32 or
 * float64 and bfloat16 or float16 (either direction; float64 goes through
 * float32, as torch's cast does).  DPTC_ERR_INVALID for other pairs.  Runs
 * without the GIL. */
dptc_status dptc_convert(void *dst, dptc_dtype dst_dtype, const void *src, dptc_dtype src_dtype,
                         size_t count, dptc_error *err);

#endif /* DPTC_KERNELS_H */
