#pragma once

// int8 weights times int8 activations (vpdpbusd, AVX512-VNNI), at every row count.
//
// A step of many rows is bound by multiplies, not by bytes: bfloat16 weights feed vdpbf16ps (32 products an
// instruction), while vpdpbusd multiplies 64 byte pairs an instruction. A decode step is bound by the weight stream,
// and there widening each int8 weight to float before its FMA (three instructions for 16 weights) cannot keep up
// with the memory, while one vpdpbusd takes 64. So x is quantized too, as llama.cpp's CPU matmuls quantize it for
// their Q8_0 weights: each row in blocks of 32 values, one float32 scale a block (scale = max|block| / 127, values
// rounded to nearest). A scale per row would cover outlier channels with the whole row's range: on SmolLM2-135M
// that raises perplexity 3.3% over bfloat16, blocks of 64 0.8%, of 32 0.3%. Each 32-value block's integer dot
// products are exact in int32 and then multiply its scale into a float32 sum; the weight's per-row scale multiplies
// the result once (EmitRow), as on the other int8 paths.
//
// The packed layout holds a block's 32 columns k-major (32 bytes a k); vpdpbusd takes each column's 4 consecutive
// k in one 32-bit lane (a k-quad), and multiplies unsigned by signed bytes. Many rows (VnniTile): each call
// rearranges a weight block (one L1-sized copy, int8: no widening) into k-quads once for all its rows, x goes in as
// q + 128 (1 .. 255), and every block's sums carry 128 * sum(w) over its 32 k for each column, which the
// accumulators start at minus (computed with the copy). Decode rows (VnniRowTile) read each weight once: the
// k-quads are made in registers, and the weights are the unsigned operand (w + 128, their sign bits flipped), so the
// sums carry 128 * sum(q) instead: one number a row and block, made with x's quantization.

#include "matmul_packed.h"

namespace {

#ifdef JSERVE_AVX512_VNNI
constexpr int64_t kQuantBlock = 32;  // x values a scale covers; K must be a multiple (else the float path runs)
constexpr int64_t kVnniTileRows = 6;  // 12 int32 + 12 float32 accumulators + 2 weights + broadcasts: 32 registers

// x [values / K, K] quantized in blocks of kQuantBlock, one scale a block (`scales`), the values q + `offset` into
// `quants`: 128 for the many-row tiles' unsigned operand, 0 for the decode rows' signed one, which also take each
// block's sum of q (`sums`, where not nullptr).
inline void QuantizeBlocks(const float* x, int64_t values, int32_t offset, uint8_t* quants, float* scales,
                           int32_t* sums) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i offsets = _mm512_set1_epi32(offset);
  for (int64_t i = 0; i < values; i += kQuantBlock) {
    const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(quants + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(qlo, offsets)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(quants + i + 16),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(qhi, offsets)));
    scales[i / kQuantBlock] = scale;
    if (sums != nullptr) sums[i / kQuantBlock] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

#ifdef __AVX512VBMI__
// QuadLoader's vpermt2b indices: byte 4 j + i of output h is column 16 h + j's k + i, from the first (k, k + 1) or
// second (k + 2, k + 3) 64-byte load.
struct QuadIndices {
  alignas(64) uint8_t bytes[2][64];
};
constexpr QuadIndices MakeQuadIndices() {
  QuadIndices out{};
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 16; ++j) {
      for (int i = 0; i < 4; ++i) {
        out.bytes[h][4 * j + i] = static_cast<uint8_t>((i / 2) * 64 + (i % 2) * 32 + 16 * h + j);
      }
    }
  }
  return out;
}
constexpr QuadIndices kQuadIndices = MakeQuadIndices();
#endif

