#pragma once

// The jserve_paged_attention call: work items, the flash-attention loop over pages, and split decodes.

#include "attention_rows.h"

namespace {


// An item's rows are, for each of its KV heads, its tokens times the query heads of the group. Pages are visited
// once, in order, with every head of the item on a page before the next page: with all heads, a page's K (then V)
// is one contiguous run read front to back, which the prefetchers follow.
void StoreAttentionRows(const AttentionArgs& a, const AttentionItem& item, const float* acc);

// The first key a query at `pos` sees: a sliding window hides the older ones, and chunked attention (Llama 4's)
// those before the query's chunk.
inline int64_t LowestKey(const AttentionArgs& a, int64_t pos) {
  if (a.sliding_window > 0) return std::max<int64_t>(0, pos - a.sliding_window + 1);
  return a.attention_chunk > 0 ? pos / a.attention_chunk * a.attention_chunk : 0;
}

// The attention sink of an item's row r (nullptr: no sinks). Rows are [KV head][token][query head of the group]
// (head_rows = tokens * group a KV head), and a sink belongs to a query head, not to the KV head it shares.
inline const float* SinkOfRow(const AttentionArgs& a, const AttentionItem& item, int64_t r, int64_t head_rows) {
  if (a.sinks == nullptr) return nullptr;
  const int64_t group = a.num_heads / a.kv_heads;
  return a.sinks + (item.kv_head_begin + r / head_rows) * group + r % group;
}

// What a row's accumulator is multiplied by to normalize it, given its running max m and its sum of e^(s_j - m):
// 1 / sum, or with a sink 1 / (sum + e^(sink - m)), the sink being one more key whose value is zero. Both terms are
// taken relative to max(m, sink), so a sink far above every score neither overflows nor yields NaN. A row that saw
// no key (sum 0) stays zero.
inline float InverseSum(float m, float sum, const float* sink) {
  if (!(sum > 0.0f)) return 0.0f;
  if (sink == nullptr) return 1.0f / sum;
  const float top = std::max(m, *sink);
  const float keys = std::exp(m - top);
  return keys / (sum * keys + std::exp(*sink - top));
}

void AttendItem(const AttentionArgs& a, const AttentionItem& item) {
  const int64_t group = a.num_heads / a.kv_heads, d_size = a.head_dim, b_size = a.page_size;
  const int64_t q_len = a.query_start[item.seq + 1] - a.query_start[item.seq];
  const int64_t first_pos = a.seq_lens[item.seq] - q_len;  // position of the sequence's first new token
  const int64_t heads = item.kv_head_end - item.kv_head_begin, tokens = item.token_end - item.token_begin;
  const int64_t head_rows = tokens * group, rows = heads * head_rows;
  thread_local std::vector<float> buffer;
  // q rows (pre-scaled) | accumulators | scores of one page | running max | running sum | K and V of one page
  buffer.resize(static_cast<size_t>(2 * rows * d_size + rows * b_size + 2 * rows + 2 * b_size * d_size));
  float* q = buffer.data();
  float* acc = q + rows * d_size;
  float* scores = acc + rows * d_size;
  float* row_max = scores + rows * b_size;
  float* row_sum = row_max + rows;
  float* kv_scratch = row_sum + rows;
  thread_local std::vector<int64_t> row_pos;  // [head_rows]: the same for every head
  row_pos.resize(static_cast<size_t>(head_rows));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t token = item.token_begin + t;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = h * head_rows + t * group + g;
        const float* src = a.q + token * a.q_stride + ((item.kv_head_begin + h) * group + g) * d_size;
        for (int64_t d = 0; d < d_size; ++d) q[r * d_size + d] = src[d] * a.scale;
        row_pos[t * group + g] = first_pos + (token - a.query_start[item.seq]);
      }
    }
  }
  std::fill(acc, acc + rows * d_size, 0.0f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.0f);
  const int64_t last_pos = row_pos[head_rows - 1];
  const int64_t prefetch_head = heads == a.kv_heads ? -1 : item.kv_head_begin;  // -1: whole pages
  const int64_t lowest_key = LowestKey(a, row_pos[0]);
  const int32_t* pages = a.page_table + item.seq * a.pages_per_seq;
  const int64_t first_page = std::max(lowest_key / b_size, item.page_begin);
  const int64_t end_page = std::min(last_pos / b_size + 1, item.page_end);
  // The cache is cold (a step streams every weight through it): ask for pages kPrefetchPages ahead of their use.
  // A bfloat16 cache is read in groups of pages loaded up front (~20% less time in a batch-1 layer's attention); a
  // float32 one, whose rows are twice as long, runs faster with prefetches kPrefetchPages ahead.
  const int64_t touched_per_page = 2 * b_size * (prefetch_head < 0 ? a.kv_heads : 1) * d_size * 2;
  const int64_t touch_pages = a.kv_bf16 ? std::max<int64_t>(1, kTouchBytes / touched_per_page) : 0;
  for (int64_t p = first_page; touch_pages == 0 && p < std::min(end_page, first_page + kPrefetchPages); ++p) {
    PrefetchPage(a, pages[p], prefetch_head);
  }
  for (int64_t p = first_page; p < end_page; ++p) {
    const int64_t page = pages[p];
    if (touch_pages > 0 && (p - first_page) % touch_pages == 0) {
      TouchPages(a, pages, p, std::min(end_page, p + touch_pages), prefetch_head);
    } else if (touch_pages == 0 && p + kPrefetchPages < end_page) {
      PrefetchPage(a, pages[p + kPrefetchPages], prefetch_head);
    }
    if (page < 0 || page >= a.num_pages) continue;  // never for a valid table; keeps a bad one in bounds
    const int64_t key_begin = p * b_size, keys = std::min(b_size, last_pos + 1 - key_begin);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kv_head = item.kv_head_begin + h;
      const float* k_rows[64];
      const float* v_rows[64];
      const int64_t row_begin = h * head_rows;
      [[maybe_unused]] const int64_t kv_offset = (page * b_size * a.kv_heads + kv_head) * d_size;  // slot 0, this head
#ifdef __AVX512F__
      const bool in_registers = a.kv_bf16 && (d_size == 64 || d_size == 128);
      const bool in_avx2_registers = false;
#else
      const bool in_registers = false;
      // bfloat16 only: float32 rows are read in place without widening, and this order is no faster for them.
      const bool in_avx2_registers = a.kv_bf16 && head_rows <= 4 && d_size % 32 == 0;
#endif
      if (in_avx2_registers) {
        const uint16_t* k_page = static_cast<const uint16_t*>(a.k_pages) + kv_offset;
        WithRows(head_rows, [&](auto r) {
          ScoresAvx2<decltype(r)::value>(q + row_begin * d_size, d_size, k_page, a.kv_heads * d_size, keys,
                                         scores + row_begin * b_size, b_size);
        });
      } else if (in_registers) {
#ifdef __AVX512F__
        const uint16_t* k_page = static_cast<const uint16_t*>(a.k_pages) + kv_offset;
        const float* q_rows = q + row_begin * d_size;
        float* s_rows = scores + row_begin * b_size;
        if (d_size == 64) {
          ScoresBf16<4>(q_rows, head_rows, k_page, a.kv_heads * d_size, keys, s_rows, b_size);
        } else {
          ScoresBf16<8>(q_rows, head_rows, k_page, a.kv_heads * d_size, keys, s_rows, b_size);
        }
#endif
      } else {
        for (int64_t j = 0; j < keys; ++j) {
          k_rows[j] = KvRow(a, a.k_pages, page, j, kv_head, kv_scratch + j * d_size);
        }
        for (int64_t r = row_begin; r < row_begin + head_rows; ++r) {
          float* s = scores + r * b_size;
          int64_t j4 = 0;
          if (d_size % 8 == 0) {
            for (; j4 + 4 <= keys; j4 += 4) _mm_storeu_ps(s + j4, Dot4(q + r * d_size, k_rows + j4, d_size));
          }
          for (int64_t j = j4; j < keys; ++j) s[j] = DotRow(q + r * d_size, k_rows[j], d_size);
        }
      }
      for (int64_t r = row_begin; r < row_begin + head_rows; ++r) {
        float* s = scores + r * b_size;
        const int64_t pos = row_pos[r - row_begin];
        float page_max = -std::numeric_limits<float>::infinity();
        const int64_t lowest = LowestKey(a, pos);
        const bool all_visible = a.soft_cap <= 0 && key_begin + keys - 1 <= pos && key_begin >= lowest;
        if (all_visible) {  // the usual case, without a branch per key
          page_max = MaxOf(s, keys);
        } else {
          for (int64_t j = 0; j < keys; ++j) {
            const int64_t key_pos = key_begin + j;
            const bool visible = key_pos <= pos && key_pos >= lowest;
            float score = -std::numeric_limits<float>::infinity();
            if (visible) score = a.soft_cap > 0 ? a.soft_cap * std::tanh(s[j] / a.soft_cap) : s[j];
            s[j] = score;
            page_max = std::max(page_max, score);
          }
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
      if (in_avx2_registers) {
        const uint16_t* v_page = static_cast<const uint16_t*>(a.v_pages) + kv_offset;
        WithRows(head_rows, [&](auto r) {
          AccumulateAvx2<decltype(r)::value>(acc + row_begin * d_size, d_size, scores + row_begin * b_size, b_size,
                                             v_page, a.kv_heads * d_size, keys);
        });
        continue;
      }
      if (in_registers) {
#ifdef __AVX512F__
        const uint16_t* v_page = static_cast<const uint16_t*>(a.v_pages) + kv_offset;
        float* out_rows = acc + row_begin * d_size;
        const float* p_rows = scores + row_begin * b_size;
        if (d_size == 64) {
          AccumulateRowsBf16<4>(out_rows, head_rows, p_rows, b_size, v_page, a.kv_heads * d_size, keys);
        } else {
          AccumulateRowsBf16<8>(out_rows, head_rows, p_rows, b_size, v_page, a.kv_heads * d_size, keys);
        }
#endif
        continue;
      }
      for (int64_t j = 0; j < keys; ++j) {
        v_rows[j] = KvRow(a, a.v_pages, page, j, kv_head, kv_scratch + (b_size + j) * d_size);
      }
      for (int64_t r = row_begin; r < row_begin + head_rows; ++r) {
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
  }
  if (item.partial >= 0) {  // one part of a split decode: MergeParts normalizes and stores
    float* state = a.partials + item.partial;
    std::copy(acc, acc + rows * d_size, state);
    std::copy(row_max, row_max + rows, state + rows * d_size);
    std::copy(row_sum, row_sum + rows, state + rows * d_size + rows);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {  // normalize in place, then store as the output's dtype
    const float inv = InverseSum(row_max[r], row_sum[r], SinkOfRow(a, item, r, head_rows));
    for (int64_t d = 0; d < d_size; ++d) acc[r * d_size + d] *= inv;
  }
  StoreAttentionRows(a, item, acc);
}

// An item's normalized rows acc [heads][tokens * group][D] into the output [T, H, D], as its dtype.
void StoreAttentionRows(const AttentionArgs& a, const AttentionItem& item, const float* acc) {
  const int64_t group = a.num_heads / a.kv_heads, d_size = a.head_dim;
  const int64_t heads = item.kv_head_end - item.kv_head_begin, tokens = item.token_end - item.token_begin;
  const int64_t head_rows = tokens * group;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t offset = ((item.token_begin + t) * a.num_heads + (item.kv_head_begin + h) * group) * d_size;
      const float* rows_of_token = acc + (h * head_rows + t * group) * d_size;  // the group's heads are adjacent
      if (a.out_bf16) {
        StoreRow(static_cast<uint16_t*>(a.out) + offset, rows_of_token, group * d_size);
      } else {
        StoreInput(static_cast<float*>(a.out) + offset, rows_of_token, group * d_size, a.out_round);
      }
    }
  }
}


// The work items of a batch, after checking its metadata; real_tokens: tokens before the padding. A decode (one
// query token) over more than kSplitPages pages is split into parts of about equal page counts, merged after
// (flash-decoding: a lone sequence's KV heads alone are too few items to keep every thread busy). Whether and how a
// decode splits depends on its own length only, so it attends to the same bits alone and batched.
struct AttentionPlan {
  std::vector<AttentionItem> items;
  std::vector<MergeItem> merges;
  int64_t partial_floats = 0;  // the split parts' state
};

ffi::Error AttentionItems(const AttentionArgs& a, int64_t num_seqs, int64_t real_tokens, int64_t threads,
                          AttentionPlan& plan) {
  std::vector<AttentionItem>& items = plan.items;
  items.clear();
  plan.merges.clear();
  plan.partial_floats = 0;
  int64_t blocks = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = a.query_start[s], end = std::min<int64_t>(a.query_start[s + 1], real_tokens);
    if (end <= begin) continue;
    if (a.seq_lens[s] < end - begin || (a.seq_lens[s] + a.page_size - 1) / a.page_size > a.pages_per_seq) {
      return ffi::Error::InvalidArgument("jserve: seq_lens disagree with query_start or page_table");
    }
    blocks += Blocks(end - begin, kQueryBlock);
  }
  const int64_t heads_per_item = blocks >= 4 * threads ? a.kv_heads : 1;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = a.query_start[s], end = std::min<int64_t>(a.query_start[s + 1], real_tokens);
    for (int64_t t = begin; t < end; t += kQueryBlock) {
      for (int64_t h = 0; h < a.kv_heads; h += heads_per_item) {
        const AttentionItem item{s, h, h + heads_per_item, t, std::min(end, t + kQueryBlock)};
        const int64_t pos = a.seq_lens[s] - 1;  // a decode's one query position
        const int64_t first_page = LowestKey(a, pos) / a.page_size, pages = pos / a.page_size + 1 - first_page;
        const int64_t parts = end - begin == 1 ? Blocks(pages, kSplitPages) : 1;  // only decodes split
        if (parts <= 1) {
          items.push_back(item);
          continue;
        }
        plan.merges.push_back({static_cast<int64_t>(items.size()), parts});
        const int64_t rows = heads_per_item * (a.num_heads / a.kv_heads);
        for (int64_t part = 0; part < parts; ++part) {
          AttentionItem piece = item;
          piece.page_begin = first_page + pages * part / parts;
          piece.page_end = first_page + pages * (part + 1) / parts;
          piece.partial = plan.partial_floats;
          plan.partial_floats += rows * (a.head_dim + 2);
          items.push_back(piece);
        }
      }
    }
  }
  return ffi::Error::Success();
}

