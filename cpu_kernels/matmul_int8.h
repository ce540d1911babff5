#pragma once

// int8 weights (weight-only, per-output-row float32 scales: jserve.models.quantization) packed at load time, and
// their matmuls. Nothing weight-sized is ever converted to float. With AVX512-VNNI and K a multiple of 32, every
// row count multiplies int8 by x quantized in blocks of 32 (matmul_int8_vnni.h). Elsewhere up to 4 rows of x
// (decode) widen each weight in registers (sign-extend int8 -> int32 -> float: 16 a vector with AVX-512, 8 with
// AVX2) right before its FMA, and more rows (prefill, large decode batches: compute-bound) widen one block (AVX2: one
// 16-column half) at a time into an L1/L2-sized panel, unscaled, that every row of x then reads through the float
// tiles: float32, or bfloat16 pairs for vdpbf16ps where x holds bfloat16 values (an int8 is a bfloat16 exactly, so
// the products are the same). Every path's sums are unscaled: the row's scale multiplies each output once.
//
// Layout (cpu_kernels.pack_weight_int8): int8 [N_pad / 32, K + 4, 32], N padded to whole blocks of 32 rows; block b
// holds rows 32b .. 32b + 31 k-major (w[32b + j, k] at byte 32 k + j), then those rows' 32 float32 scales (the
// last 128 bytes, zero for padding rows). A block is one forward stream, its scales at its end, and it has a whole
// number of 4-byte units (8 (K + 4)), so the packed blocks' machinery (BlockAt, per-thread parts) takes it as is.

#include "matmul_int8_vnni.h"

namespace {

// The weight type of a packed int8 job. kRound: x holds bfloat16 values (a bfloat16 model: the XLA path's
// x.astype(compute_dtype)); else float32 ones. Either way x is float32 in memory, as the AVX2 tiles read it.
template <bool kRound>
struct Int8Blocks {};

template <typename W>
struct IsInt8Weight : std::false_type {};
template <bool kRound>
struct IsInt8Weight<Int8Blocks<kRound>> : std::true_type {};

// A packed int8 block's length in 4-byte units (its scales begin 32 K bytes from its start).
inline int64_t Int8BlockUnits(int64_t k_size) { return 8 * (k_size + 4); }

// Eight int8 weights (8 consecutive bytes) as eight floats: vpmovsxbd from memory, then vcvtdq2ps.
inline __m256 WidenInt8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// R <= 2 rows of x streamed once through one 32-column int8 block: per k, four 8-column vectors widened in
// registers and 4 R FMAs against the broadcast x. One row accumulates even and odd k apart (8 accumulators), so the
// FMA latency does not bound its loop. The tile holds the unscaled sums (Int8Block scales them as it emits them).
template <int64_t R>
void Int8WideTile(const float* x, int64_t k_size, const int8_t* block, float tile[][2 * kPanel]) {
  static_assert(R == 1 || R == 2);
  constexpr int64_t kSets = R == 1 ? 2 : 1;
  __m256 acc[kSets][R][4];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 4; ++i) acc[i / (R * 4)][i / 4 % R][i % 4] = _mm256_setzero_ps();
  auto step = [&](int64_t set, int64_t k) {
    const int8_t* w = block + k * 2 * kPanel;
    __m256 wv[4];
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) wv[v] = WidenInt8x8(w + 8 * v);
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k_size + k);
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) acc[set][r][v] = _mm256_fmadd_ps(xv, wv[v], acc[set][r][v]);
    }
  };
  int64_t k = 0;
  for (; k + 4 <= k_size; k += 4) {  // 128 bytes of weights: the two lines PrefetchAhead requests
    PrefetchAhead(block + k * 2 * kPanel);
    step(0, k);
    step(kSets - 1, k + 1);
    step(0, k + 2);
    step(kSets - 1, k + 3);
  }
  for (; k < k_size; ++k) step(0, k);
  StoreWideTile(acc, tile);
}

// One 16-column half of an int8 block widened to a float32 panel [K, 16] (the values, unscaled): L1/L2-sized,
// made once a call and read by every row of x.
void WidenInt8Panel(const int8_t* block, int64_t k_size, int64_t half, float* panel) {
  for (int64_t k = 0; k < k_size; ++k) {
    const int8_t* w = block + k * 2 * kPanel + half * kPanel;
    _mm256_storeu_ps(panel + k * kPanel, WidenInt8x8(w));
    _mm256_storeu_ps(panel + k * kPanel + 8, WidenInt8x8(w + 8));
  }
}

