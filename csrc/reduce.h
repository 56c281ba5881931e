/* reduce.h — element-wise reductions used by every CPU transport. */
#ifndef DPTC_REDUCE_H
#define DPTC_REDUCE_H

#include "dptc.h"

/* dst[i] = scale * op(srcs[0][i], ..., srcs[nsrc-1][i]) for i < count.
 *
 * dst may alias any srcs[k] (in-place reduction); the sources never alias
 * each other partially.  nsrc >= 1.  scale multiplies the result before it
 * is stored (1.0 for SUM/MAX/MIN/PRODUCT; 1/n for AVG); it must be 1.0 for
 * integer types.  bfloat16 and float16 are accumulated in float32 across all
 * sources and rounded once (round to nearest even).  AVG is never passed
 * here: callers pass SUM with scale = 1/n.  BAND, BOR and BXOR take integer
 * and bool dtypes only.  Returns DPTC_ERR_INVALID for a dtype/op pair that
 * is not supported (scale != 1 with ints, a bitwise op on a floating dtype).
 * Runs without the GIL; allocates nothing. */
dptc_status dptc_reduce(void *dst, const void *const *srcs, int nsrc,
                        size_t count, dptc_dtype dtype, dptc_redop op,
                        double scale, dptc_error *err);

/* buf[i] *= scale, for floating dtypes (used for AVG after a cross-node
 * step).  DPTC_ERR_INVALID for integer dtypes. */
dptc_status dptc_scale(void *buf, size_t count, dptc_dtype dtype, double scale,
                       dptc_error *err);

/* dst[i] = src[i] converted, rounding to nearest even, between float32 or
 * float64 and bfloat16 or float16 (either direction; float64 goes through
 * float32, as torch's cast does).  DPTC_ERR_INVALID for other pairs.  Runs
 * without the GIL. */
dptc_status dptc_convert(void *dst, dptc_dtype dst_dtype, const void *src, dptc_dtype src_dtype,
                         size_t count, dptc_error *err);

#endif /* DPTC_REDUCE_H */
