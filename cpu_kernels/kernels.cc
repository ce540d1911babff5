// jserve's CPU kernels, called from jitted JAX code through XLA's FFI (cpu_kernels/__init__.py builds this file).
//
// XLA CPU runs the small matmuls of a decode step (M = 1..64 rows against a [out, in] weight) far below memory
// bandwidth and pays a fixed cost per op, and its paged attention has to gather every page of every token first.
// These two kernels do what llama.cpp does instead: for few rows, stream each weight row once with all M rows of x
// in cache; for many, accumulate register tiles over packed weight panels; and read each sequence's K/V pages in
// place. Work is split over XLA's own intra-op thread pool.
//
//   jserve_matmul:      y f32[M, N] = x f32[M, K] . w[N, K]^T      (w float32, or bfloat16 / uint16 bf16 bits)
//   jserve_paged_attention: the spec of pallas_kernels/interface.py, with float32 q and out, K/V f32 or bf16 bits.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Parallel loop over XLA's intra-op pool. Each thread claims items from a shared counter; the caller works too and
// then waits only for items another thread has already started, so a helper task that never gets a thread (or runs
// after the call returned) cannot block or touch freed memory: it finds no item left and returns.

struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t count = 0;
  std::function<void(int64_t)> body;

  void Work() {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      body(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void ParallelFor(ffi::ThreadPool& pool, int64_t count, std::function<void(int64_t)> body) {
  const int64_t threads = std::min<int64_t>(pool.num_threads(), count);
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  auto state = std::make_shared<ParallelState>();
  state->count = count;
  state->body = std::move(body);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < count) _mm_pause();
}

// ---------------------------------------------------------------------------------------------------------------
// Vector helpers (AVX2 + FMA; the file is compiled with -march=native, and the Python side checks for both).

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

// Eight bfloat16 values (their bits) as eight floats: bfloat16 is the top half of a float32.
inline __m256 LoadBf16x8(const uint16_t* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight weights as floats: float32 loaded as is, bfloat16 bits (uint16) widened in registers.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return LoadBf16x8(p); }
inline float Load1(const float* p) { return *p; }
inline float Load1(const uint16_t* p) { return Bf16ToFloat(*p); }

// ---------------------------------------------------------------------------------------------------------------
// Matmul for few rows (decode): bandwidth-bound, so each weight row is read straight from memory (widened in
// registers) against every row of x, in tiles of kRows x kCols outputs with 8 accumulators in registers.

constexpr int64_t kCols = 4;          // weight rows per tile
constexpr int64_t kRows = 2;          // x rows per tile
constexpr int64_t kColsPerItem = 64;  // weight rows per parallel work item

template <int64_t R, typename W>
inline void DotTile(const float* x, const W* w, int64_t k_size, float* y, int64_t y_stride) {
  __m256 acc[R][kCols];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_size; k += 8) {
    __m256 wv[kCols];
    for (int64_t c = 0; c < kCols; ++c) wv[c] = Load8(w + c * k_size + k);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k_size + k);
      for (int64_t c = 0; c < kCols; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      float sum = HorizontalSum(acc[r][c]);
      for (int64_t kk = k; kk < k_size; ++kk) sum += x[r * k_size + kk] * Load1(w + c * k_size + kk);
      y[r * y_stride + c] = sum;
    }
  }
}

template <typename W>
inline float DotRow(const float* x, const W* w, int64_t k_size) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_size; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), Load8(w + k), acc);
  float sum = HorizontalSum(acc);
  for (; k < k_size; ++k) sum += x[k] * Load1(w + k);
  return sum;
}

template <typename W>
void MatmulColumns(const float* x, const W* w, float* y, int64_t m_size, int64_t n_size, int64_t k_size,
                   int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + kCols <= n_end; n += kCols) {
    int64_t m = 0;
    for (; m + kRows <= m_size; m += kRows) {
      DotTile<kRows>(x + m * k_size, w + n * k_size, k_size, y + m * n_size + n, n_size);
    }
    if (m < m_size) DotTile<1>(x + m * k_size, w + n * k_size, k_size, y + m * n_size + n, n_size);
  }
  for (; n < n_end; ++n) {
    for (int64_t m = 0; m < m_size; ++m) y[m * n_size + n] = DotRow(x + m * k_size, w + n * k_size, k_size);
  }
}