// Fills the shape fields of `a` from q [T, H, D], the pages [N, B, Hkv, D] and the table [S, P].
ffi::Error AttentionShapes(AttentionArgs& a, int64_t num_heads, int64_t head_dim, ffi::AnyBuffer::Dimensions kv_dims,
                           ffi::AnyBuffer::Dimensions table_dims, ffi::DataType k_type, ffi::DataType v_type) {
  if (kv_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("jserve: expected pages[N, B, Hkv, D] and page_table[S, P]");
  }
  if (k_type != v_type) return ffi::Error::InvalidArgument("jserve: k_pages and v_pages differ in dtype");
  a.kv_bf16 = IsBf16Bits(k_type);
  a.kv_int8 = k_type == ffi::DataType::S8;
  if (!a.kv_bf16 && !a.kv_int8 && k_type != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("jserve: the KV cache must be float32, bfloat16 or int8");
  }
  a.num_heads = num_heads;
  a.head_dim = head_dim;
  a.num_pages = kv_dims[0];
  a.page_size = kv_dims[1];
  a.kv_heads = kv_dims[2];
  a.pages_per_seq = table_dims[1];
  if (a.page_size > 64 || a.kv_heads <= 0 || a.num_heads % a.kv_heads != 0 || kv_dims[3] != a.head_dim) {
    return ffi::Error::InvalidArgument("jserve: unsupported attention shapes (page size must be <= 64)");
  }
  return ffi::Error::Success();
}

