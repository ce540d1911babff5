#pragma once

// Weights packed at load time: decode row blocks, the Intel widened path, and the matmul phases.

#include "matmul_blocks.h"
#include "matmul_rows.h"

namespace {

// Where block `pair` (`length` 4-byte units) of a packed weight lies.
template <typename X, typename W>
inline const float* BlockAt(const MatmulJob<X, W>& job, int64_t pair, int64_t length) {
  if (job.parts == nullptr) return reinterpret_cast<const float*>(job.w) + pair * length;
  const BlockParts& parts = *job.parts;
  size_t p = 0;
  while (pair >= parts.begin[p + 1]) ++p;  // a few parts
  return parts.base[p] + parts.offset + (pair - parts.begin[p]) * length;
}

// Block `pair` of the packed weight; with `prefetch_next`, requesting block pair + 1 while at it (see LinePrefetch).
template <typename X, typename W>
void MatmulPacked(const MatmulJob<X, W>& job, int64_t pair, bool prefetch_next) {
  const int64_t length = 2 * PanelLength<W>(job.k_size);  // 4-byte units a block
  const float* block = BlockAt(job, pair, length);
  const char* next = reinterpret_cast<const char*>(prefetch_next ? BlockAt(job, pair + 1, length) : block + length);
  BlockTiles(job, pair * 2 * kPanel, block, block + kPanel, 2 * kPanel,  // 32 columns a k, interleaved
             next, prefetch_next ? next + length * 4 : next);
}

// A few rows of x (decode batches of 1-4) against packed blocks [b0, b1), each block's 32 sums a row kept in
// registers and stored straight into y; false where this CPU and weight type have no such loop, or for more rows
// (the tiles run instead). The same products in the same order as the tiles, so the same bits, without a block's
// tile setup, store and emit, and with both halves of a k loaded from one pointer (10 uops a pair of k in the
// one-row loop, not 12). That makes batch-1 decode 1.06x as fast in bfloat16 (1.08x where the memory reads
// ~65 GB/s) and 1.03x in float32. Unrolling by two gains nothing; the prefetches are
// needed (without them the loop is 11% slower at ~65 GB/s).
template <typename X, typename W>
bool RowBlocks(const MatmulJob<X, W>&, int64_t, int64_t) {
  return false;
}

#ifdef __AVX512F__
// R rows' sums of a block (columns n .. n + 31) into y, as EmitRow would store them.
template <int64_t R, typename X, typename W>
inline void EmitBlock(const MatmulJob<X, W>& job, int64_t n, __m512 (&low)[R], __m512 (&high)[R]) {
  for (int64_t r = 0; r < R; ++r) {
    if (n + 2 * kPanel > job.n_size) {  // the last block's padding columns are dropped
      float tile[2 * kPanel];
      _mm512_storeu_ps(tile, low[r]);
      _mm512_storeu_ps(tile + kPanel, high[r]);
      EmitRow(job, r, n, tile, job.n_size - n);
      continue;
    }
    float* out = job.y + r * job.n_size + n;
    if (job.bias != nullptr) {
      low[r] = _mm512_add_ps(low[r], _mm512_loadu_ps(job.bias + n));
      high[r] = _mm512_add_ps(high[r], _mm512_loadu_ps(job.bias + n + kPanel));
    }
    if (job.accumulate) {
      low[r] = _mm512_add_ps(_mm512_loadu_ps(out), low[r]);
      high[r] = _mm512_add_ps(_mm512_loadu_ps(out + kPanel), high[r]);
    }
    _mm512_storeu_ps(out, low[r]);
    _mm512_storeu_ps(out + kPanel, high[r]);
  }
}

// kBlocks blocks from b on, side by side: `step(w, k, low, high)` adds k's (or pair k's) products, its weights at w.
template <int64_t kBlocks, int64_t R, typename X, typename W, typename Step>
inline void RowBlockSet(const MatmulJob<X, W>& job, int64_t b, int64_t length, int64_t steps, Step step) {
  const float* block[kBlocks];
  __m512 low[kBlocks][R], high[kBlocks][R];
#pragma GCC unroll 2
  for (int64_t i = 0; i < kBlocks; ++i) {
    block[i] = BlockAt(job, b + i, length);
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) low[i][r] = high[i][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < steps; ++k) {
#pragma GCC unroll 2
    for (int64_t i = 0; i < kBlocks; ++i) {
      const float* w = block[i] + k * 2 * kPanel;
      PrefetchAhead(w);
      step(w, k, low[i], high[i]);
    }
  }
#pragma GCC unroll 2
  for (int64_t i = 0; i < kBlocks; ++i) EmitBlock<R>(job, (b + i) * 2 * kPanel, low[i], high[i]);
}

// On Intel one row of bfloat16 runs two blocks side by side: there vdpbf16ps takes ~8 cycles on its accumulator
// chain, and one block's two chains catch up too slowly after a stall in the stream (a simulated stream over 75
// layers from memory: 0.97-1.0 of the prefetched plain read with two blocks, 0.96-0.98 with one; batch-1 decode
// 1.04x as fast on the 135M model, 1.03x on a 75-layer one). Each column's sum keeps its order, so the bits are the
// same.
template <int64_t R, typename W>
constexpr int64_t kSideBySideBlocks =
#ifdef JSERVE_INTEL
    R == 1 && std::is_same_v<W, uint32_t> ? 2 : 1;
#else
    1;
#endif

// RowBlocks for R rows: `step(w, k, low, high)` adds k's (or pair k's) products, its weights at w.
template <int64_t R, typename X, typename W, typename Step>
void RowBlocksOf(const MatmulJob<X, W>& job, int64_t b0, int64_t b1, int64_t steps, Step step) {
  const int64_t length = 2 * PanelLength<W>(job.k_size);
  constexpr int64_t kBlocks = kSideBySideBlocks<R, W>;
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks) RowBlockSet<kBlocks, R>(job, b, length, steps, step);
  for (; b < b1; ++b) RowBlockSet<1, R>(job, b, length, steps, step);
}

