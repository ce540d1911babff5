#pragma once

// The jserve_argmax call, for greedy sampling: the first index of each row's maximum, a NaN counting as the maximum
// (jnp.argmax's answer). XLA CPU's argmax is a variadic reduce that runs at ~1 ns an element; this is two vector
// passes over the row.

#include "phases.h"
#include "simd.h"

namespace {

// The first i with pred(x[i .. i + 8)) set in its lane mask, or -1.
template <typename Pred>
int64_t FirstLane(const float* x, int64_t n, Pred pred) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(pred(_mm256_loadu_ps(x + i)));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    const int mask = _mm256_movemask_ps(pred(_mm256_set1_ps(x[i])));
    if (mask != 0) return i;
  }
  return -1;
}

int32_t ArgmaxRow(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float top = MaxOf(reinterpret_cast<const float*>(&best), 8);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    has_nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (has_nan) {
    return static_cast<int32_t>(FirstLane(x, n, [](__m256 v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }));
  }
  const __m256 target = _mm256_set1_ps(top);
  const int64_t first = FirstLane(x, n, [target](__m256 v) { return _mm256_cmp_ps(v, target, _CMP_EQ_OQ); });
  return static_cast<int32_t>(std::max<int64_t>(first, 0));  // a row of -inf: index 0, as jnp.argmax
}

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  CallClock call_clock(kArgmaxCall);
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] == 0) return ffi::Error::InvalidArgument("jserve_argmax: expected x[S, V > 0]");
  const float* rows = x.typed_data();
  int32_t* ids = out->typed_data();
  const int64_t vocab = dims[1];
  RunPhases(pool, {{dims[0], [=](int64_t r) { ids[r] = ArgmaxRow(rows + r * vocab, vocab); }}});
  return ffi::Error::Success();
}

}  // namespace