#ifdef __AVX512F__
// AVX-512: sixteen int8 weights (16 consecutive bytes) as sixteen floats.
inline __m512 WidenInt8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// R <= 4 rows of x streamed once through one block: per k, two 16-column vectors widened in registers and 2 R FMAs
// (one row: even and odd k apart, for the FMA latency); the tile holds the unscaled sums, as Int8WideTile's.
template <int64_t R>
void Int8RowTile(const float* x, int64_t k_size, const int8_t* block, float tile[][2 * kPanel]) {
  static_assert(R >= 1 && R <= 4);
  constexpr int64_t kSets = R == 1 ? 2 : 1;
  __m512 acc[kSets][R][2];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 2; ++i) acc[i / (R * 2)][i / 2 % R][i % 2] = _mm512_setzero_ps();
  auto step = [&](int64_t set, int64_t k) {
    const int8_t* w = block + k * 2 * kPanel;
    const __m512 w0 = WidenInt8x16(w), w1 = WidenInt8x16(w + kPanel);
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_size + k]);
      acc[set][r][0] = _mm512_fmadd_ps(xv, w0, acc[set][r][0]);
      acc[set][r][1] = _mm512_fmadd_ps(xv, w1, acc[set][r][1]);
    }
  };
  int64_t k = 0;
  for (; k + 4 <= k_size; k += 4) {  // 128 bytes of weights: the two lines PrefetchAhead requests
    PrefetchAhead(block + k * 2 * kPanel);
    step(0, k);
    step(kSets - 1, k + 1);
    step(0, k + 2);
    step(kSets - 1, k + 3);
  }
  for (; k < k_size; ++k) step(0, k);
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int64_t v = 0; v < 2; ++v) {
      __m512 sum = acc[0][r][v];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, acc[1][r][v]);
      _mm512_storeu_ps(tile[r] + kPanel * v, sum);
    }
  }
}

// A whole block widened to float32 [K, 32] (pack_weight's float32 block layout: its two panels interleaved).
void WidenInt8Block(const int8_t* block, int64_t k_size, float* panels) {
  for (int64_t k = 0; k < k_size; ++k) {
    _mm512_storeu_ps(panels + k * 2 * kPanel, WidenInt8x16(block + k * 2 * kPanel));
    _mm512_storeu_ps(panels + k * 2 * kPanel + kPanel, WidenInt8x16(block + k * 2 * kPanel + kPanel));
  }
}
#endif

#ifdef JSERVE_AVX512_BF16
// A whole block (K even) widened to bfloat16 pairs [K / 2, 32] (pack_weight's bfloat16 block layout, for
// vdpbf16ps): an int8 is a bfloat16 exactly, so each pair is the top halves of the two floats.
void WidenInt8PairBlock(const int8_t* block, int64_t k_size, float* pairs) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    for (int64_t h = 0; h < 2; ++h) {
      const int8_t* w = block + kp * 4 * kPanel + h * kPanel;
      const __m512i even = _mm512_castps_si512(WidenInt8x16(w));
      const __m512i odd = _mm512_castps_si512(WidenInt8x16(w + 2 * kPanel));
      _mm512_storeu_si512(pairs + kp * 2 * kPanel + h * kPanel,
                          _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_and_si512(odd, high)));
    }
  }
}
#endif

// Rows [m, m + rows) of x (rows <= kInt8StreamRows) streamed once through the block into `tile`, scaled.
#ifdef __AVX512F__
constexpr int64_t kInt8StreamRows = 4;
inline void Int8StreamTile(const float* x, int64_t rows, int64_t k_size, const int8_t* block,
                           float tile[][2 * kPanel]) {
  switch (rows) {
    case 4: Int8RowTile<4>(x, k_size, block, tile); break;
    case 3: Int8RowTile<3>(x, k_size, block, tile); break;
    case 2: Int8RowTile<2>(x, k_size, block, tile); break;
    default: Int8RowTile<1>(x, k_size, block, tile); break;
  }
}
#else
constexpr int64_t kInt8StreamRows = kWideRows;
inline void Int8StreamTile(const float* x, int64_t rows, int64_t k_size, const int8_t* block,
                           float tile[][2 * kPanel]) {
  if (rows == 2) {
    Int8WideTile<2>(x, k_size, block, tile);
  } else {
    Int8WideTile<1>(x, k_size, block, tile);
  }
}
#endif