// Combines a split decode's parts: each part's rows are rescaled to the largest of their maxima, summed and
// normalized, then stored as an unsplit item's would be.
void MergeParts(const AttentionArgs& a, const AttentionItem* parts, int64_t count) {
  const int64_t d_size = a.head_dim;
  const int64_t rows = (parts[0].kv_head_end - parts[0].kv_head_begin) * (a.num_heads / a.kv_heads);
  thread_local std::vector<float> merged;
  merged.assign(static_cast<size_t>(rows * d_size), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < count; ++p) top = std::max(top, a.partials[parts[p].partial + rows * d_size + r]);
    if (top == -std::numeric_limits<float>::infinity()) continue;  // no visible key: zeros, as unsplit
    float sum = 0.0f;
    float* out = merged.data() + r * d_size;
    for (int64_t p = 0; p < count; ++p) {
      const float* state = a.partials + parts[p].partial;
      const float weight = std::exp(state[rows * d_size + r] - top);  // 0 for a part that saw no key
      sum += weight * state[rows * d_size + rows + r];
      for (int64_t d = 0; d < d_size; ++d) out[d] += weight * state[r * d_size + d];
    }
    const float inv = InverseSum(top, sum, SinkOfRow(a, parts[0], r, a.num_heads / a.kv_heads));  // one token
    for (int64_t d = 0; d < d_size; ++d) out[d] *= inv;
  }
  StoreAttentionRows(a, parts[0], merged.data());
}