// Calls body(std::integral_constant<int64_t, R>) for R = m_size; false past 4 rows (8 accumulators).
template <typename Body>
bool WithRowCount(int64_t m_size, Body body) {
  switch (m_size) {
    case 1: body(std::integral_constant<int64_t, 1>{}); return true;
    case 2: body(std::integral_constant<int64_t, 2>{}); return true;
    case 3: body(std::integral_constant<int64_t, 3>{}); return true;
    case 4: body(std::integral_constant<int64_t, 4>{}); return true;
    default: return false;
  }
}

template <>
bool RowBlocks(const MatmulJob<float, F32Panels>& job, int64_t b0, int64_t b1) {
  return WithRowCount(job.m_size, [&](auto rows) {
    constexpr int64_t R = decltype(rows)::value;
    RowBlocksOf<R>(job, b0, b1, job.k_size, [&](const float* w, int64_t k, __m512 (&low)[R], __m512 (&high)[R]) {
      const __m512 wa = _mm512_loadu_ps(w), wb = _mm512_loadu_ps(w + kPanel);
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(job.x[r * job.k_size + k]);
        low[r] = _mm512_fmadd_ps(xv, wa, low[r]);
        high[r] = _mm512_fmadd_ps(xv, wb, high[r]);
      }
    });
  });
}
#endif

#ifdef JSERVE_AVX512_BF16
template <>
bool RowBlocks(const MatmulJob<uint16_t, uint32_t>& job, int64_t b0, int64_t b1) {
  return WithRowCount(job.m_size, [&](auto rows) {
    constexpr int64_t R = decltype(rows)::value;
    RowBlocksOf<R>(job, b0, b1, job.k_size / 2, [&](const float* w, int64_t kp, __m512 (&low)[R],
                                                    __m512 (&high)[R]) {
      const __m512bh wa = reinterpret_cast<__m512bh>(_mm512_loadu_ps(w));
      const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_loadu_ps(w + kPanel));
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, job.x + r * job.k_size + 2 * kp, sizeof(pair));
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        low[r] = _mm512_dpbf16_ps(low[r], xv, wa);
        high[r] = _mm512_dpbf16_ps(high[r], xv, wb);
      }
    });
  });
}
#endif