// Up to this many rows of x stream each block (kInt8StreamRows at a time: the block stays in L1/L2 between them);
// more run the compute-bound tiles. With AVX512-VNNI and K a multiple of 32 both take x quantized in blocks of 32
// (matmul_int8_vnni.h: VnniRowTile, VnniTile); else the streamed rows widen the weights in registers and the tiles
// read the block widened once into an L1/L2-sized float panel, amortised over the rows.
constexpr int64_t kInt8StreamedRows = 4;

// The job's x as the tiles take it, made once a thread and phase run (RowBlocks): quantized for vpdpbusd
// (matmul_int8_vnni.h), or bfloat16 bits for the many-row vdpbf16ps tiles; all nullptr: float32 x as it is.
struct Int8Inputs {
  const uint16_t* bits = nullptr;
  const uint8_t* quants = nullptr;  // q + 128 for the many-row tiles, q (int8) for the streamed rows
  const float* quant_scales = nullptr;
  const int32_t* quant_sums = nullptr;  // the streamed rows' sum of q over each block
};

#ifdef JSERVE_AVX512_VNNI
// Rows [m, m + rows) of quantized x (rows <= kInt8StreamRows) streamed once through the block into `tile`.
inline void VnniStreamTile(const Int8Inputs& inputs, int64_t m, int64_t rows, int64_t k_size, const int8_t* block,
                           float tile[][2 * kPanel]) {
  const int8_t* quants = reinterpret_cast<const int8_t*>(inputs.quants) + m * k_size;
  const int64_t blocks = k_size / kQuantBlock;
  const float* scales = inputs.quant_scales + m * blocks;
  const int32_t* sums = inputs.quant_sums + m * blocks;
  switch (rows) {
    case 4: VnniRowTile<4>(quants, scales, sums, k_size, block, tile); break;
    case 3: VnniRowTile<3>(quants, scales, sums, k_size, block, tile); break;
    case 2: VnniRowTile<2>(quants, scales, sums, k_size, block, tile); break;
    default: VnniRowTile<1>(quants, scales, sums, k_size, block, tile); break;
  }
}
#endif

// Every row of x times one int8 block (columns n_begin .. n_begin + 31), into job.y through EmitRow (bias,
// residual); on AVX2, the next block's lines [next_begin, next_end) are requested over the tiles.
template <bool kRound>
void Int8Block(const MatmulJob<float, Int8Blocks<kRound>>& job, int64_t n_begin, const int8_t* block,
               const Int8Inputs& inputs, const char* next_begin, const char* next_end) {
  const int64_t k_size = job.k_size, cols = std::min(2 * kPanel, job.n_size - n_begin);
  // Every path's sums reach y unscaled through EmitRow, which multiplies each by its column's scale before the bias
  // (MatmulJob::scale).
  const float* scales = reinterpret_cast<const float*>(block + k_size * 2 * kPanel);
  MatmulJob<float, Int8Blocks<kRound>> scaled = job;
  scaled.scale = scales, scaled.scale_begin = n_begin;
  if (job.m_size <= kInt8StreamedRows) {
    float tile[kInt8StreamRows][2 * kPanel];
    for (int64_t m = 0; m < job.m_size; m += kInt8StreamRows) {
      const int64_t rows = std::min(kInt8StreamRows, job.m_size - m);
#ifdef JSERVE_AVX512_VNNI
      if (inputs.quants != nullptr) {
        VnniStreamTile(inputs, m, rows, k_size, block, tile);
      } else {
        Int8StreamTile(job.x + m * k_size, rows, k_size, block, tile);
      }
#else
      Int8StreamTile(job.x + m * k_size, rows, k_size, block, tile);
#endif
      for (int64_t r = 0; r < rows; ++r) EmitRow(scaled, m + r, n_begin, tile[r], cols);
    }
    return;
  }
#ifdef JSERVE_AVX512_VNNI
  if (inputs.quants != nullptr) {
    VnniBlockTiles(scaled, n_begin, block, inputs.quants, inputs.quant_scales);
    return;
  }
#endif
  const uint16_t* x_bits = inputs.bits;
  thread_local std::vector<float> panel;
  const int64_t m_size = job.m_size, n_size = job.n_size;
#ifdef __AVX512F__
  (void)next_begin, (void)next_end;
  panel.resize(static_cast<size_t>(2 * kPanel * k_size));
#ifdef JSERVE_AVX512_BF16
  if (x_bits != nullptr) {
    WidenInt8PairBlock(block, k_size, panel.data());
    const MatmulJob<uint16_t, uint32_t> pairs{x_bits, nullptr, job.y, job.bias, job.accumulate, m_size, n_size,
                                              k_size, nullptr, scales, n_begin};
    BlockTiles(pairs, n_begin, panel.data(), panel.data() + kPanel, 2 * kPanel);
    return;
  }
#endif
  (void)x_bits;
  WidenInt8Block(block, k_size, panel.data());
  const MatmulJob<float, float> floats{job.x, nullptr, job.y, job.bias, job.accumulate, m_size, n_size, k_size,
                                       nullptr, scales, n_begin};
  BlockTiles(floats, n_begin, panel.data(), panel.data() + kPanel, 2 * kPanel);
#else
  (void)x_bits;
  panel.resize(static_cast<size_t>(kPanel * k_size));
  const MatmulJob<float, float> floats{job.x, nullptr, job.y, job.bias, job.accumulate, m_size, n_size, k_size,
                                       nullptr, scales, n_begin};
  const char* next_half = next_begin + (next_end - next_begin) / 2;
  for (int64_t half = 0; half < 2 && half * kPanel < cols; ++half) {
    WidenInt8Panel(block, k_size, half, panel.data());
    PanelTiles(floats, n_begin + half * kPanel, std::min(kPanel, cols - half * kPanel), panel.data(), kPanel,
               half == 0 ? next_begin : next_half, half == 0 ? next_half : next_end);
  }
#endif
}

