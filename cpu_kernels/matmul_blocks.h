#pragma once

// Tiles over one packed 32-column block of weights (two panels): AVX-512, AVX2, and bfloat16 pairs.

#include "matmul_panels.h"
#include "prefetch.h"

namespace {

// Tiles of up to kWideRows rows of x are bandwidth-bound: each streams a whole 32-column block once (AVX2: WideTile
// for float32, WidePairTile for bfloat16 pairs; AVX-512: PackedTile).
constexpr int64_t kWideRows = 2;

#ifdef JSERVE_AVX512_BF16
// bfloat16 panels for vdpbf16ps: a panel holds 16 weight rows as k-pairs, (w[j, 2kp], w[j, 2kp + 1]) for j < 16,
// one 512-bit vector per pair of k. A tile is R <= 12 rows of x by two panels (32 columns): per pair of k, two
// weight loads and R broadcast pairs feed 2R vdpbf16ps (at 12 rows: 24 accumulators of the 32 registers).
template <int64_t R>
void PackedTile(const uint16_t* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
                float tile[][2 * kPanel]) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    if constexpr (R <= kWideRows) PrefetchAhead(panel_a + kp * stride);
    const __m512bh wa = reinterpret_cast<__m512bh>(_mm512_loadu_ps(panel_a + kp * stride));
    const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_loadu_ps(panel_b + kp * stride));
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_size + 2 * kp, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, wa);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, wb);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], acc[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, acc[r][1]);
  }
}
#endif

template <typename X, typename W>
int64_t PanelCols() {
#ifdef JSERVE_AVX512_BF16
  if (std::is_same_v<X, uint16_t>) return 2 * kPanel;
#endif
  return kPanel;
}

// Weights packed once at load time (cpu_kernels.pack_weight), N_pad a multiple of 32, block b holding rows
// 32b .. 32b + 31 k-major: bfloat16 as uint32 pairs [N_pad / 32, K / 2, 32] (w[n, 2kp], w[n, 2kp + 1]), float32 as
// [N_pad / 32, K, 32]. Every batch size runs tiles straight over them (AVX-512: the same 1-12 row tiles; AVX2: see
// its BlockTiles, and for bfloat16 without AVX512-BF16 the pair tiles' BlockTiles): nothing is packed per call, and
// each block is one forward stream (two 16-column panels interleaved a k, or a pair of k, at a time).
struct F32Panels {};  // the weight type of a packed float32 job (its pointer is the panels' floats)

// Wide tiles (kWideRows above): on AVX2, more rows take each 16-column panel in turn, which requests the next block
// as it goes (float32 at 4 rows streams at 15-19 GB/s that way, at 14 as two wide tiles).

// A wide tile's accumulators (kSets sets, summed, of R rows by four 8-column vectors) stored as its rows.
template <int64_t kSets, int64_t R>
inline void StoreWideTile(const __m256 (&acc)[kSets][R][4], float tile[][2 * kPanel]) {
#pragma GCC unroll 2
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) {
      __m256 sum = acc[0][r][v];
      if constexpr (kSets == 2) sum = _mm256_add_ps(sum, acc[1][r][v]);
      _mm256_storeu_ps(tile[r] + 8 * v, sum);
    }
  }
}

// Every row of x, kWideRows at a time, through a wide tile over one 32-column block: tile(rows, x, out) with rows
// a std::integral_constant of 1 or 2.
template <typename X, typename W, typename Tile>
void WideRows(const MatmulJob<X, W>& job, int64_t n_begin, int64_t cols, Tile tile_of) {
  static_assert(kWideRows == 2);
  float tile[kWideRows][2 * kPanel];
  for (int64_t m = 0; m < job.m_size; m += kWideRows) {
    const int64_t rows = std::min(kWideRows, job.m_size - m);
    const float* x = job.x + m * job.k_size;
    if (rows == 2) {
      tile_of(std::integral_constant<int64_t, 2>{}, x, tile);
    } else {
      tile_of(std::integral_constant<int64_t, 1>{}, x, tile);
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
  }
}

#ifdef __AVX512F__
template <int64_t R>
void PackedTile(const float* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
                float tile[][2 * kPanel]) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (R <= kWideRows) PrefetchAhead(panel_a + k * stride);
    const __m512 wa = _mm512_loadu_ps(panel_a + k * stride);
    const __m512 wb = _mm512_loadu_ps(panel_b + k * stride);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_size + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, wa, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, wb, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], acc[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, acc[r][1]);
  }
}

