#pragma once

// Ragged paged attention's inner loops. One work item is (sequence, block of up to kQueryBlock query tokens, KV
// heads): its rows are those tokens times the query heads sharing each KV head (GQA). Pages are visited once per
// item, in order, with a flash-attention style running max and sum per row (attention.h's AttendItem); this file
// holds what reads a page: its K/V rows, their prefetches, and a page's scores and weighted sums of V.

#include "phases.h"
#include "simd.h"

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kSplitPages = 16;  // a decode over more pages than this is split into parts (AttentionItems)
constexpr int64_t kPrefetchPages = 2;  // pages of K/V requested ahead of the one being read
constexpr int64_t kTouchBytes = 32 << 10;  // K and V bytes of a bfloat16 cache loaded ahead at once (one L1)

struct AttentionArgs {
  const float* q;              // [T, q_stride]: token t's head h at q[t * q_stride + h * D]
  int64_t q_stride;
  const void* k_pages;         // [N, B, Hkv, D]
  const void* v_pages;
  bool kv_bf16;
  bool kv_int8 = false;        // int8 values, each (token, KV head) row times its scale:
  const float* k_scales = nullptr;  // [N, B, Hkv] (kv_int8 only)
  const float* v_scales = nullptr;
  const int32_t* page_table;   // [S, P]
  const int32_t* query_start;  // [S + 1]
  const int32_t* seq_lens;     // [S]
  void* out;                   // [T, H, D], float32 or (out_bf16) bfloat16 bits
  bool out_bf16;
  bool out_round = false;      // float32 out rounded to bfloat16 values (a bfloat16 matmul's Bf16Input)
  int64_t num_heads, kv_heads, head_dim, page_size, pages_per_seq, num_pages;
  float scale, soft_cap;       // soft_cap 0: none
  int64_t sliding_window;      // 0: none
  int64_t attention_chunk = 0;  // 0: none; else a query sees only its own chunk of this many keys (Llama 4)
  float* partials = nullptr;   // split items' unnormalized rows, maxima and sums (AttentionItem::partial)
  const float* sinks = nullptr;  // [H] attention sinks by query head (gpt-oss), or none: see InverseSum
};

// A sequence's block of query tokens against a range of its KV heads: all of them when the batch has items enough
// for every thread (a page's K or V for all heads is one contiguous run: one prefetch stream, every line used),
// one head each when it has not (a lone decode still splits over threads).
struct AttentionItem {
  int64_t seq, kv_head_begin, kv_head_end, token_begin, token_end;
  int64_t page_begin = 0, page_end = std::numeric_limits<int64_t>::max();  // the part of the pages it reads
  int64_t partial = -1;  // >= 0: one part of a split decode, its state stored at partials + partial
};

// A split decode's parts (consecutive items), merged once every part is done.
struct MergeItem {
  int64_t first, count;
};

// An int8 row times its scale, widened into `scratch`: 8 values a register, from bytes to float32 in registers.
inline const float* Int8Row(const int8_t* row, float scale, int64_t d_size, float* scratch) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t d = 0;
  for (; d + 8 <= d_size; d += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    _mm256_storeu_ps(scratch + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s));
  }
  for (; d < d_size; ++d) scratch[d] = static_cast<float>(row[d]) * scale;
  return scratch;
}