// Four k of a packed int8 block (k-major, 32 bytes a k: 128 bytes at `w`) as two k-quad vectors: column j's
// w[k .. k + 3] in one 32-bit lane, columns 0-15 in `a`, 16-31 in `b`.
struct QuadLoader {
#ifdef __AVX512VBMI__
  // One vpermt2b an output from the two 64-byte loads (kQuadIndices).
  __m512i index_a, index_b;
  QuadLoader() {
    index_a = _mm512_load_si512(kQuadIndices.bytes[0]), index_b = _mm512_load_si512(kQuadIndices.bytes[1]);
    // Opaque to the compiler, as are Load's weights: each vpermt2b overwrites one of its operands, and GCC would
    // rather load a constant or the weights again than copy a register, while loads are what bound the loop.
    asm("" : "+v"(index_a), "+v"(index_b));
  }
  inline void Load(const int8_t* w, __m512i& a, __m512i& b) const {
    __m512i k01 = _mm512_loadu_si512(w), k23 = _mm512_loadu_si512(w + 4 * kPanel);
    asm("" : "+v"(k01), "+v"(k23));  // opaque: see the constructor
    a = _mm512_permutex2var_epi8(k01, index_a, k23);
    b = _mm512_permutex2var_epi8(k01, index_b, k23);
  }
#else
  inline void Load(const int8_t* w, __m512i& a, __m512i& b) const {
    auto load = [&](int64_t i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * 2 * kPanel)); };
    const __m256i k0 = load(0), k1 = load(1), k2 = load(2), k3 = load(3);
    // Bytes interleaved within each 128-bit lane: columns 0-7 and 16-23 (lo), 8-15 and 24-31 (hi).
    const __m256i t01lo = _mm256_unpacklo_epi8(k0, k1), t01hi = _mm256_unpackhi_epi8(k0, k1);
    const __m256i t23lo = _mm256_unpacklo_epi8(k2, k3), t23hi = _mm256_unpackhi_epi8(k2, k3);
    const __m256i q0 = _mm256_unpacklo_epi16(t01lo, t23lo), q1 = _mm256_unpackhi_epi16(t01lo, t23lo);
    const __m256i q2 = _mm256_unpacklo_epi16(t01hi, t23hi), q3 = _mm256_unpackhi_epi16(t01hi, t23hi);
    // q0: columns 0-3 | 16-19, q1: 4-7 | 20-23, q2: 8-11 | 24-27, q3: 12-15 | 28-31.
    a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(q0, q1, 0x20)),
                           _mm256_permute2x128_si256(q2, q3, 0x20), 1);
    b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(q0, q1, 0x31)),
                           _mm256_permute2x128_si256(q2, q3, 0x31), 1);
  }
#endif
};

// One packed int8 block as k-quads [K / 4, 32, 4] (QuadLoader's two vectors a quad), and `compensation`
// [K / 32, 32]: minus 128 times each column's sum over each 32 k.
inline void QuadBlock(const int8_t* block, int64_t k_size, int8_t* quads, int32_t* compensation) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  const QuadLoader loader;
  for (int64_t kb = 0; kb < k_size; kb += kQuantBlock) {
    __m512i sum_a = _mm512_setzero_si512(), sum_b = sum_a;
    for (int64_t k = kb; k < kb + kQuantBlock; k += 4) {
      __m512i a, b;
      loader.Load(block + k * 2 * kPanel, a, b);
      _mm512_storeu_si512(quads + k * 2 * kPanel, a);
      _mm512_storeu_si512(quads + k * 2 * kPanel + 4 * kPanel, b);
      sum_a = _mm512_dpbusd_epi32(sum_a, bias, a);
      sum_b = _mm512_dpbusd_epi32(sum_b, bias, b);
    }
    int32_t* out = compensation + kb / kQuantBlock * 2 * kPanel;
    _mm512_storeu_si512(out, _mm512_sub_epi32(_mm512_setzero_si512(), sum_a));
    _mm512_storeu_si512(out + kPanel, _mm512_sub_epi32(_mm512_setzero_si512(), sum_b));
  }
}

// R <= 4 rows of x (decode), quantized signed (`quants` q, `sums` each block's sum of q), streamed once through
// one packed block (the weights read from memory once: no copy): each 128 bytes become k-quads in registers, and
// flipping their sign bits makes them the unsigned operand (w + 128), so each block's sums carry 128 times the sum of
// that row's q there, which its accumulators start at minus. One vpdpbusd multiplies 64 weights where the float
// path widens and multiplies 16 (three instructions), so the loop keeps up with the memory. One row accumulates
// even and odd quads apart (the vpdpbusd latency). The tile holds the unscaled sums, as Int8RowTile's.
// No software prefetch: the hardware's alone streams this loop faster. On a Zen 4, batch-1 decode of SmolLM2-135M
// (medians of paired rounds in one process) ran at 278 tokens/s where the memory read ~60 GB/s and 220 at ~35
// against 262 and 210 with PrefetchAhead's requests (512 bytes ahead, non-temporal), 266 and 220 with requests
// into L2 2 KiB ahead.
template <int64_t R>
void VnniRowTile(const int8_t* quants, const float* scales, const int32_t* sums, int64_t k_size,
                 const int8_t* block, float tile[][2 * kPanel]) {
  static_assert(R >= 1 && R <= 4);
  constexpr int64_t kSets = R == 1 ? 2 : 1;
  const int64_t blocks = k_size / kQuantBlock;
  const QuadLoader loader;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 out[R][2];
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) out[r][0] = out[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    __m512i acc[kSets][R][2];
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      acc[0][r][0] = acc[0][r][1] = _mm512_set1_epi32(-128 * sums[r * blocks + kb]);
      if constexpr (kSets == 2) acc[1][r][0] = acc[1][r][1] = _mm512_setzero_si512();
    }
    const int8_t* w = block + kb * kQuantBlock * 2 * kPanel;
    const int8_t* xq = quants + kb * kQuantBlock;
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuantBlock / 4; ++q) {
      __m512i a, b;
      loader.Load(w + q * 8 * kPanel, a, b);
      a = _mm512_xor_si512(a, flip), b = _mm512_xor_si512(b, flip);
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k_size + 4 * q, sizeof(four));
        const __m512i xv = _mm512_set1_epi32(four);
        acc[q % kSets][r][0] = _mm512_dpbusd_epi32(acc[q % kSets][r][0], a, xv);
        acc[q % kSets][r][1] = _mm512_dpbusd_epi32(acc[q % kSets][r][1], b, xv);
      }
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(scales[r * blocks + kb]);
#pragma GCC unroll 2
      for (int64_t h = 0; h < 2; ++h) {
        __m512i total = acc[0][r][h];
        if constexpr (kSets == 2) total = _mm512_add_epi32(total, acc[1][r][h]);
        out[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, out[r][h]);
      }
    }
  }
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], out[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, out[r][1]);
  }
}