// The 1-12 row tiles of every row of x over one 32-column block of packed weight (its two 16-column panels at
// panel_a and panel_b, `stride` floats from one k to the next).
template <typename X, typename W>
void BlockTiles(const MatmulJob<X, W>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* /*next_begin*/ = nullptr, const char* /*next_end*/ = nullptr) {
  thread_local std::vector<X> x_tail;
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  constexpr int64_t kMaxRows = 12;
  float tile[kMaxRows][2 * kPanel];
  for (int64_t m = 0; m < job.m_size; m += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, job.m_size - m);
    const int64_t tile_rows = rows > 8 ? 12 : rows > 4 ? 8 : rows > 2 ? 4 : rows;  // at most 3 rows of padding
    const X* x = TileRows(job, m, tile_rows, x_tail);
    switch (tile_rows) {
      case 12: PackedTile<12>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 8: PackedTile<8>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 4: PackedTile<4>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 2: PackedTile<2>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      default: PackedTile<1>(x, job.k_size, panel_a, panel_b, stride, tile); break;
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
  }
}
#else
// AVX2 has 16 vector registers: a tile is R <= 2 rows of x by the whole 32-column block (four weight vectors a k),
// or up to 6 rows by one 16-column panel (PanelTile, 12 accumulators).

template <int64_t R>
void WideTile(const float* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
              float tile[][2 * kPanel]) {
  static_assert(R == 1 || R == 2);
  // One row gets two sets of accumulators (even and odd k), so the FMA latency cannot bound its loop.
  constexpr int64_t kSets = R == 1 ? 2 : 1;
  __m256 acc[kSets][R][4];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 4; ++i) acc[i / (R * 4)][i / 4 % R][i % 4] = _mm256_setzero_ps();
  int64_t k = 0;
  auto step = [&](int64_t set, int64_t kk) {
    PrefetchAhead(panel_a + kk * stride);
    const __m256 w0 = _mm256_loadu_ps(panel_a + kk * stride), w1 = _mm256_loadu_ps(panel_a + kk * stride + 8);
    const __m256 w2 = _mm256_loadu_ps(panel_b + kk * stride), w3 = _mm256_loadu_ps(panel_b + kk * stride + 8);
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k_size + kk);
      acc[set][r][0] = _mm256_fmadd_ps(xv, w0, acc[set][r][0]);
      acc[set][r][1] = _mm256_fmadd_ps(xv, w1, acc[set][r][1]);
      acc[set][r][2] = _mm256_fmadd_ps(xv, w2, acc[set][r][2]);
      acc[set][r][3] = _mm256_fmadd_ps(xv, w3, acc[set][r][3]);
    }
  };
  for (; k + kSets <= k_size; k += kSets) {
#pragma GCC unroll 2
    for (int64_t set = 0; set < kSets; ++set) step(set, k + set);
  }
  for (; k < k_size; ++k) step(0, k);
  StoreWideTile(acc, tile);
}

template <typename X, typename W>
void BlockTiles(const MatmulJob<X, W>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* next_begin, const char* next_end) {
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  if (job.m_size > kWideRows) {  // the next block's first half requested over panel a's tiles, its second over b's
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    PanelTiles(job, n_begin, std::min(kPanel, cols), panel_a, stride, next_begin, next_half);
    if (cols > kPanel) PanelTiles(job, n_begin + kPanel, cols - kPanel, panel_b, stride, next_half, next_end);
    return;
  }
  WideRows(job, n_begin, cols, [&](auto rows, const float* x, float tile[][2 * kPanel]) {
    WideTile<decltype(rows)::value>(x, job.k_size, panel_a, panel_b, stride, tile);
  });
}
#endif

#ifndef JSERVE_AVX512_BF16
// Packed bfloat16 weights without vdpbf16ps (AVX2, or AVX-512 without BF16), split by EvenHalves / OddHalves.

// One or two rows of x stream a 32-column block once, as WideTile does a float32 one (128 bytes a pair of k): one
// forward stream with the prefetch reads at ~90% of the memory's bandwidth, the bfloat16 row loop (DotRowsEvenOdd)
// at ~75-80%.