// One page-row of K or V for one KV head, as float32 (widened into `scratch` for a bf16 or int8 cache).
inline const float* KvRow(const AttentionArgs& a, const void* pages, int64_t page, int64_t slot, int64_t kv_head,
                          float* scratch) {
  const int64_t offset = ((page * a.page_size + slot) * a.kv_heads + kv_head) * a.head_dim;
  if (a.kv_int8) {
    const float* scales = pages == a.k_pages ? a.k_scales : a.v_scales;
    return Int8Row(static_cast<const int8_t*>(pages) + offset, scales[offset / a.head_dim], a.head_dim, scratch);
  }
  if (!a.kv_bf16) return static_cast<const float*>(pages) + offset;
  const uint16_t* row = static_cast<const uint16_t*>(pages) + offset;
  int64_t d = 0;
#ifdef __AVX512F__
  for (; d + 16 <= a.head_dim; d += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
    _mm512_storeu_ps(scratch + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
#endif
  for (; d + 8 <= a.head_dim; d += 8) _mm256_storeu_ps(scratch + d, LoadBf16x8(row + d));
  for (; d < a.head_dim; ++d) scratch[d] = Bf16ToFloat(row[d]);
  return scratch;
}

// Asks for a page's K and V ahead of their use: one KV head's rows (each its own short run of lines), or with
// kv_head < 0 the whole page, every head (one contiguous run each for K and V).
inline int64_t KvRowBytes(const AttentionArgs& a) { return a.head_dim * (a.kv_int8 ? 1 : a.kv_bf16 ? 2 : 4); }

inline void PrefetchPage(const AttentionArgs& a, int64_t page, int64_t kv_head) {
  if (page < 0 || page >= a.num_pages) return;
  const int64_t row_bytes = KvRowBytes(a);
  const int64_t slot_bytes = a.kv_heads * row_bytes;
  for (const void* pages : {a.k_pages, a.v_pages}) {
    const char* base = static_cast<const char*>(pages) + page * a.page_size * slot_bytes;
    if (kv_head < 0) {
      for (int64_t offset = 0; offset < a.page_size * slot_bytes; offset += 64) _mm_prefetch(base + offset, _MM_HINT_T0);
      continue;
    }
    for (int64_t slot = 0; slot < a.page_size; ++slot) {
      const char* row = base + slot * slot_bytes + kv_head * row_bytes;
      for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(row + offset, _MM_HINT_T0);
    }
  }
}


// Reads one word of every line of pages [first, end) (one KV head's rows, or whole pages for kv_head < 0). Demand
// loads in a loop of nothing else keep many misses in flight, where prefetches interleaved with the arithmetic keep
// few; the lines then wait in L1/L2 for the arithmetic.
inline void TouchPages(const AttentionArgs& a, const int32_t* pages, int64_t first, int64_t end, int64_t kv_head) {
  const int64_t row_bytes = KvRowBytes(a);
  const int64_t slot_bytes = a.kv_heads * row_bytes;
  uint32_t sink = 0;
  for (int64_t p = first; p < end; ++p) {
    const int64_t page = pages[p];
    if (page < 0 || page >= a.num_pages) continue;
    for (const void* kv : {a.k_pages, a.v_pages}) {
      const char* base = static_cast<const char*>(kv) + page * a.page_size * slot_bytes;
      const int64_t runs = kv_head < 0 ? 1 : a.page_size;  // whole pages: one run; one head: a run a slot
      const int64_t run_bytes = kv_head < 0 ? a.page_size * slot_bytes : row_bytes;
      for (int64_t r = 0; r < runs; ++r) {
        const char* run = base + (kv_head < 0 ? 0 : r * slot_bytes + kv_head * row_bytes);
        for (int64_t offset = 0; offset < run_bytes; offset += 64) {
          sink += *reinterpret_cast<const volatile uint32_t*>(run + offset);
        }
      }
    }
  }
  asm volatile("" : : "r"(sink));  // the loads stay
}

// Four dot products q . k_i at once (size a multiple of 8); the four horizontal sums share three hadds.
inline __m128 Dot4Avx2(const float* q, const float* const* k, int64_t size) {
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

#ifdef __AVX512F__
// Four dot products q . k_i at once: 16 lanes where the size allows.
inline __m128 Dot4(const float* q, const float* const* k, int64_t size) {
  if (size % 16 != 0) return Dot4Avx2(q, k, size);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < size; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[0] + i), a0);
    a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[1] + i), a1);
    a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[2] + i), a2);
    a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[3] + i), a3);
  }
  auto fold = [](__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); };
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}
#else
inline __m128 Dot4(const float* q, const float* const* k, int64_t size) { return Dot4Avx2(q, k, size); }
#endif

// out[0..64) += sum_j weights[j] * v[j][0..64), with the output row held in eight registers.
inline void AccumulateRow64(float* out, const float* weights, const float* const* v, int64_t keys) {
#ifdef __AVX512F__
  __m512 o[4];
  for (int64_t i = 0; i < 4; ++i) o[i] = _mm512_loadu_ps(out + 16 * i);
  for (int64_t j = 0; j < keys; ++j) {
    const __m512 w = _mm512_set1_ps(weights[j]);
    for (int64_t i = 0; i < 4; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v[j] + 16 * i), o[i]);
  }
  for (int64_t i = 0; i < 4; ++i) _mm512_storeu_ps(out + 16 * i, o[i]);