// Attention as two phases: the items, then the merges of split decodes (none: an empty phase).
std::array<Phase, 2> AttentionPhases(const AttentionArgs& a, const AttentionPlan& plan) {
  return {Phase{static_cast<int64_t>(plan.items.size()), [&a, &plan](int64_t i) { AttendItem(a, plan.items[i]); },
                false, kAttentionPhase},
          Phase{static_cast<int64_t>(plan.merges.size()), [&a, &plan](int64_t i) {
                  const MergeItem& m = plan.merges[i];
                  MergeParts(a, plan.items.data() + m.first, m.count);
                }, false, kMergePhase}};
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                              ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float scale,
                              int64_t sliding_window, float soft_cap, int64_t attention_chunk) {
  CallClock call_clock(kAttentionCall);
  const auto q_dims = q.dimensions();
  if (q_dims.size() != 3) return ffi::Error::InvalidArgument("jserve_paged_attention: expected q[T, H, D]");
  AttentionArgs a;
  ffi::Error shapes = AttentionShapes(a, q_dims[1], q_dims[2], k_pages.dimensions(), page_table.dimensions(),
                                      k_pages.element_type(), v_pages.element_type());
  if (shapes.failure()) return shapes;
  if (a.kv_int8) {  // one scale per (token, KV head) row of each cache: [N, B, Hkv]
    const auto kv_dims = k_pages.dimensions();
    const int64_t rows = kv_dims[0] * kv_dims[1] * kv_dims[2];
    if (static_cast<int64_t>(k_scales.element_count()) != rows ||
        static_cast<int64_t>(v_scales.element_count()) != rows) {
      return ffi::Error::InvalidArgument("jserve_paged_attention: an int8 cache needs scales[N, B, Hkv]");
    }
    a.k_scales = k_scales.typed_data();
    a.v_scales = v_scales.typed_data();
  }
  if (sinks.element_count() != 0) {  // empty: no sinks
    if (static_cast<int64_t>(sinks.element_count()) != a.num_heads) {
      return ffi::Error::InvalidArgument("jserve_paged_attention: sinks must be [H], one per query head");
    }
    a.sinks = sinks.typed_data();
  }
  a.q = q.typed_data();
  a.q_stride = q_dims[1] * q_dims[2];
  a.k_pages = k_pages.untyped_data();
  a.v_pages = v_pages.untyped_data();
  a.page_table = page_table.typed_data();
  a.query_start = query_start.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.out = out->typed_data();
  a.out_bf16 = false;
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.sliding_window = sliding_window;
  a.attention_chunk = attention_chunk;
  const int64_t num_tokens = q_dims[0], num_seqs = page_table.dimensions()[0];
  const int64_t real_tokens = std::clamp<int64_t>(a.query_start[num_seqs], 0, num_tokens);
  float* out_data = out->typed_data();
  std::fill(out_data + real_tokens * a.q_stride, out_data + num_tokens * a.q_stride, 0.0f);  // padding: zeros
  AttentionPlan plan;
  ffi::Error valid = AttentionItems(a, num_seqs, real_tokens, pool.num_threads(), plan);
  if (valid.failure()) return valid;
  std::vector<float> partials(static_cast<size_t>(plan.partial_floats));
  a.partials = partials.data();
  std::array<Phase, 2> phases = AttentionPhases(a, plan);
  RunPhases(pool, {phases[0], phases[1]});
  return ffi::Error::Success();
}

}  // namespace
