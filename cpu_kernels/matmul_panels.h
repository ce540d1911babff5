#pragma once

// Compute-bound matmuls: weights in 16-column k-major panels, x in register tiles of up to 6 rows.

#include "matmul_job.h"

namespace {

// Larger batches (M >= PanelMinRows) are compute-bound: the weight is packed 16 rows at a time into a k-major
// panel (widened to float32 once), and output tiles of up to 6 x 16 accumulate outer products in 12 registers: per k,
// two weight loads and six broadcasts feed twelve FMAs, with no horizontal sums.

constexpr int64_t kPanel = 16;         // weight rows (output columns) per packed panel: two 8-lane vectors
constexpr int64_t kTileRows = 6;  // x rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast
// Below this many rows, packing costs more than it saves (on the LM head's shapes): bfloat16 weights stream
// through vdpbf16ps fast enough to hold out longer than float32 ones.
template <typename X, typename W>
constexpr int64_t PanelMinRows() {
  return std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t> ? 12 : 8;
}

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
// Shuffles move bits exactly, so the AVX512-BF16 path packs bfloat16 pairs with it as if they were floats.
template <typename W>
void PackPanel(const W* rows, int64_t cols, int64_t k_size, float* panel) {
  // The rows are one contiguous block: request it front to back first, as the transposes below read sixteen
  // short strided streams that the hardware prefetcher follows poorly.
  const char* block = reinterpret_cast<const char*>(rows);
  for (int64_t offset = 0; offset < cols * k_size * static_cast<int64_t>(sizeof(W)); offset += 64) {
    _mm_prefetch(block + offset, _MM_HINT_T0);
  }
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

inline __m256 Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline __m256 Broadcast(const uint16_t* p) { return _mm256_set1_ps(Bf16ToFloat(*p)); }

// Cache lines requested one every `every` k from inside a compute-bound tile loop: the next packed block, spread
// over the current block's tiles, so that its first tile finds it in L2. Without it a 32-row float32 matmul on an
// AVX2 EPYC waits on memory for 20% of its time (58 GFLOP/s, against 73 with the weight in L3).
struct LinePrefetch {
  const char* next = nullptr;  // the next line to request
  const char* end = nullptr;   // none from here on
  int64_t every = 1;
};

// Packed bfloat16 weights without vdpbf16ps (AVX2, or AVX-512 without BF16): each uint32 of the layout holds
// (w[n, 2kp], w[n, 2kp + 1]), so one 32-byte load splits by two bit operations into eight columns' even-k and odd-k
// weights as floats (a bfloat16 is the top half of a float32). x holds bfloat16 values as floats (Bf16Input): the
// products are exact, as vdpbf16ps's are.
inline __m256 EvenHalves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 OddHalves(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// R <= 6 rows of x (row stride k_size) times one packed panel (`stride` floats from one k to the next) into an
// R x 16 tile. The accumulators are named variables (held in an array, GCC spills them to the stack on every
// iteration); those of rows past R are unused and compiled away. With kPairs the panel is one 16-column half of a
// packed bfloat16 block (`stride` uint32 from one pair of k to the next): per pair of k and 8 columns, one load
// split into even and odd k, and two broadcasts a row (12 accumulators + even + odd + one broadcast).
template <int64_t R, bool kPairs = false, typename X>
void PanelTile(const X* x, int64_t k_size, const float* panel, int64_t stride, LinePrefetch& prefetch,
               float tile[kTileRows][kPanel]) {
  static_assert(R >= 1 && R <= kTileRows);
  int64_t countdown = prefetch.every;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  auto row = [&](int64_t r) { return x + std::min(r, R - 1) * k_size; };  // rows past R are never read
  const X *x0 = row(0), *x1 = row(1), *x2 = row(2), *x3 = row(3), *x4 = row(4), *x5 = row(5);
  for (int64_t k = 0; k < k_size; k += kPairs ? 2 : 1) {
    if (--countdown == 0) {
      countdown = prefetch.every;
      if (prefetch.next < prefetch.end) _mm_prefetch(prefetch.next, _MM_HINT_T1), prefetch.next += 64;
    }
    if constexpr (kPairs) {
      // One 8-column half of the pair: its even and odd k's times two broadcasts of each row of x.
      auto columns = [&](const float* w, __m256& a0, __m256& a1, __m256& a2, __m256& a3, __m256& a4, __m256& a5) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256 even = EvenHalves(bits), odd = OddHalves(bits);
        auto row_pair = [&](const float* xk, __m256& c) {
          asm volatile("" ::: "memory");  // GCC would hoist all twelve broadcasts and spill the accumulators for them
          c = _mm256_fmadd_ps(_mm256_broadcast_ss(xk), even, c);
          c = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 1), odd, c);
        };
        row_pair(x0 + k, a0);
        if constexpr (R > 1) row_pair(x1 + k, a1);
        if constexpr (R > 2) row_pair(x2 + k, a2);
        if constexpr (R > 3) row_pair(x3 + k, a3);
        if constexpr (R > 4) row_pair(x4 + k, a4);
        if constexpr (R > 5) row_pair(x5 + k, a5);
      };
      columns(panel + k / 2 * stride, c00, c10, c20, c30, c40, c50);
      columns(panel + k / 2 * stride + 8, c01, c11, c21, c31, c41, c51);
    } else {
      const __m256 w0 = _mm256_loadu_ps(panel + k * stride);
      const __m256 w1 = _mm256_loadu_ps(panel + k * stride + 8);
      auto row_fma = [&](const X* xr, __m256& c0, __m256& c1) {  // one row of x: a broadcast, two FMAs
        const __m256 xv = Broadcast(xr + k);
        c0 = _mm256_fmadd_ps(xv, w0, c0);
        c1 = _mm256_fmadd_ps(xv, w1, c1);
      };
      row_fma(x0, c00, c01);
      if constexpr (R > 1) row_fma(x1, c10, c11);
      if constexpr (R > 2) row_fma(x2, c20, c21);
      if constexpr (R > 3) row_fma(x3, c30, c31);
      if constexpr (R > 4) row_fma(x4, c40, c41);
      if constexpr (R > 5) row_fma(x5, c50, c51);
    }
  }
  _mm256_storeu_ps(tile[0], c00), _mm256_storeu_ps(tile[0] + 8, c01);
  if constexpr (R > 1) _mm256_storeu_ps(tile[1], c10), _mm256_storeu_ps(tile[1] + 8, c11);
  if constexpr (R > 2) _mm256_storeu_ps(tile[2], c20), _mm256_storeu_ps(tile[2] + 8, c21);
  if constexpr (R > 3) _mm256_storeu_ps(tile[3], c30), _mm256_storeu_ps(tile[3] + 8, c31);
  if constexpr (R > 4) _mm256_storeu_ps(tile[4], c40), _mm256_storeu_ps(tile[4] + 8, c41);
  if constexpr (R > 5) _mm256_storeu_ps(tile[5], c50), _mm256_storeu_ps(tile[5] + 8, c51);
}

