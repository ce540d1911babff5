#pragma once

// The jserve_matmul call: argument checks, x rounded for bfloat16 weights, and its phases.

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

WeightShape ShapeOf(const ffi::AnyBuffer& w) {
  const auto dims = w.dimensions();
  const ffi::DataType type = w.element_type();
  if (dims.size() == 3 && dims[2] == 2 * kPanel && (type == ffi::DataType::U32 || type == ffi::DataType::F32)) {
    return {dims[0] * 2 * kPanel, type == ffi::DataType::U32 ? dims[1] * 2 : dims[1], true};
  }
  if (dims.size() == 3 && dims[2] == 2 * kPanel && type == ffi::DataType::S8 && dims[1] > 4) {
    return {dims[0] * 2 * kPanel, dims[1] - 4, true};
  }
  if (dims.size() == 2 && type != ffi::DataType::U32 && type != ffi::DataType::S8) return {dims[0], dims[1], false};
  return {};
}

// Whether the weight is an [n, k] matrix (packed: padded to whole pairs of panels).
bool Holds(const WeightShape& w, int64_t n, int64_t k) {
  if (w.cols != k) return false;
  return w.packed ? w.rows == Blocks(n, 2 * kPanel) * 2 * kPanel : w.rows == n;
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y, int64_t int8_round) {
  CallClock call_clock(kMatmulCall);
  const auto x_dims = x.dimensions();
  const WeightShape shape = ShapeOf(w);
  if (x_dims.size() != 2 || y->dimensions().size() != 2 || !Holds(shape, y->dimensions()[1], x_dims[1])) {
    return ffi::Error::InvalidArgument("jserve_matmul: expected x[M, K], w[N, K] (or packed) and y[M, N]");
  }
  const int64_t m_size = x_dims[0], k_size = x_dims[1], n_size = y->dimensions()[1];
  const int64_t threads = pool.num_threads();
  if (shape.packed && w.element_type() == ffi::DataType::S8 && int8_round != 0) {  // x rounded by the caller
    using W = Int8Blocks<true>;
    const MatmulJob<float, W> job{x.typed_data(), static_cast<const W*>(w.untyped_data()), y->typed_data(), nullptr,
                                  false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (shape.packed && w.element_type() == ffi::DataType::S8) {
    using W = Int8Blocks<false>;
    const MatmulJob<float, W> job{x.typed_data(), static_cast<const W*>(w.untyped_data()), y->typed_data(), nullptr,
                                  false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (shape.packed && w.element_type() == ffi::DataType::U32) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint32_t> job{x_bf16.data(), static_cast<const uint32_t*>(w.untyped_data()),
                                             y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x.typed_data(), x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (shape.packed) {
    const MatmulJob<float, F32Panels> job{x.typed_data(), static_cast<const F32Panels*>(w.untyped_data()),
                                          y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (IsBf16Bits(w.element_type())) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint16_t> job{x_bf16.data(), static_cast<const uint16_t*>(w.untyped_data()),
                                             y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x.typed_data(), x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (w.element_type() == ffi::DataType::F32) {
    const MatmulJob<float, float> job{x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(),
                                      nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else {
    return ffi::Error::InvalidArgument("jserve_matmul: w must be float32 or bfloat16 (or packed)");
  }
  return ffi::Error::Success();
}

}  // namespace