// Compute-bound matmuls over bfloat16 pairs, where vdpbf16ps is slow: WidenedBlocks runs blocks [b0, b1) and says
// true, or says false and leaves them to the tiles.
template <typename X, typename W>
bool WidenedBlocks(const MatmulJob<X, W>&, int64_t, int64_t) {
  return false;
}

#if defined(JSERVE_AVX512_BF16) && defined(JSERVE_INTEL)
// On Intel Xeons the packed bfloat16 tiles (vdpbf16ps) run at ~0.6 of the float32 ones' speed at 32 rows and more,
// though they read half the bytes (benchmarks/cpu_kernels_micro.py: gate_up at 32 rows 0.80 against 0.48 ms). So
// there, past RowBlocks' few rows, each block's two halves are widened to float32 panels [K, 16] first and x to
// float32 once an item, and the float32 tiles run over them. Each pair's odd k comes first, in the panels and in x:
// vdpbf16ps adds the odd product, then the even one, each rounded once (this order matches the instruction bit for
// bit on 3.2M lanes), so these tiles give its bits, and a row's bits do not depend on its batch (denormals
// aside: vdpbf16ps flushes them).
void WidenPairsOddFirst(const float* pairs, int64_t k_size, float* panel) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const __m512i bits = _mm512_loadu_si512(pairs + kp * 2 * kPanel);
    _mm512_storeu_ps(panel + 2 * kp * kPanel, _mm512_castsi512_ps(_mm512_and_si512(bits, high)));
    _mm512_storeu_ps(panel + (2 * kp + 1) * kPanel, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
  }
}

template <>
bool WidenedBlocks(const MatmulJob<uint16_t, uint32_t>& job, int64_t b0, int64_t b1) {
  const int64_t k_size = job.k_size, values = job.m_size * k_size;
  thread_local std::vector<float> x, panels;
  x.resize(static_cast<size_t>(values));
  for (int64_t i = 0; i < values; i += 2) {  // k_size is even: pairs never straddle rows
    x[i] = Bf16ToFloat(job.x[i + 1]);
    x[i + 1] = Bf16ToFloat(job.x[i]);
  }
  panels.resize(static_cast<size_t>(2 * kPanel * k_size));
  float* const panel_b = panels.data() + kPanel * k_size;
  const MatmulJob<float, F32Panels> wide{x.data(), nullptr, job.y, job.bias, job.accumulate,
                                         job.m_size, job.n_size, k_size};
  const int64_t length = 2 * PanelLength<uint32_t>(k_size);
  for (int64_t b = b0; b < b1; ++b) {
    const float* block = BlockAt(job, b, length);
    WidenPairsOddFirst(block, k_size, panels.data());
    WidenPairsOddFirst(block + kPanel, k_size, panel_b);
    BlockTiles(wide, b * 2 * kPanel, panels.data(), panel_b, kPanel);
  }
  return true;
}
#endif

// Packed blocks lie one after another, so an item of consecutive blocks is one forward stream. For a few rows of x
// (bandwidth-bound) the items are guided (RunsOf), long first: the 576-wide projections stream at 35 GB/s in items
// of one 36 KiB block, at 50 in items of 96 KiB. Many rows are compute-bound: equal runs, each block requesting the
// next one early.
#ifdef __AVX512F__
constexpr int64_t kStreamRows = 4;  // at most this many rows of x take guided items
#else
constexpr int64_t kStreamRows = kWideRows;
#endif

// Whether the job runs one owned item a thread, each over its thread's weight part (a few rows of x, with parts).
template <typename X, typename W>
bool OwnedBlocks(const MatmulJob<X, W>& job, int64_t threads) {
  return job.m_size <= kStreamRows && job.parts != nullptr && job.parts->parts == threads && threads <= 64;
}

// Writes a matmul's x [m, k] into the buffer it is given. Where each owned item makes its own x (a norm, the SiLU:
// a few microseconds of work), the step before the matmul needs no phase, so no wait, of its own.
// (x, item): item is the owned item's index, so that item 0 can also do what one thread alone must.
template <typename X>
using MatmulInput = InlineFunction<void(X*, int64_t), 48>;

