#pragma once

// The jserve_matmul and jserve_expert_matmul calls: argument checks, x rounded for bfloat16 weights, and their
// phases.

#include "matmul_int8.h"

namespace {

// x rounded to bfloat16 (bits, or float32 values: Bf16Input), a row block per item (bfloat16 weights take
// bfloat16 activations).
template <typename X>
Phase RoundRowsPhase(const float* x, X* out, int64_t rows, int64_t cols) {
  constexpr int64_t kRowsPerItem = 16;
  return {Blocks(rows, kRowsPerItem), [=](int64_t item) {
            const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
            for (int64_t r = item * kRowsPerItem; r < end; ++r) StoreInput(out + r * cols, x + r * cols, cols, true);
          }};
}

// A weight's [N, K] as stored: plain [N, K], or packed (N_pad >= N rows): bfloat16 pairs uint32 [N_pad / 32, K / 2,
// 32], float32 [N_pad / 32, K, 32], or int8 with its scales [N_pad / 32, K + 4, 32] (matmul_int8.h). int8 is never
// plain.
struct WeightShape {
  int64_t rows = -1, cols = -1;
  bool packed = false;
};

// The weight shape of dims[first:] (an expert's matrix in a stack of them: first = 1).
template <typename Dims>
WeightShape ShapeOfDims(const Dims& all, size_t first, ffi::DataType type) {
  const size_t rank = all.size() - first;
  const auto dim = [&](size_t i) { return all[first + i]; };
  if (rank == 3 && dim(2) == 2 * kPanel && (type == ffi::DataType::U32 || type == ffi::DataType::F32)) {
    return {dim(0) * 2 * kPanel, type == ffi::DataType::U32 ? dim(1) * 2 : dim(1), true};
  }
  if (rank == 3 && dim(2) == 2 * kPanel && type == ffi::DataType::S8 && dim(1) > 4) {
    return {dim(0) * 2 * kPanel, dim(1) - 4, true};
  }
  if (rank == 2 && type != ffi::DataType::U32 && type != ffi::DataType::S8) return {dim(0), dim(1), false};
  return {};
}

WeightShape ShapeOf(const ffi::AnyBuffer& w) { return ShapeOfDims(w.dimensions(), 0, w.element_type()); }

// Whether the weight is an [n, k] matrix (packed: padded to whole pairs of panels).
bool Holds(const WeightShape& w, int64_t n, int64_t k) {
  if (w.cols != k) return false;
  return w.packed ? w.rows == Blocks(n, 2 * kPanel) * 2 * kPanel : w.rows == n;
}

// y[M, N] = x[M, K] . w^T for a weight at w of `type` laid out as `shape`.
ffi::Error RunMatmul(ffi::ThreadPool& pool, const float* x, int64_t m_size, int64_t k_size, const void* w,
                     ffi::DataType type, const WeightShape& shape, float* y, int64_t n_size, int64_t int8_round) {
  const int64_t threads = pool.num_threads();
  if (shape.packed && type == ffi::DataType::S8 && int8_round != 0) {  // x rounded by the caller
    using W = Int8Blocks<true>;
    const MatmulJob<float, W> job{x, static_cast<const W*>(w), y, nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (shape.packed && type == ffi::DataType::S8) {
    using W = Int8Blocks<false>;
    const MatmulJob<float, W> job{x, static_cast<const W*>(w), y, nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (shape.packed && type == ffi::DataType::U32) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint32_t> job{x_bf16.data(), static_cast<const uint32_t*>(w), y, nullptr, false,
                                             m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x, x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (shape.packed) {
    const MatmulJob<float, F32Panels> job{x, static_cast<const F32Panels*>(w), y, nullptr, false, m_size, n_size,
                                          k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (IsBf16Bits(type)) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint16_t> job{x_bf16.data(), static_cast<const uint16_t*>(w), y, nullptr, false,
                                             m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x, x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (type == ffi::DataType::F32) {
    const MatmulJob<float, float> job{x, static_cast<const float*>(w), y, nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else {
    return ffi::Error::InvalidArgument("jserve_matmul: w must be float32 or bfloat16 (or packed)");
  }
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y, int64_t int8_round) {
  CallClock call_clock(kMatmulCall);
  const auto x_dims = x.dimensions();
  const WeightShape shape = ShapeOf(w);
  if (x_dims.size() != 2 || y->dimensions().size() != 2 || !Holds(shape, y->dimensions()[1], x_dims[1])) {
    return ffi::Error::InvalidArgument("jserve_matmul: expected x[M, K], w[N, K] (or packed) and y[M, N]");
  }
  return RunMatmul(pool, x.typed_data(), x_dims[0], x_dims[1], w.untyped_data(), w.element_type(), shape,
                   y->typed_data(), y->dimensions()[1], int8_round);
}

// jserve_matmul with one expert's matrix of a stack of packed ones (a mixture of experts' [E, ...packed]): the
// expert's blocks are read where they lie, never copied out of the stack first.
ffi::Error ExpertMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> expert, ffi::ResultBuffer<ffi::F32> y, int64_t int8_round) {
  CallClock call_clock(kMatmulCall);
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const WeightShape shape = w_dims.size() == 4 ? ShapeOfDims(w_dims, 1, w.element_type()) : WeightShape{};
  if (x_dims.size() != 2 || y->dimensions().size() != 2 || !shape.packed || expert.element_count() != 1 ||
      !Holds(shape, y->dimensions()[1], x_dims[1])) {
    return ffi::Error::InvalidArgument("jserve_expert_matmul: expected x[M, K], a packed stack w[E, ...] of [N, K] "
                                       "weights, one expert index and y[M, N]");
  }
  const int64_t e = expert.typed_data()[0];
  if (e < 0 || e >= w_dims[0]) return ffi::Error::InvalidArgument("jserve_expert_matmul: expert index out of range");
  const size_t expert_bytes = w.size_bytes() / static_cast<size_t>(w_dims[0]);
  const void* w_e = static_cast<const char*>(w.untyped_data()) + static_cast<size_t>(e) * expert_bytes;
  return RunMatmul(pool, x.typed_data(), x_dims[0], x_dims[1], w_e, w.element_type(), shape, y->typed_data(),
                   y->dimensions()[1], int8_round);
}

}  // namespace