#else
  __m256 o[8];
  for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_loadu_ps(out + 8 * i);
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 w = _mm256_set1_ps(weights[j]);
    for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 8 * i), o[i]);
  }
  for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
#endif
}

#ifdef __AVX512F__
// A bfloat16 cache read straight into registers (head_dim 64 or 128: C = head_dim / 16 vectors a row), for the
// page-heads of decode and short prefill blocks: no widened copy of the page, and each K or V row is widened once
// for all the item's rows of that head.

inline __m512 WidenBf16x16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// scores[r * stride_s + j] = q_r . k_j for `rows` rows of q (pre-scaled, [rows, 16 C]) and keys j < keys, the K row
// of key j at k + j * stride_k (bfloat16 bits); 16 / C keys at a time, their four sums folded together.
template <int C>
void ScoresBf16(const float* q, int64_t rows, const uint16_t* k, int64_t stride_k, int64_t keys, float* scores,
                int64_t stride_s) {
  constexpr int kKeys = 16 / C;  // keys held widened in registers at once: 16 vectors
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, keys - j0);
    __m512 kv[kKeys][C];
    for (int kk = 0; kk < kKeys; ++kk)
      for (int c = 0; c < C; ++c) {
        kv[kk][c] = kk < count ? WidenBf16x16(k + (j0 + kk) * stride_k + 16 * c) : _mm512_setzero_ps();
      }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * 16 * C;
      float sums[kKeys];
      for (int kk = 0; kk < kKeys; ++kk) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[kk][0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[kk][c], acc);
        sums[kk] = _mm512_reduce_add_ps(acc);
      }
      for (int64_t kk = 0; kk < count; ++kk) scores[r * stride_s + j0 + kk] = sums[kk];
    }
  }
}

// out_r += sum_j p[r * stride_p + j] * v_j for R rows whose outputs ([R, 16 C]) stay in registers.
template <int C, int R>
void AccumulateBf16(float* out, const float* p, int64_t stride_p, const uint16_t* v, int64_t stride_v,
                    int64_t keys) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_loadu_ps(out + (r * C + c) * 16);
  for (int64_t j = 0; j < keys; ++j) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = WidenBf16x16(v + j * stride_v + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * stride_p + j]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, o[r][c]);
}

// The same for any number of rows: blocks of up to 24 / C rows (the registers' worth).
template <int C>
void AccumulateRowsBf16(float* out, int64_t rows, const float* p, int64_t stride_p, const uint16_t* v,
                        int64_t stride_v, int64_t keys) {
  constexpr int kMax = 24 / C;
  for (int64_t r = 0; r < rows; r += kMax) {
    float* o = out + r * 16 * C;
    const float* pr = p + r * stride_p;
    switch (std::min<int64_t>(kMax, rows - r)) {
      case 1: AccumulateBf16<C, 1>(o, pr, stride_p, v, stride_v, keys); break;
      case 2: AccumulateBf16<C, 2>(o, pr, stride_p, v, stride_v, keys); break;
      case 3: AccumulateBf16<C, 3>(o, pr, stride_p, v, stride_v, keys); break;
      case 4: AccumulateBf16<C, (4 <= kMax ? 4 : kMax)>(o, pr, stride_p, v, stride_v, keys); break;
      case 5: AccumulateBf16<C, (5 <= kMax ? 5 : kMax)>(o, pr, stride_p, v, stride_v, keys); break;
      default: AccumulateBf16<C, kMax>(o, pr, stride_p, v, stride_v, keys); break;
    }
  }
}
#endif

// Without AVX-512, the few rows of a decode (R <= 4: one token's query heads of a KV head) read each K or V row
// into registers (a bfloat16 one widened there) once for all R rows. Widening a bf16 page into a float32 copy first,
// then one row's dot products at a time, takes twice as long: an item of 10 pages x 3 rows, run twice in a decode
// step (its pages warm), takes 8 us this way and 14 us that way. Both stay out of line: inlined into AttendItem
// they slow the float32 cache's path, which does not use them, by 1-5% of 32-sequence throughput.