// x rows m .. m + rows of a tile, zero-padded to `tile_rows` rows when fewer remain.
template <typename X, typename W>
const X* TileRows(const MatmulJob<X, W>& job, int64_t m, int64_t tile_rows, std::vector<X>& tail) {
  const int64_t rows = std::min(tile_rows, job.m_size - m);
  if (rows == tile_rows) return job.x + m * job.k_size;
  tail.assign(static_cast<size_t>(tile_rows * job.k_size), X{0});
  std::memcpy(tail.data(), job.x + m * job.k_size, static_cast<size_t>(rows * job.k_size) * sizeof(X));
  return tail.data();
}

// Every row of x times one panel (`cols` <= 16 real columns from n_begin; with kPairs, a half of a packed bfloat16
// block), requesting the lines of [prefetch_begin, prefetch_end) spread over its tiles. The rows are
// spread evenly over the tiles (32 rows: 6, 6, 5, 5, 5, 5): no padding rows are computed, and no tile is left so
// short that its few accumulators keep the FMA units waiting on their latency.
template <bool kPairs = false, typename X, typename W>
void PanelTiles(const MatmulJob<X, W>& job, int64_t n_begin, int64_t cols, const float* panel, int64_t stride,
                const char* prefetch_begin, const char* prefetch_end) {
  float tile[kTileRows][kPanel];
  const int64_t tiles = Blocks(job.m_size, kTileRows);
  const int64_t lines = Blocks(prefetch_end - prefetch_begin, 64);
  const int64_t steps = kPairs ? job.k_size / 2 : job.k_size;  // loop iterations a tile
  LinePrefetch prefetch{prefetch_begin, prefetch_end,
                        lines > 0 ? std::max<int64_t>(1, tiles * steps / lines) : steps + 1};
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = job.m_size / tiles + (t < job.m_size % tiles ? 1 : 0);
    const X* x = job.x + m * job.k_size;
    auto run = [&](auto height) {
      constexpr int64_t R = decltype(height)::value;
      PanelTile<R, kPairs>(x, job.k_size, panel, stride, prefetch, tile);
    };
    switch (rows) {
      case 6: run(std::integral_constant<int64_t, 6>{}); break;
      case 5: run(std::integral_constant<int64_t, 5>{}); break;
      case 4: run(std::integral_constant<int64_t, 4>{}); break;
      case 3: run(std::integral_constant<int64_t, 3>{}); break;
      case 2: run(std::integral_constant<int64_t, 2>{}); break;
      default: run(std::integral_constant<int64_t, 1>{}); break;
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
    m += rows;
  }
}

// The 16 weight rows from n_begin packed into a panel, then every row of x times it; with `prefetch_next`, the
// next 16 rows requested meanwhile (see LinePrefetch).
template <typename X, typename W>
void MatmulPanel(const MatmulJob<X, W>& job, int64_t n_begin, bool prefetch_next) {
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(kPanel * job.k_size));
  const int64_t cols = std::min(kPanel, job.n_size - n_begin);
  const W* rows = job.w + n_begin * job.k_size;
  PackPanel(rows, cols, job.k_size, panel.data());
  const char* next = reinterpret_cast<const char*>(rows + cols * job.k_size);
  const int64_t next_cols = prefetch_next ? std::min(kPanel, job.n_size - n_begin - cols) : 0;
  PanelTiles(job, n_begin, cols, panel.data(), kPanel, next, next + next_cols * job.k_size * sizeof(W));
}

}  // namespace