// Larger batches (M >= kPanelMinRows) are compute-bound: the weight is packed 16 rows at a time into a
// k-major panel (widened to float32 once), and 6 x 16 output tiles accumulate outer products in 12 registers:
// per k, two weight loads and six broadcasts feed twelve FMAs, with no horizontal sums.

constexpr int64_t kPanel = 16;       // weight rows (output columns) per packed panel: two 8-lane vectors
constexpr int64_t kTileRows = 6;     // x rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kPanelMinRows = 24;  // below this, packing costs more than it saves (measured)

// Transpose eight vectors of eight floats in registers (rows[i][j] -> rows[j][i]).
inline void Transpose8x8(__m256 rows[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
  const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
  const __m256 t4 = _mm256_unpacklo_ps(rows[4], rows[5]), t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
  const __m256 t6 = _mm256_unpacklo_ps(rows[6], rows[7]), t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  rows[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  rows[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  rows[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  rows[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  rows[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  rows[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  rows[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  rows[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// panel[k * 16 + j] = rows[j, k] for the 16 weight rows at `rows`, zeros past `cols`. A whole panel (K a multiple
// of 8) goes in 8 x 8 blocks loaded, widened and transposed in registers; a partial one element by element.
template <typename W>
void PackPanel(const W* rows, int64_t cols, int64_t k_size, float* panel) {
  if (cols == kPanel && k_size % 8 == 0) {
    for (int64_t k = 0; k < k_size; k += 8) {
      for (int64_t half = 0; half < 2; ++half) {
        __m256 block[8];
        for (int64_t j = 0; j < 8; ++j) block[j] = Load8(rows + (half * 8 + j) * k_size + k);
        Transpose8x8(block);
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kPanel + half * 8, block[i]);
      }
    }
    return;
  }
  std::fill(panel, panel + kPanel * k_size, 0.0f);
  for (int64_t k = 0; k < k_size; ++k) {
    for (int64_t j = 0; j < cols; ++j) panel[k * kPanel + j] = Load1(rows + j * k_size + k);
  }
}

// Six rows of x (row stride k_size) times one packed panel into y[6, cols]. The twelve accumulators are named
// variables: held in an array, GCC spills them to the stack on every iteration.
void PanelTile(const float* x, int64_t k_size, const float* panel, float* y, int64_t y_stride, int64_t rows,
               int64_t cols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float *x0 = x, *x1 = x + k_size, *x2 = x + 2 * k_size, *x3 = x + 3 * k_size, *x4 = x + 4 * k_size,
              *x5 = x + 5 * k_size;
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    __m256 xv = _mm256_broadcast_ss(x0 + k);
    c00 = _mm256_fmadd_ps(xv, w0, c00);
    c01 = _mm256_fmadd_ps(xv, w1, c01);
    xv = _mm256_broadcast_ss(x1 + k);
    c10 = _mm256_fmadd_ps(xv, w0, c10);
    c11 = _mm256_fmadd_ps(xv, w1, c11);
    xv = _mm256_broadcast_ss(x2 + k);
    c20 = _mm256_fmadd_ps(xv, w0, c20);
    c21 = _mm256_fmadd_ps(xv, w1, c21);
    xv = _mm256_broadcast_ss(x3 + k);
    c30 = _mm256_fmadd_ps(xv, w0, c30);
    c31 = _mm256_fmadd_ps(xv, w1, c31);
    xv = _mm256_broadcast_ss(x4 + k);
    c40 = _mm256_fmadd_ps(xv, w0, c40);
    c41 = _mm256_fmadd_ps(xv, w1, c41);
    xv = _mm256_broadcast_ss(x5 + k);
    c50 = _mm256_fmadd_ps(xv, w0, c50);
    c51 = _mm256_fmadd_ps(xv, w1, c51);
  }
  alignas(32) float tile[kTileRows][kPanel];
  _mm256_store_ps(tile[0], c00), _mm256_store_ps(tile[0] + 8, c01);
  _mm256_store_ps(tile[1], c10), _mm256_store_ps(tile[1] + 8, c11);
  _mm256_store_ps(tile[2], c20), _mm256_store_ps(tile[2] + 8, c21);
  _mm256_store_ps(tile[3], c30), _mm256_store_ps(tile[3] + 8, c31);
  _mm256_store_ps(tile[4], c40), _mm256_store_ps(tile[4] + 8, c41);
  _mm256_store_ps(tile[5], c50), _mm256_store_ps(tile[5] + 8, c51);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * y_stride, tile[r], static_cast<size_t>(cols) * 4);
}

template <typename W>
void MatmulPanel(const float* x, const W* w, float* y, int64_t m_size, int64_t n_size, int64_t k_size,
                 int64_t n_begin) {
  thread_local std::vector<float> panel, x_tail;
  panel.resize(static_cast<size_t>(kPanel * k_size));
  const int64_t cols = std::min(kPanel, n_size - n_begin);
  PackPanel(w + n_begin * k_size, cols, k_size, panel.data());
  for (int64_t m = 0; m < m_size; m += kTileRows) {
    const int64_t rows = std::min(kTileRows, m_size - m);
    const float* x_rows = x + m * k_size;
    if (rows < kTileRows) {  // the last few rows, zero-padded to a whole tile
      x_tail.assign(static_cast<size_t>(kTileRows * k_size), 0.0f);
      std::memcpy(x_tail.data(), x_rows, static_cast<size_t>(rows * k_size) * 4);
      x_rows = x_tail.data();
    }
    PanelTile(x_rows, k_size, panel.data(), y + m * n_size + n_begin, n_size, rows, cols);
  }
}

// Decode-sized batches stream weights (MatmulColumns); larger ones go through packed panels (MatmulPanel).
template <typename W>
void Matmul(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t m_size, int64_t n_size,
            int64_t k_size) {
  if (m_size >= kPanelMinRows) {
    ParallelFor(pool, (n_size + kPanel - 1) / kPanel, [=](int64_t item) {
      MatmulPanel(x, w, y, m_size, n_size, k_size, item * kPanel);
    });
    return;
  }
  ParallelFor(pool, (n_size + kColsPerItem - 1) / kColsPerItem, [=](int64_t item) {
    const int64_t n_begin = item * kColsPerItem;
    MatmulColumns(x, w, y, m_size, n_size, k_size, n_begin, std::min(n_size, n_begin + kColsPerItem));
  });
}

bool IsBf16Bits(ffi::DataType type) { return type == ffi::DataType::BF16 || type == ffi::DataType::U16; }

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1]) {
    return ffi::Error::InvalidArgument("jserve_matmul: expected x[M, K] and w[N, K]");
  }
  const int64_t m_size = x_dims[0], k_size = x_dims[1], n_size = w_dims[0];
  if (IsBf16Bits(w.element_type())) {
    Matmul(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), m_size, n_size,
           k_size);
  } else if (w.element_type() == ffi::DataType::F32) {
    Matmul(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(), m_size, n_size,
           k_size);
  } else {
    return ffi::Error::InvalidArgument("jserve_matmul: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Ragged paged attention. One work item is (sequence, KV head, block of up to kQueryBlock query tokens): its rows
// are those tokens times the query heads sharing the KV head (GQA). Pages are visited once per item, in order,
// with a flash-attention style running max and sum per row.

constexpr int64_t kQueryBlock = 16;

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

struct AttentionArgs {
  const float* q;            // [T, H, D]
  const void* k_pages;       // [N, B, Hkv, D]
  const void* v_pages;
  bool kv_bf16;
  const int32_t* page_table;  // [S, P]
  const int32_t* query_start;  // [S + 1]
  const int32_t* seq_lens;    // [S]
  float* out;                 // [T, H, D]
  int64_t num_heads, kv_heads, head_dim, page_size, pages_per_seq, num_pages;
  float scale, soft_cap;      // soft_cap 0: none
  int64_t sliding_window;     // 0: none
};

struct AttentionItem {
  int64_t seq, kv_head, token_begin, token_end;
};

// One page-row of K or V for one KV head, as float32 (widened into `scratch` for a bf16 cache).
inline const float* KvRow(const AttentionArgs& a, const void* pages, int64_t page, int64_t slot, int64_t kv_head,
                          float* scratch) {
  const int64_t offset = ((page * a.page_size + slot) * a.kv_heads + kv_head) * a.head_dim;
  if (!a.kv_bf16) return static_cast<const float*>(pages) + offset;
  const uint16_t* row = static_cast<const uint16_t*>(pages) + offset;
  int64_t d = 0;
  for (; d + 8 <= a.head_dim; d += 8) _mm256_storeu_ps(scratch + d, LoadBf16x8(row + d));
  for (; d < a.head_dim; ++d) scratch[d] = Bf16ToFloat(row[d]);
  return scratch;
}

// Four dot products q . k_i at once; the four horizontal sums share three hadds.
inline __m128 Dot4(const float* q, const float* const* k, int64_t size) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < size; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// out[0..64) += sum_j weights[j] * v[j][0..64), with the output row held in eight registers.
inline void AccumulateRow64(float* out, const float* weights, const float* const* v, int64_t keys) {
  __m256 o[8];
  for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_loadu_ps(out + 8 * i);
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 w = _mm256_set1_ps(weights[j]);
    for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 8 * i), o[i]);
  }
  for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
}

void AttendItem(const AttentionArgs& a, const AttentionItem& item) {
  const int64_t group = a.num_heads / a.kv_heads, d_size = a.head_dim, b_size = a.page_size;
  const int64_t q_len = a.query_start[item.seq + 1] - a.query_start[item.seq];
  const int64_t first_pos = a.seq_lens[item.seq] - q_len;  // position of the sequence's first new token
  const int64_t tokens = item.token_end - item.token_begin, rows = tokens * group;
  thread_local std::vector<float> buffer;
  // q rows (pre-scaled) | accumulators | scores of one page | running max | running sum | K and V of one page
  buffer.resize(static_cast<size_t>(2 * rows * d_size + rows * b_size + 2 * rows + 2 * b_size * d_size));
  float* q = buffer.data();
  float* acc = q + rows * d_size;
  float* scores = acc + rows * d_size;
  float* row_max = scores + rows * b_size;
  float* row_sum = row_max + rows;
  float* kv_scratch = row_sum + rows;
  thread_local std::vector<int64_t> row_pos;
  row_pos.resize(static_cast<size_t>(rows));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t token = item.token_begin + t;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float* src = a.q + (token * a.num_heads + item.kv_head * group + g) * d_size;
      for (int64_t d = 0; d < d_size; ++d) q[r * d_size + d] = src[d] * a.scale;
      row_pos[r] = first_pos + (token - a.query_start[item.seq]);
    }
  }
  std::fill(acc, acc + rows * d_size, 0.0f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.0f);
  const int64_t last_pos = row_pos[rows - 1];
  int64_t lowest_key = 0;
  if (a.sliding_window > 0) lowest_key = std::max<int64_t>(0, row_pos[0] - a.sliding_window + 1);
  const int32_t* pages = a.page_table + item.seq * a.pages_per_seq;
  for (int64_t p = lowest_key / b_size; p * b_size <= last_pos; ++p) {
    const int64_t page = pages[p];
    if (page < 0 || page >= a.num_pages) continue;  // never for a valid table; keeps a bad one in bounds
    const int64_t key_begin = p * b_size, keys = std::min(b_size, last_pos + 1 - key_begin);
    const float* k_rows[64];
    const float* v_rows[64];
    for (int64_t j = 0; j < keys; ++j) {
      k_rows[j] = KvRow(a, a.k_pages, page, j, item.kv_head, kv_scratch + j * d_size);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * b_size;
      const int64_t pos = row_pos[r];
      float page_max = -std::numeric_limits<float>::infinity();
      int64_t j4 = 0;
      if (d_size % 8 == 0) {
        for (; j4 + 4 <= keys; j4 += 4) _mm_storeu_ps(s + j4, Dot4(q + r * d_size, k_rows + j4, d_size));
      }
      for (int64_t j = j4; j < keys; ++j) s[j] = DotRow(q + r * d_size, k_rows[j], d_size);
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t key_pos = key_begin + j;
        const bool visible = key_pos <= pos && (a.sliding_window <= 0 || key_pos > pos - a.sliding_window);
        float score = -std::numeric_limits<float>::infinity();
        if (visible) score = a.soft_cap > 0 ? a.soft_cap * std::tanh(s[j] / a.soft_cap) : s[j];
        s[j] = score;
        page_max = std::max(page_max, score);
      }
      for (int64_t j = keys; j < b_size; ++j) s[j] = -std::numeric_limits<float>::infinity();
      if (page_max == -std::numeric_limits<float>::infinity()) {
        for (int64_t j = 0; j < b_size; ++j) s[j] = 0.0f;  // nothing visible in this page for this row
        continue;
      }
      const float new_max = std::max(row_max[r], page_max);
      const float correction = std::exp(row_max[r] - new_max);  // 0 on the first visible page (max was -inf)
      row_max[r] = new_max;
      float page_sum = 0.0f;
      int64_t j = 0;
      for (; j + 8 <= b_size; j += 8) {
        const __m256 score = _mm256_loadu_ps(s + j);
        const __m256 masked = _mm256_cmp_ps(score, _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                            _CMP_EQ_OQ);
        const __m256 e = _mm256_andnot_ps(masked, ExpNonPositive(_mm256_sub_ps(score, _mm256_set1_ps(new_max))));
        _mm256_storeu_ps(s + j, e);
        page_sum += HorizontalSum(e);
      }
      for (; j < b_size; ++j) {
        s[j] = std::exp(s[j] - new_max);
        page_sum += s[j];
      }
      row_sum[r] = row_sum[r] * correction + page_sum;
      float* out_row = acc + r * d_size;
      if (correction != 1.0f) {
        for (int64_t d = 0; d < d_size; ++d) out_row[d] *= correction;
      }
    }
    for (int64_t j = 0; j < keys; ++j) {
      v_rows[j] = KvRow(a, a.v_pages, page, j, item.kv_head, kv_scratch + (b_size + j) * d_size);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* out_row = acc + r * d_size;
      const float* s = scores + r * b_size;
      if (d_size == 64) {
        AccumulateRow64(out_row, s, v_rows, keys);
        continue;
      }
      for (int64_t j = 0; j < keys; ++j) {
        const float weight = s[j];
        if (weight == 0.0f) continue;
        const __m256 wv = _mm256_set1_ps(weight);
        int64_t d = 0;
        for (; d + 8 <= d_size; d += 8) {
          _mm256_storeu_ps(out_row + d,
                           _mm256_fmadd_ps(wv, _mm256_loadu_ps(v_rows[j] + d), _mm256_loadu_ps(out_row + d)));
        }
        for (; d < d_size; ++d) out_row[d] += weight * v_rows[j][d];
      }
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t token = item.token_begin + t;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      const float inv = row_sum[r] > 0 ? 1.0f / row_sum[r] : 0.0f;
      float* dst = a.out + (token * a.num_heads + item.kv_head * group + g) * d_size;
      for (int64_t d = 0; d < d_size; ++d) dst[d] = acc[r * d_size + d] * inv;
    }
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window, float soft_cap) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_pages.dimensions();
  const auto table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("jserve_paged_attention: expected q[T,H,D], pages[N,B,Hkv,D], table[S,P]");
  }
  if (k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("jserve_paged_attention: k_pages and v_pages differ in dtype");
  }
  AttentionArgs a;
  a.kv_bf16 = IsBf16Bits(k_pages.element_type());
  if (!a.kv_bf16 && k_pages.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("jserve_paged_attention: the KV cache must be float32 or bfloat16");
  }
  a.q = q.typed_data();
  a.k_pages = k_pages.untyped_data();
  a.v_pages = v_pages.untyped_data();
  a.page_table = page_table.typed_data();
  a.query_start = query_start.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.out = out->typed_data();
  a.num_heads = q_dims[1];
  a.head_dim = q_dims[2];
  a.num_pages = kv_dims[0];
  a.page_size = kv_dims[1];
  a.kv_heads = kv_dims[2];
  a.pages_per_seq = table_dims[1];
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.sliding_window = sliding_window;
  if (a.page_size > 64 || a.kv_heads <= 0 || a.num_heads % a.kv_heads != 0 || kv_dims[3] != a.head_dim) {
    return ffi::Error::InvalidArgument("jserve_paged_attention: unsupported shapes (page size must be <= 64)");
  }
  const int64_t num_tokens = q_dims[0], num_seqs = table_dims[0];
  const int64_t real_tokens = std::min<int64_t>(num_tokens, a.query_start[num_seqs]);
  if (real_tokens < num_tokens) {  // padding tokens get zeros
    std::fill(a.out + real_tokens * a.num_heads * a.head_dim, a.out + num_tokens * a.num_heads * a.head_dim, 0.0f);
  }
  std::vector<AttentionItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = a.query_start[s], end = std::min<int64_t>(a.query_start[s + 1], real_tokens);
    if (end <= begin) continue;
    if (a.seq_lens[s] < end - begin || (a.seq_lens[s] + a.page_size - 1) / a.page_size > a.pages_per_seq) {
      return ffi::Error::InvalidArgument("jserve_paged_attention: seq_lens disagree with query_start or page_table");
    }
    for (int64_t t = begin; t < end; t += kQueryBlock) {
      for (int64_t h = 0; h < a.kv_heads; ++h) items.push_back({s, h, t, std::min(end, t + kQueryBlock)});
    }
  }
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) { AttendItem(a, items[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
