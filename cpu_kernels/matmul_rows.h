#pragma once

// Matmuls of few rows against plain weights: each weight row streamed once against every row of x.

#include "matmul_job.h"

namespace {

// Few rows (decode) are bandwidth-bound: the weight is read once, front to back, one row at a time against up to
// kDecodeRows rows of x (the rest of x is read again from L1). A single forward stream is what the hardware
// prefetcher follows best: four weight rows interleaved read at half the bandwidth.

constexpr int64_t kDecodeRows = 4;    // x rows per pass over a weight row: 2 accumulators each + the weight
constexpr int64_t kColsPerItem = 16;  // the unit of weight rows the parallel work items are made of

// Weight rows [0, n) as guided items of kColsPerItem-row units: small enough units to even out two threads (in
// 64-row units, a 576-row projection is 9 items, split 5 : 4).
template <typename Body>
Phase GuidedColumns(int64_t n, int64_t threads, Body body) {
  const ItemStarts starts = RunsOf(Blocks(n, kColsPerItem), threads, true);
  return {static_cast<int64_t>(starts->size()) - 1, [n, starts, body](int64_t item) {
            body((*starts)[item] * kColsPerItem, std::min(n, (*starts)[item + 1] * kColsPerItem));
          }};
}

template <int64_t R, typename X, typename W>
inline void DotRows(const MatmulJob<X, W>& job, int64_t m, int64_t n) {
  const int64_t k_size = job.k_size;
  const X* x = job.x + m * k_size;
  const W* w = job.w + n * k_size;
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    const __m256 w0 = Load8(w + k), w1 = Load8(w + k + 8);
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(Load8(x + r * k_size + k), w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(Load8(x + r * k_size + k + 8), w1, acc[r][1]);
    }
  }
  for (; k + 8 <= k_size; k += 8) {
    const __m256 w0 = Load8(w + k);
    for (int64_t r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(Load8(x + r * k_size + k), w0, acc[r][0]);
  }
  for (int64_t r = 0; r < R; ++r) {
    float sum = HorizontalSum(_mm256_add_ps(acc[r][0], acc[r][1]));
    for (int64_t kk = k; kk < k_size; ++kk) sum += Load1(x + r * k_size + kk) * Load1(w + kk);
    Emit(job, m + r, n, sum);
  }
}


#ifdef JSERVE_AVX512_BF16
// The same with vdpbf16ps: 32 bfloat16 pairs per instruction, float32 accumulation; the tail is masked.
template <int64_t R>
inline void DotRows(const MatmulJob<uint16_t, uint16_t>& job, int64_t m, int64_t n) {
  const int64_t k_size = job.k_size;
  const uint16_t* x = job.x + m * k_size;
  const uint16_t* w = job.w + n * k_size;
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= k_size; k += 64) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k + 32));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k_size + k)), w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k_size + k + 32)),
                                   w1);
    }
  }
  for (; k < k_size; k += 32) {
    const __mmask32 mask = k + 32 <= k_size ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (k_size - k)) - 1);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, w + k));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + r * k_size + k)),
                                   w0);
    }
  }
  for (int64_t r = 0; r < R; ++r) Emit(job, m + r, n, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])));
}
#endif

template <typename X, typename W>
void MatmulColumns(const MatmulJob<X, W>& job, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t m = 0;
    for (; m + kDecodeRows <= job.m_size; m += kDecodeRows) DotRows<kDecodeRows>(job, m, n);
    switch (job.m_size - m) {
      case 3: DotRows<3>(job, m, n); break;
      case 2: DotRows<2>(job, m, n); break;
      case 1: DotRows<1>(job, m, n); break;
      default: break;
    }
  }
}

#ifndef JSERVE_AVX512_BF16
// bfloat16 weights against float32 x (Bf16Input without AVX512-BF16): sixteen weights are one load, split by two
// bit operations into the even-indexed and the odd-indexed ones as floats (a bfloat16 is the top half of a float32),
// where widening eight at a time costs a shuffle and a shift each. x is split to match, once per work item.
void SplitEvenOdd(const float* x, int64_t rows, int64_t k_size, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * k_size;
    float* dst = out + r * k_size;
    int64_t k = 0;
    for (; k + 16 <= k_size; k += 16) {
      for (int64_t j = 0; j < 8; ++j) {
        dst[k + j] = src[k + 2 * j];
        dst[k + 8 + j] = src[k + 2 * j + 1];
      }
    }
    for (; k < k_size; ++k) dst[k] = src[k];
  }
}

// The loop below holds more instructions per byte than a float32 weight's, so the out-of-order window reaches fewer
// cache lines ahead; a software prefetch 1 KiB ahead makes up for it (a 2-thread stream over 56 MB on an AVX2 EPYC
// reads 20-21 GB/s with it, 16-17 without; 23-25 on huge pages). Plain float32 rows do not need it (packed ones
// do: WideTile). The hint is non-temporal because each weight is read once a step and should not evict what stays:
// batch-1 bfloat16 decode runs ~9% faster than with _MM_HINT_T0.
constexpr int64_t kPrefetchBytes = 1024;

// One or two rows get four accumulators a row, not two, so the 5-cycle FMA latency cannot bound the loop.
template <int64_t R>
inline void DotRowsEvenOdd(const MatmulJob<float, uint16_t>& job, const float* x_split, int64_t m, int64_t n) {
  constexpr int64_t kChunks = R <= 2 ? 2 : 1;  // 16-weight chunks per iteration, two accumulators each
  const int64_t k_size = job.k_size;
  const uint16_t* w = job.w + n * k_size;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][2 * kChunks];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t a = 0; a < 2 * kChunks; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  auto chunk = [&](int64_t k, int64_t a) {
    if (a == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_NTA);
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(bits, high));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x_split + r * k_size + k), even, acc[r][a]);
      acc[r][a + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x_split + r * k_size + k + 8), odd, acc[r][a + 1]);
    }
  };
  int64_t k = 0;
  for (; k + 16 * kChunks <= k_size; k += 16 * kChunks) {
    for (int64_t c = 0; c < kChunks; ++c) chunk(k + 16 * c, 2 * c);
  }
  for (; k + 16 <= k_size; k += 16) chunk(k, 0);
  for (int64_t r = 0; r < R; ++r) {
    __m256 total = acc[r][0];
    for (int64_t a = 1; a < 2 * kChunks; ++a) total = _mm256_add_ps(total, acc[r][a]);
    float sum = HorizontalSum(total);
    for (int64_t kk = k; kk < k_size; ++kk) sum += x_split[r * k_size + kk] * Bf16ToFloat(w[kk]);
    Emit(job, m + r, n, sum);
  }
}

void MatmulColumns(const MatmulJob<float, uint16_t>& job, int64_t n_begin, int64_t n_end) {
  thread_local std::vector<float> split;
  split.resize(static_cast<size_t>(job.m_size * job.k_size));
  SplitEvenOdd(job.x, job.m_size, job.k_size, split.data());
  const int64_t k_size = job.k_size;
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t m = 0;
    for (; m + kDecodeRows <= job.m_size; m += kDecodeRows) {
      DotRowsEvenOdd<kDecodeRows>(job, split.data() + m * k_size, m, n);
    }
    const float* rest = split.data() + m * k_size;
    switch (job.m_size - m) {
      case 3: DotRowsEvenOdd<3>(job, rest, m, n); break;
      case 2: DotRowsEvenOdd<2>(job, rest, m, n); break;
      case 1: DotRowsEvenOdd<1>(job, rest, m, n); break;
      default: break;
    }
  }
}
#endif

}  // namespace