// Blocks [b0, b1) of a packed int8 weight, for every row count (PackedPhase's RowBlocks: always true). With
// AVX512-VNNI and K a multiple of 32, x is quantized here once a thread and phase run; else, where x holds bfloat16
// values, K is even and the CPU has vdpbf16ps, the many-row tiles take x as bfloat16 bits (made once here).
template <bool kRound>
bool RowBlocks(const MatmulJob<float, Int8Blocks<kRound>>& job, int64_t b0, int64_t b1) {
  const int64_t length = Int8BlockUnits(job.k_size);
  const bool streamed = job.m_size <= kInt8StreamedRows;
  Int8Inputs inputs;
#ifdef JSERVE_AVX512_VNNI
  thread_local std::vector<uint8_t> quants;
  thread_local std::vector<float> quant_scales;
  thread_local std::vector<int32_t> quant_sums;
  thread_local uint64_t quantized_run = 0;  // the phase run whose x `quants` holds (its other items reuse it)
  if (job.k_size % kQuantBlock == 0) {
    const uint64_t run = CurrentPhaseRun();
    if (run == 0 || run != quantized_run) {
      const int64_t values = job.m_size * job.k_size;
      quants.resize(static_cast<size_t>(values));
      quant_scales.resize(static_cast<size_t>(values / kQuantBlock));
      if (streamed) quant_sums.resize(static_cast<size_t>(values / kQuantBlock));
      QuantizeBlocks(job.x, values, streamed ? 0 : 128, quants.data(), quant_scales.data(),
                     streamed ? quant_sums.data() : nullptr);
      quantized_run = run;
    }
    inputs.quants = quants.data(), inputs.quant_scales = quant_scales.data();
    inputs.quant_sums = streamed ? quant_sums.data() : nullptr;
  }
#endif
#ifdef JSERVE_AVX512_BF16
  thread_local std::vector<uint16_t> bits;
  if (kRound && !streamed && job.k_size % 2 == 0 && inputs.quants == nullptr) {
    bits.resize(static_cast<size_t>(job.m_size * job.k_size));
    StoreRow(bits.data(), job.x, job.m_size * job.k_size);  // exact: the values are bfloat16 already
    inputs.bits = bits.data();
  }
#endif
  for (int64_t b = b0; b < b1; ++b) {
    const char* block = reinterpret_cast<const char*>(BlockAt(job, b, length));
    const char* next = streamed || b + 1 >= b1 ? block : reinterpret_cast<const char*>(BlockAt(job, b + 1, length));
    const char* next_end = next == block ? next : next + 4 * length;
    Int8Block(job, b * 2 * kPanel, reinterpret_cast<const int8_t*>(block), inputs, next, next_end);
  }
  return true;
}

template <bool kRound>
Phase MatmulPhase(const MatmulJob<float, Int8Blocks<kRound>>& job, int64_t threads) {
  return PackedPhase(job, threads);
}

}  // namespace