template <int64_t R>
void WidePairTile(const float* x, int64_t k_size, const float* block, float tile[][2 * kPanel]) {
  static_assert(R == 1 || R == 2);
  constexpr int64_t kSets = R == 1 ? 2 : 1;  // one row: even and odd k accumulate apart (the FMA latency)
  __m256 acc[kSets][R][4];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 4; ++i) acc[i / (R * 4)][i / 4 % R][i % 4] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const float* w = block + kp * 2 * kPanel;
    PrefetchAhead(w);
    __m256 x_even[R], x_odd[R];
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
      x_even[r] = _mm256_broadcast_ss(x + r * k_size + 2 * kp);
      x_odd[r] = _mm256_broadcast_ss(x + r * k_size + 2 * kp + 1);
    }
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * v));
      const __m256 even = EvenHalves(pairs), odd = OddHalves(pairs);
#pragma GCC unroll 2
      for (int64_t r = 0; r < R; ++r) {
        acc[0][r][v] = _mm256_fmadd_ps(x_even[r], even, acc[0][r][v]);
        acc[kSets - 1][r][v] = _mm256_fmadd_ps(x_odd[r], odd, acc[kSets - 1][r][v]);
      }
    }
  }
  StoreWideTile(acc, tile);
}

// One 16-column half of a packed bfloat16 block (`stride` uint32 from one pair of k to the next) widened to a
// float32 panel [K, 16], for the compute-bound tiles of many rows (each shift then runs once a call, not a tile).
void WidenPairPanel(const float* pairs, int64_t k_size, int64_t stride, float* panel) {
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + kp * stride + 8 * h));
      _mm256_storeu_ps(panel + 2 * kp * kPanel + 8 * h, EvenHalves(bits));
      _mm256_storeu_ps(panel + (2 * kp + 1) * kPanel + 8 * h, OddHalves(bits));
    }
  }
}

// Up to this many rows of x, the pair tiles run straight over the packed halves; more take each half widened to
// float32 first, where the six-row tiles no longer spend two broadcasts a row on each pair of k. Over a 135M model's
// matrices on an AVX2 EPYC the pair tiles take 19.2 ms at 3 rows (28.4 widened) and 46.5 at 8 (48.6); at 12 rows
// the two are level, and past that the widened panels are faster.
constexpr int64_t kPairTileRows = 8;

// The packed float32 layout's BlockTiles, for bfloat16 pairs: wide pair tiles for one or two rows of x, pair panel
// tiles up to kPairTileRows, else each half widened and run through the float32 panel tiles (each requesting the
// next block meanwhile).
void BlockTiles(const MatmulJob<float, uint32_t>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* next_begin, const char* next_end) {
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  if (job.m_size > kWideRows && job.m_size <= kPairTileRows) {
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    PanelTiles<true>(job, n_begin, std::min(kPanel, cols), panel_a, stride, next_begin, next_half);
    if (cols > kPanel) PanelTiles<true>(job, n_begin + kPanel, cols - kPanel, panel_b, stride, next_half, next_end);
    return;
  }
  if (job.m_size > kWideRows) {
    thread_local std::vector<float> panel;
    panel.resize(static_cast<size_t>(kPanel * job.k_size));
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    WidenPairPanel(panel_a, job.k_size, stride, panel.data());
    PanelTiles(job, n_begin, std::min(kPanel, cols), panel.data(), kPanel, next_begin, next_half);
    if (cols > kPanel) {
      WidenPairPanel(panel_b, job.k_size, stride, panel.data());
      PanelTiles(job, n_begin + kPanel, cols - kPanel, panel.data(), kPanel, next_half, next_end);
    }
    return;
  }
  WideRows(job, n_begin, cols, [&](auto rows, const float* x, float tile[][2 * kPanel]) {
    WidePairTile<decltype(rows)::value>(x, job.k_size, panel_a, tile);
  });
}
#endif

// A packed panel's length in 4-byte units: bfloat16 pairs (uint32) or float32.
template <typename W>
constexpr int64_t PanelLength(int64_t k_size) {
  return std::is_same_v<W, uint32_t> ? k_size / 2 * kPanel : k_size * kPanel;
}

}  // namespace