// Row r's two sums of the accumulator pairs (a0, a1) and (b0, b1) of rows r and r + 1 -> [a0, a1, b0, b1].
inline __m128 PairSums(__m256 a0, __m256 a1, __m256 b0, __m256 b1) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(b0, b1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores[r * stride_s + j] = q_r . k_j for R <= 4 rows of q (pre-scaled, [R, d_size], d_size a multiple of 8) and
// keys j < keys, the K row of key j at k + j * stride_k (bfloat16 bits): two keys at a time, widened in registers,
// against every row. The accumulators are named variables: held in an array, GCC keeps them on the stack.
template <int R>
__attribute__((noinline)) void ScoresAvx2(const float* q, int64_t d_size, const uint16_t* k, int64_t stride_k,
                                          int64_t keys, float* scores, int64_t stride_s) {
  for (int64_t j = 0; j < keys; j += 2) {
    const uint16_t* k0 = k + j * stride_k;
    const uint16_t* k1 = j + 1 < keys ? k0 + stride_k : k0;  // an odd last key is read twice, its copy dropped
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t c = 0; c < d_size; c += 8) {
      const __m256 x0 = Load8(k0 + c), x1 = Load8(k1 + c);
      __m256 qv = _mm256_loadu_ps(q + c);
      a00 = _mm256_fmadd_ps(qv, x0, a00);
      a01 = _mm256_fmadd_ps(qv, x1, a01);
      if constexpr (R > 1) {
        qv = _mm256_loadu_ps(q + d_size + c);
        a10 = _mm256_fmadd_ps(qv, x0, a10);
        a11 = _mm256_fmadd_ps(qv, x1, a11);
      }
      if constexpr (R > 2) {
        qv = _mm256_loadu_ps(q + 2 * d_size + c);
        a20 = _mm256_fmadd_ps(qv, x0, a20);
        a21 = _mm256_fmadd_ps(qv, x1, a21);
      }
      if constexpr (R > 3) {
        qv = _mm256_loadu_ps(q + 3 * d_size + c);
        a30 = _mm256_fmadd_ps(qv, x0, a30);
        a31 = _mm256_fmadd_ps(qv, x1, a31);
      }
    }
    const int64_t count = std::min<int64_t>(2, keys - j);
    float sums[8];
    _mm_storeu_ps(sums, PairSums(a00, a01, a10, a11));
    if constexpr (R > 2) _mm_storeu_ps(sums + 4, PairSums(a20, a21, a30, a31));
    for (int r = 0; r < R; ++r)
      for (int64_t kk = 0; kk < count; ++kk) scores[r * stride_s + j + kk] = sums[2 * r + kk];
  }
}

// out_r[0, d_size) += sum_j p[r * stride_p + j] * v_j (V rows as bfloat16 bits) for R rows, d_size a multiple of
// 8 kVectors: kVectors * 8 columns at a time, R x kVectors accumulators, R broadcast weights and one V vector in
// registers.
template <int R>
__attribute__((noinline)) void AccumulateAvx2(float* out, int64_t d_size, const float* p, int64_t stride_p,
                                              const uint16_t* v, int64_t stride_v, int64_t keys) {
  constexpr int kVectors = R <= 3 ? 4 : 2;
  for (int64_t c = 0; c < d_size; c += 8 * kVectors) {
    __m256 o[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kVectors; ++i) o[r][i] = _mm256_loadu_ps(out + r * d_size + c + 8 * i);
    for (int64_t j = 0; j < keys; ++j) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(p + r * stride_p + j);
      for (int i = 0; i < kVectors; ++i) {
        const __m256 vv = Load8(v + j * stride_v + c + 8 * i);
        for (int r = 0; r < R; ++r) o[r][i] = _mm256_fmadd_ps(w[r], vv, o[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(out + r * d_size + c + 8 * i, o[r][i]);
  }
}

// Calls fn(std::integral_constant<int, R>) for R = rows (1 to 4).
template <typename Fn>
void WithRows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

}  // namespace