// R <= 6 rows of quantized x times one block's k-quads into an R x 32 tile (unscaled by the weight): per 32 k, the
// int32 accumulators start at the compensation, take 8 quads (2 weight vectors, R broadcasts of 4 bytes, 2R
// vpdpbusd), then convert and multiply-add into float32 sums with that block's scale of each row.
template <int64_t R>
void VnniTile(const uint8_t* quants, const float* scales, int64_t k_size, const int8_t* quads,
              const int32_t* compensation, float tile[][2 * kPanel]) {
  static_assert(R >= 1 && R <= kVnniTileRows);
  const int64_t blocks = k_size / kQuantBlock;
  __m512 sums[R][2];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const __m512i start_a = _mm512_loadu_si512(compensation + kb * 2 * kPanel);
    const __m512i start_b = _mm512_loadu_si512(compensation + kb * 2 * kPanel + kPanel);
    __m512i acc[R][2];
#pragma GCC unroll 6
    for (int64_t r = 0; r < R; ++r) acc[r][0] = start_a, acc[r][1] = start_b;
    const int8_t* w = quads + kb * kQuantBlock * 2 * kPanel;
    const uint8_t* xq = quants + kb * kQuantBlock;
#pragma GCC unroll 8
    for (int64_t q = 0; q < kQuantBlock / 4; ++q) {
      const __m512i wa = _mm512_loadu_si512(w + q * 8 * kPanel), wb = _mm512_loadu_si512(w + q * 8 * kPanel + 4 * kPanel);
#pragma GCC unroll 6
      for (int64_t r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k_size + 4 * q, sizeof(four));
        const __m512i xv = _mm512_set1_epi32(four);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xv, wa);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xv, wb);
      }
    }
#pragma GCC unroll 6
    for (int64_t r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(scales[r * blocks + kb]);
      sums[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), scale, sums[r][0]);
      sums[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), scale, sums[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], sums[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, sums[r][1]);
  }
}

// Every row of the job's quantized x (`quants`, `scales`: QuantizeBlocks) times one int8 block, kVnniTileRows rows
// a tile, into y through EmitRow (`job` carries the block's weight scales).
template <typename W>
void VnniBlockTiles(const MatmulJob<float, W>& job, int64_t n_begin, const int8_t* block, const uint8_t* quants,
                    const float* scales) {
  const int64_t k_size = job.k_size, cols = std::min(2 * kPanel, job.n_size - n_begin);
  thread_local std::vector<int8_t> quads;
  thread_local std::vector<int32_t> compensation;
  quads.resize(static_cast<size_t>(2 * kPanel * k_size));
  compensation.resize(static_cast<size_t>(2 * kPanel * (k_size / kQuantBlock)));
  QuadBlock(block, k_size, quads.data(), compensation.data());
  const int64_t blocks = k_size / kQuantBlock;
  float tile[kVnniTileRows][2 * kPanel];
  // Tiles as even as whole rows allow (8 rows: 4 + 4, not 6 + 2: a tile of few rows loads its weights for few sums).
  const int64_t tiles = Blocks(job.m_size, kVnniTileRows);
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const uint8_t* xq = quants + m * k_size;
    const float* xs = scales + m * blocks;
    const int64_t rows = job.m_size / tiles + (t < job.m_size % tiles ? 1 : 0);
    switch (rows) {
      case 6: VnniTile<6>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
      case 5: VnniTile<5>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
      case 4: VnniTile<4>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
      case 3: VnniTile<3>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
      case 2: VnniTile<2>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
      default: VnniTile<1>(xq, xs, k_size, quads.data(), compensation.data(), tile); break;
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
    m += rows;
  }
}
#endif

}  // namespace
