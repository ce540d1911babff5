#pragma once

// int8 weights times int8 activations (vpdpbusd, AVX512-VNNI) for the compute-bound matmuls of many rows.
//
// A step of more than a few rows is bound by multiplies, not by bytes: bfloat16 weights feed vdpbf16ps (32 products
// an instruction), while vpdpbusd multiplies 64 byte pairs an instruction. So there x is quantized too, as
// llama.cpp's CPU matmuls quantize it for their Q8_0 weights: each row in blocks of 32 values, one float32 scale a
// block (scale = max|block| / 127, values rounded to nearest). A scale per row would cover outlier channels with the
// whole row's range: on SmolLM2-135M that raises perplexity 3.3% over bfloat16, blocks of 64 0.8%, of 32 0.3%.
// Each 32-value block's integer dot products are exact in int32 and then multiply its scale into a float32 sum; the
// weight's per-row scale multiplies the result once (EmitRow), as on the other int8 paths.
//
// vpdpbusd multiplies unsigned by signed bytes: x goes in as q + 128 (1 .. 255), so every block's sums carry
// 128 * sum(w) over that block's 32 k for each column, which the accumulators start at minus. The packed layout
// holds a block's 32 columns k-major (32 bytes a k); vpdpbusd takes each column's 4 consecutive k in one 32-bit
// lane, so each call rearranges a weight block (one L1-sized copy, int8: no widening) into k-quads and computes its
// compensation, once for all of that call's rows.

#include "matmul_packed.h"

namespace {

#ifdef JSERVE_AVX512_VNNI
constexpr int64_t kQuantBlock = 32;  // x values a scale covers; K must be a multiple (else the float path runs)
constexpr int64_t kVnniTileRows = 6;  // 12 int32 + 12 float32 accumulators + 2 weights + broadcasts: 32 registers

// x [values / K, K] quantized in blocks of kQuantBlock: `quants` the values + 128, `scales` one a block.
inline void QuantizeBlocks(const float* x, int64_t values, uint8_t* quants, float* scales) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < values; i += kQuantBlock) {
    const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float scale = amax / 127.0f;
    const __m512 inverse = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    const __m512i qlo = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)), offset);
    const __m512i qhi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(quants + i), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(quants + i + 16), _mm512_cvtepi32_epi8(qhi));
    scales[i / kQuantBlock] = scale;
  }
}

// One packed int8 block (k-major, 32 bytes a k) as k-quads [K / 4, 32, 4] (column j's w[k .. k + 3] in one 32-bit
// lane; columns 0-15 in the first 64 bytes of a quad, 16-31 in the next), and `compensation` [K / 32, 32]: minus
// 128 times each column's sum over each 32 k.
inline void QuadBlock(const int8_t* block, int64_t k_size, int8_t* quads, int32_t* compensation) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
#ifdef __AVX512VBMI__
  // One vpermt2b a 64-byte output from the 128 bytes of 4 k: byte 4 j + i of the first is column j's k + i, from
  // the first (k, k + 1) or second (k + 2, k + 3) 64-byte load; the second output is columns 16-31.
  alignas(64) uint8_t index_bytes[2][64];
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 16; ++j) {
      for (int i = 0; i < 4; ++i) index_bytes[h][4 * j + i] = static_cast<uint8_t>((i / 2) * 64 + (i % 2) * 32 + 16 * h + j);
    }
  }
  const __m512i index_a = _mm512_load_si512(index_bytes[0]), index_b = _mm512_load_si512(index_bytes[1]);
#endif
  for (int64_t kb = 0; kb < k_size; kb += kQuantBlock) {
    __m512i sum_a = _mm512_setzero_si512(), sum_b = sum_a;
    for (int64_t k = kb; k < kb + kQuantBlock; k += 4) {
      const int8_t* w = block + k * 2 * kPanel;
#ifdef __AVX512VBMI__
      const __m512i k01 = _mm512_loadu_si512(w), k23 = _mm512_loadu_si512(w + 4 * kPanel);
      const __m512i a = _mm512_permutex2var_epi8(k01, index_a, k23);
      const __m512i b = _mm512_permutex2var_epi8(k01, index_b, k23);
#else
      auto load = [&](int64_t i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * 2 * kPanel)); };
      const __m256i k0 = load(0), k1 = load(1), k2 = load(2), k3 = load(3);
      // Bytes interleaved within each 128-bit lane: columns 0-7 and 16-23 (lo), 8-15 and 24-31 (hi).
      const __m256i t01lo = _mm256_unpacklo_epi8(k0, k1), t01hi = _mm256_unpackhi_epi8(k0, k1);
      const __m256i t23lo = _mm256_unpacklo_epi8(k2, k3), t23hi = _mm256_unpackhi_epi8(k2, k3);
      const __m256i q0 = _mm256_unpacklo_epi16(t01lo, t23lo), q1 = _mm256_unpackhi_epi16(t01lo, t23lo);
      const __m256i q2 = _mm256_unpacklo_epi16(t01hi, t23hi), q3 = _mm256_unpackhi_epi16(t01hi, t23hi);
      // q0: columns 0-3 | 16-19, q1: 4-7 | 20-23, q2: 8-11 | 24-27, q3: 12-15 | 28-31.
      const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(q0, q1, 0x20)),
                                           _mm256_permute2x128_si256(q2, q3, 0x20), 1);
      const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(q0, q1, 0x31)),
                                           _mm256_permute2x128_si256(q2, q3, 0x31), 1);
#endif
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
