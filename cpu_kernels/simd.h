#pragma once

// Vector helpers: bfloat16 conversions, loads and stores of rows, sums, maxima and exp. AVX2 + FMA at least (the
// Python side checks both before building).

#include "common.h"

namespace {

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest even, NaN kept quiet: what XLA's float32 -> bfloat16 convert does.
inline uint16_t FloatToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m128i FloatToBf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  return _mm256_castsi256_si128(packed);
}

// Eight bfloat16 values (their bits) as eight floats: bfloat16 is the top half of a float32.
inline __m256 LoadBf16x8(const uint16_t* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight values as floats: float32 loaded as is, bfloat16 bits (uint16) widened in registers.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return LoadBf16x8(p); }
inline float Load1(const float* p) { return *p; }
inline float Load1(const uint16_t* p) { return Bf16ToFloat(*p); }

// A row of float32 results stored as the next op's input: as is, or rounded to bfloat16 bits.
inline void StoreRow(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }
inline void StoreRow(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), FloatToBf16x8(_mm256_loadu_ps(src + i)));
  }
  for (; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

// A row stored as a bfloat16 weight's matmul input on a CPU without AVX512-BF16: rounded to bfloat16 and kept as
// float32 (the same values), so the matmuls widen only the weight, not every row of x again for every weight row.
inline void StoreRoundedRow(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = FloatToBf16x8(_mm256_loadu_ps(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
  for (; i < n; ++i) dst[i] = Bf16ToFloat(FloatToBf16(src[i]));
}

// A matmul input row: bfloat16 bits (StoreRow rounds), or float32, rounded to bfloat16 values when `round`.
inline void StoreInput(uint16_t* dst, const float* src, int64_t n, bool) { StoreRow(dst, src, n); }
inline void StoreInput(float* dst, const float* src, int64_t n, bool round) {
  if (round) {
    StoreRoundedRow(dst, src, n);
  } else {
    StoreRow(dst, src, n);
  }
}

// What bfloat16 weights take as x: bfloat16 bits for vdpbf16ps, else float32 holding bfloat16 values.
#ifdef JSERVE_AVX512_BF16
using Bf16Input = uint16_t;
#else
using Bf16Input = float;
#endif

template <typename X, typename W>
inline float DotRow(const X* x, const W* w, int64_t k_size) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_size; k += 8) acc = _mm256_fmadd_ps(Load8(x + k), Load8(w + k), acc);
  float sum = HorizontalSum(acc);
  for (; k < k_size; ++k) sum += Load1(x + k) * Load1(w + k);
  return sum;
}

inline float MaxOf(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// exp(x) for x <= 0 (scores minus their running max), to ~1e-7 relative: 2^n * P(r) with a degree-6 polynomial.
inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

}  // namespace
