#pragma once

// What every matmul path shares: the job, where packed blocks lie, and storing results.

#include "phases.h"
#include "simd.h"

namespace {

// Matmul y[M, N] (op)= x[M, K] . w[N, K]^T (+ bias[N]). X and W are float (float32 weights) or uint16_t (bfloat16
// weights, with x already rounded to bfloat16). `accumulate` adds the result to y (a residual connection).

// A packed weight whose blocks lie in parts at separate addresses (cpu_kernels.PartLayout): part p holds
// blocks [begin[p], begin[p + 1]) from base[p] + offset. Each kernel thread's parts of every layer lie one after
// another, so the thread's share of a step is one forward stream: with both cores streaming from memory that reads
// ~60 GB/s, the matmuls read shared [layers, ...] stacks at 0.6-0.75 of that and such streams at ~0.94. Every
// layer's parts of a matrix share `begin` and `base` (layer 0's); `offset` moves to its own.
struct BlockParts {
  int64_t parts;
  const int64_t* begin;      // [parts + 1]
  const float* const* base;  // [parts]
  int64_t offset;            // 4-byte units from layer 0's parts to this layer's
};

template <typename X, typename W>
struct MatmulJob {
  const X* x;
  const W* w;  // packed weights with `parts`: unused
  float* y;
  const float* bias;  // nullptr: none
  bool accumulate;
  int64_t m_size, n_size, k_size;
  const BlockParts* parts = nullptr;  // packed weights only: where the blocks lie, if not one after another at w
  // Per-column factors applied to each sum before the bias (int8 weights' per-row scales, matmul_int8.h): column n's
  // at scale[n - scale_begin]; nullptr: none.
  const float* scale = nullptr;
  int64_t scale_begin = 0;
};

template <typename X, typename W>
inline void Emit(const MatmulJob<X, W>& job, int64_t m, int64_t n, float value) {
  if (job.scale != nullptr) value *= job.scale[n - job.scale_begin];
  if (job.bias != nullptr) value += job.bias[n];
  float* out = job.y + m * job.n_size + n;
  *out = job.accumulate ? *out + value : value;
}

// Emit for a run of `cols` outputs of row m from n (a tile's row), eight at a time.
template <typename X, typename W>
inline void EmitRow(const MatmulJob<X, W>& job, int64_t m, int64_t n, const float* values, int64_t cols) {
  float* out = job.y + m * job.n_size + n;
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    __m256 v = _mm256_loadu_ps(values + c);
    if (job.scale != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(job.scale + n + c - job.scale_begin));
    if (job.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(job.bias + n + c));
    if (job.accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out + c), v);
    _mm256_storeu_ps(out + c, v);
  }
  for (; c < cols; ++c) Emit(job, m, n + c, values[c]);
}

// `units` units of work in consecutive runs, as item i = units [starts[i], starts[i + 1]). Guided for streams: item
// k takes ceil(remaining / (2 threads)) units, so the first items are long forward streams and the last, short ones
// even the threads out. Otherwise (every unit costs the same) equal runs, two a thread.
using ItemStarts = std::shared_ptr<const std::vector<int64_t>>;

ItemStarts RunsOf(int64_t units, int64_t threads, bool guided) {
  auto starts = std::make_shared<std::vector<int64_t>>();
  for (int64_t u = 0; u < units;) {
    starts->push_back(u);
    u += guided ? std::max<int64_t>(1, Blocks(units - u, 2 * threads)) : Blocks(units, 2 * threads);
  }
  starts->push_back(units);
  return starts;
}

}  // namespace