// `input` (owned items only: OwnedBlocks) makes x for each item in a buffer of that thread's; job.x is then unused.
template <typename X, typename W>
Phase PackedPhase(const MatmulJob<X, W>& job, int64_t threads, MatmulInput<X> input = {}) {
  const bool streamed = job.m_size <= kStreamRows;
  const BlockParts* parts = job.parts;
  if (OwnedBlocks(job, threads)) {
    Phase phase{threads, [job, parts, input](int64_t p) {  // each thread its own part: the next stretch of its stream
                  MatmulJob<X, W> own = job;
                  thread_local std::vector<X> x;
                  if (input) {
                    x.resize(static_cast<size_t>(job.m_size * job.k_size));
                    input(x.data(), p);
                    own.x = x.data();
                  }
                  const int64_t begin = parts->begin[p], end = parts->begin[p + 1];
                  if (RowBlocks(own, begin, end)) return;
                  for (int64_t b = begin; b < end; ++b) MatmulPacked(own, b, false);
                }};
    phase.owned = true;
    return phase;
  }
  const ItemStarts starts = RunsOf(Blocks(job.n_size, 2 * kPanel), threads, streamed);
  return {static_cast<int64_t>(starts->size()) - 1, [job, starts, streamed](int64_t item) {
            const int64_t begin = (*starts)[item], end = (*starts)[item + 1];
            if (RowBlocks(job, begin, end) || WidenedBlocks(job, begin, end)) return;
            for (int64_t b = begin; b < end; ++b) MatmulPacked(job, b, !streamed && b + 1 < end);
          }};
}

Phase MatmulPhase(const MatmulJob<float, F32Panels>& job, int64_t threads) { return PackedPhase(job, threads); }

#ifdef JSERVE_AVX512_BF16
// bfloat16 weights not packed at load time: each call packs its 32-column blocks (two panels) first.
template <>
void MatmulPanel(const MatmulJob<uint16_t, uint16_t>& job, int64_t n_begin, bool /*prefetch_next*/) {
  const int64_t k_size = job.k_size;
  if (k_size % 2 != 0) {  // no whole pairs: stream the columns instead (never for a real model's hidden sizes)
    MatmulColumns(job, n_begin, std::min(job.n_size, n_begin + 2 * kPanel));
    return;
  }
  thread_local std::vector<float> panels;
  const int64_t pairs = k_size / 2;
  panels.resize(static_cast<size_t>(2 * kPanel * pairs));
  const float* w_pairs = reinterpret_cast<const float*>(job.w);  // row n, pair kp at w_pairs[n * pairs + kp]
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t half_cols = std::clamp<int64_t>(cols - half * kPanel, 0, kPanel);
    float* panel = panels.data() + half * kPanel * pairs;
    if (half_cols == 0) {
      std::fill(panel, panel + kPanel * pairs, 0.0f);
    } else {
      PackPanel(w_pairs + (n_begin + half * kPanel) * pairs, half_cols, pairs, panel);
    }
  }
  BlockTiles(job, n_begin, panels.data(), panels.data() + kPanel * pairs, kPanel);
}

#endif

Phase MatmulPhase(const MatmulJob<Bf16Input, uint32_t>& job, int64_t threads) { return PackedPhase(job, threads); }

// The job as parallel items: column blocks streamed for few rows; for many, runs of panels packed per call (2 items
// a thread: every panel costs the same), each panel's tiles requesting the next panel's rows.
template <typename X, typename W>
Phase MatmulPhase(const MatmulJob<X, W>& job, int64_t threads) {
  if (job.m_size >= PanelMinRows<X, W>()) {
    const int64_t cols = PanelCols<X, W>();
    const ItemStarts starts = RunsOf(Blocks(job.n_size, cols), threads, false);
    return {static_cast<int64_t>(starts->size()) - 1, [job, cols, starts](int64_t item) {
              const int64_t end = (*starts)[item + 1];
              for (int64_t p = (*starts)[item]; p < end; ++p) MatmulPanel(job, p * cols, p + 1 < end);
            }};
  }
  return GuidedColumns(job.n_size, threads, [job](int64_t begin, int64_t end) { MatmulColumns(job, begin, end); });
}

}  // namespace
