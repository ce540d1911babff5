#pragma once

// The decoder layer's phases. One decoder layer is ten phases (norm, qkv, rotary + K/V write, attention and the
// merge of split decodes, o + residual, norm, gate/up, SiLU, down + residual; seven where each thread streams its
// own weight part and makes each norm's and the SiLU's output itself) over the real tokens only (bucket padding
// costs nothing). Gemma 2/3's sandwich norms add a row phase after o and after down (the block's output normalized
// into the residual stream), and Gemma's MLP takes GELU's tanh approximation where others take SiLU. The matmul
// inputs are float32 for float32 weights and bfloat16 bits for bfloat16 ones, rounded once where they are produced;
// int8 weights take float32 (holding bfloat16 values in a bfloat16 model).

#include "attention.h"
#include "matmul.h"

namespace {

template <typename W>
struct LayerWeights {
  const float* input_norm;                       // [E]
  const W* qkv;                                  // [Q + 2 KV, E]
  const float* qkv_bias;                         // [Q + 2 KV] or nullptr
  const float *q_norm, *k_norm;                  // [D] or nullptr (Qwen3)
  const W* o;                                    // [E, Q]
  const float* o_bias;                           // [E] or nullptr
  const float* post_norm;                        // [E]
  const W* gate_up;                              // [2 I, E]: gate rows, then up rows
  const float* gate_up_bias;                     // [2 I] or nullptr
  const W* down;                                 // [E, I]
  const float* down_bias;                        // [E] or nullptr
  // Gemma 2/3's sandwich norms, or nullptr: the attention and MLP outputs are normalized before the residual add
  const float *attn_out_norm, *mlp_out_norm;     // [E]
  // Where the matrices lie in per-thread parts ([4]: qkv, o, gate_up, down), or nullptr: each whole at its pointer
  const BlockParts* parts = nullptr;
};

struct LayerShape {
  int64_t tokens;        // real tokens (rows computed)
  int64_t hidden;        // E
  int64_t intermediate;  // I
  float eps;
  const float* x;             // [T, E] the residual stream in
  float* x_out;               // [T, E] the residual stream out
  const int32_t* slots;       // [T] flat cache slots; out of range: not written
  const float* rotary;        // [T, D]: each token's cos, then sin, of its position times inv_freq (RotaryTable)
  bool gelu = false;          // the MLP's activation: GELU's tanh approximation (Gemma), else SiLU
};

constexpr int64_t kRowsPerItem = 8;  // token rows per item of the elementwise phases

// dst[0..n) = rmsnorm(src) * weight, stored as the next matmul's input (rounded to bfloat16 values: `round`).
template <typename X>
void RmsNormRow(const float* src, const float* weight, int64_t n, float eps, X* dst, bool round) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += src[i] * src[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) row[i] = src[i] * inv * weight[i];
  StoreInput(dst, row.data(), n, round);
}

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm), head_dim wide.
void RmsNormHeads(float* x, int64_t heads, int64_t d, const float* weight, float eps) {
  for (int64_t h = 0; h < heads; ++h) {
    float* row = x + h * d;
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) row[i] = row[i] * inv * weight[i];
  }
}

// Every layer's rotary angles, once a call: token t's cos(pos * inv_freq[f]) at table[t * 2 * half + f], its sin
// half floats on. Computed in each layer's rotary phase instead, they would cost D calls of std::cos or std::sin a
// token a layer, ~0.15 us a layer at batch 1, where that phase runs on one thread while the other waits
// (benchmarks/phase_profile.py).
void RotaryTable(const int32_t* positions, const float* inv_freq, int64_t tokens, int64_t half, float* table) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float pos = static_cast<float>(positions[t]);
    float* row = table + t * 2 * half;
    for (int64_t f = 0; f < half; ++f) {
      const float angle = pos * inv_freq[f];
      row[f] = std::cos(angle);
      row[half + f] = std::sin(angle);
    }
  }
}

// Rotate-half rotary embedding of `heads` heads in place, with the token's cos / sin tables.
void RotateHeads(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * d;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// out = silu(gate) * up, with silu(g) = g * sigmoid(g) and sigmoid from exp(-|g|) (never overflows).
void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = ExpNonPositive(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sigmoid = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // g < 0: e / (1 + e)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// out = gelu(gate) * up with GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), and
// tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2 |u|) (never overflows).
void GeluMul(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 cubic = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kCubic), g), _mm256_mul_ps(g, g), g);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi), cubic);
    const __m256 magnitude = _mm256_andnot_ps(sign, inner);
    const __m256 e = ExpNonPositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), magnitude));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 tanh = _mm256_or_ps(t, _mm256_and_ps(sign, inner));  // the sign of inner
    const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, tanh));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + kCubic * g * g * g))) * up[i];
  }
}

// x_out[0..n) += rmsnorm(block) * weight: a sandwich norm on a block's output before the residual add.
void AddNormedRow(const float* block, const float* weight, int64_t n, float eps, float* x_out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += block[i] * block[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) x_out[i] += block[i] * inv * weight[i];
}

// One token's K or V rows (kv_heads rows of d) quantized into an int8 cache: each head's row symmetric, with
// scale = max|row| / 127 stored at scales[slot * kv_heads + head] (pallas_kernels/quantized.py's quantize_rows, the
// same float32 operations, so both write the same bytes for the same row).
void StoreKvInt8(int8_t* pages, float* scales, int64_t slot, const float* src, int64_t kv_heads, int64_t d) {
  for (int64_t h = 0; h < kv_heads; ++h) {
    const float* row = src + h * d;
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(row[i]));
    const float scale = amax / 127.0f;
    const float divisor = scale == 0.0f ? 1.0f : scale;
    int8_t* dst = pages + (slot * kv_heads + h) * d;
    for (int64_t i = 0; i < d; ++i) {
      dst[i] = static_cast<int8_t>(std::clamp(std::nearbyint(row[i] / divisor), -127.0f, 127.0f));
    }
    scales[slot * kv_heads + h] = scale;
  }
}

void StoreKv(void* pages, bool bf16, int64_t slot, const float* src, int64_t n) {
  if (bf16) {
    StoreRow(static_cast<uint16_t*>(pages) + slot * n, src, n);
  } else {
    StoreRow(static_cast<float*>(pages) + slot * n, src, n);
  }
}

// One layer's part of a call, kept alive (and in place) until its phases have run: they point into it.
template <typename W>
struct LayerRun {
  LayerShape s;
  LayerWeights<W> w;
  AttentionArgs a;
  void *k_pages, *v_pages;
};

// The parts of matrix `kind` (0 qkv, 1 o, 2 gate_up, 3 down), nullptr where the matrices are whole.
template <typename W>
const BlockParts* PartsOf(const LayerWeights<W>& w, int kind) {
  return w.parts == nullptr ? nullptr : w.parts + kind;
}

// Scratch rows shared by every layer of a call (its phases run one after another).
template <typename X>
struct LayerScratch {
  X* in;                // [T, max(E, Q, I)]: each matmul's input, in turn
  float* qkv;           // [T, Q + 2 KV]
  float* gate_up;       // [T, 2 I]
  float* block;         // [T, E]: the attention or MLP output before its sandwich norm (Gemma 2/3)
};

// Appends one layer's ten phases, or seven with owned items (attention is two: its items, then the merges of
// split decodes). Matmul inputs: float32, or for bfloat16 weights (plain or packed) Bf16Input: bfloat16 bits for
// vdpbf16ps, else float32 rounded to bfloat16 values.
template <typename X, typename W>
void AppendLayerPhases(std::vector<Phase>& phases, LayerRun<W>& r, const AttentionPlan& plan,
                       const LayerScratch<X>& scratch, int64_t threads) {
  // bf16 weights (and int8 ones of a bfloat16 model): x rounded to bfloat16 values
  constexpr bool round = !(std::is_same_v<W, float> || std::is_same_v<W, F32Panels> ||
                           std::is_same_v<W, Int8Blocks<false>>);
  const LayerShape& s = r.s;
  const LayerWeights<W>& w = r.w;
  AttentionArgs& a = r.a;
  const int64_t t_size = s.tokens, e = s.hidden, i_size = s.intermediate, d = a.head_dim;
  const int64_t q_size = a.num_heads * d, kv_size = a.kv_heads * d, qkv_size = q_size + 2 * kv_size;
  X* in = scratch.in;
  float* qkv_rows = scratch.qkv;
  float* gate_up_rows = scratch.gate_up;
  float* block_rows = scratch.block;
  a.q = qkv_rows;
  a.q_stride = qkv_size;
  a.out = in;
  a.out_bf16 = std::is_same_v<X, uint16_t>;
  a.out_round = round;
  const int64_t row_items = Blocks(t_size, kRowsPerItem);
  auto rows = [t_size](int64_t item, auto&& body) {
    for (int64_t t = item * kRowsPerItem; t < std::min(t_size, (item + 1) * kRowsPerItem); ++t) body(t);
  };
  const LayerRun<W>* run = &r;
  // A matmul and the step that makes its x (`make_x` writes rows [t0, t1) of it into `x`; `once` does rows
  // [t0, t1) of what only one thread may do): one phase where each thread makes x for itself (OwnedBlocks) and item
  // 0 does `once`, else the step's phase into `in`, then the matmul's.
  auto append_matmul = [&](const MatmulJob<X, W>& job, int kind, auto make_x, auto once) {
    if constexpr (std::is_same_v<W, F32Panels> || std::is_same_v<W, uint32_t> || IsInt8Weight<W>::value) {
      if (OwnedBlocks(job, threads)) {
        MatmulInput<X> input = [make_x, once, t_size](X* x, int64_t item) {
          if (item == 0) once(0, t_size);
          make_x(0, t_size, x);
        };
        phases.push_back(PackedPhase(job, threads, input));
        phases.back().kind = kind;
        return;
      }
    }
    phases.push_back({row_items, [make_x, once, t_size, in](int64_t item) {
                        const int64_t t0 = item * kRowsPerItem, t1 = std::min(t_size, t0 + kRowsPerItem);
                        once(t0, t1);
                        make_x(t0, t1, in);
                      }, false, kInputPhase});
    phases.push_back(MatmulPhase(job, threads));
    phases.back().kind = kind;
  };
  auto nothing = [](int64_t, int64_t) {};
  append_matmul(MatmulJob<X, W>{in, w.qkv, qkv_rows, w.qkv_bias, false, t_size, qkv_size, e, PartsOf(w, 0)}, kQkvPhase,
                [run](int64_t t0, int64_t t1, X* x) {
                  const LayerShape& s = run->s;
                  for (int64_t t = t0; t < t1; ++t)
                    RmsNormRow(s.x + t * s.hidden, run->w.input_norm, s.hidden, s.eps, x + t * s.hidden, round);
                },
                [run](int64_t t0, int64_t t1) {  // the first layer moves the residual stream to x_out
                  const LayerShape& s = run->s;
                  const int64_t e = s.hidden;
                  const size_t bytes = static_cast<size_t>((t1 - t0) * e) * 4;
                  if (s.x != s.x_out) std::memcpy(s.x_out + t0 * e, s.x + t0 * e, bytes);
                });
  phases.push_back({row_items, [run, qkv_rows, rows](int64_t item) { rows(item, [&](int64_t t) {
    const LayerShape& s = run->s;
    const AttentionArgs& a = run->a;
    const int64_t d = a.head_dim, q_size = a.num_heads * d, kv_size = a.kv_heads * d;
    float* q = qkv_rows + t * a.q_stride;
    float* k = q + q_size;
    const float* v = k + kv_size;
    if (run->w.q_norm != nullptr) {
      RmsNormHeads(q, a.num_heads, d, run->w.q_norm, s.eps);
      RmsNormHeads(k, a.kv_heads, d, run->w.k_norm, s.eps);
    }
    const float* cos = s.rotary + t * d;
    const float* sin = cos + d / 2;
    RotateHeads(q, a.num_heads, d, cos, sin);
    RotateHeads(k, a.kv_heads, d, cos, sin);
    const int64_t slot = s.slots[t];
    if (slot >= 0 && slot < a.num_pages * a.page_size && a.kv_int8) {
      StoreKvInt8(static_cast<int8_t*>(run->k_pages), const_cast<float*>(a.k_scales), slot, k, a.kv_heads, d);
      StoreKvInt8(static_cast<int8_t*>(run->v_pages), const_cast<float*>(a.v_scales), slot, v, a.kv_heads, d);
    } else if (slot >= 0 && slot < a.num_pages * a.page_size) {
      StoreKv(run->k_pages, a.kv_bf16, slot, k, kv_size);
      StoreKv(run->v_pages, a.kv_bf16, slot, v, kv_size);
    }
  }); }, false, kRotaryPhase});
  for (Phase& phase : AttentionPhases(a, plan)) phases.push_back(std::move(phase));
  // With a sandwich norm the block's output goes to `block` and a row phase adds it normalized (add_normed); else
  // the matmul adds it to the residual stream as it stores it.
  auto add_normed = [&](const float* norm, int kind) {
    phases.push_back({row_items, [run, block_rows, norm, rows](int64_t item) { rows(item, [&](int64_t t) {
      const LayerShape& s = run->s;
      AddNormedRow(block_rows + t * s.hidden, norm, s.hidden, s.eps, s.x_out + t * s.hidden);
    }); }, false, kind});
  };
  float* o_out = w.attn_out_norm != nullptr ? block_rows : s.x_out;
  phases.push_back(MatmulPhase(
      MatmulJob<X, W>{in, w.o, o_out, w.o_bias, w.attn_out_norm == nullptr, t_size, e, q_size, PartsOf(w, 1)},
      threads));
  phases.back().kind = kOPhase;
  if (w.attn_out_norm != nullptr) add_normed(w.attn_out_norm, kOPhase);
  append_matmul(
      MatmulJob<X, W>{in, w.gate_up, gate_up_rows, w.gate_up_bias, false, t_size, 2 * i_size, e, PartsOf(w, 2)},
      kGateUpPhase,
      [run](int64_t t0, int64_t t1, X* x) {
        const LayerShape& s = run->s;
        for (int64_t t = t0; t < t1; ++t)
          RmsNormRow(s.x_out + t * s.hidden, run->w.post_norm, s.hidden, s.eps, x + t * s.hidden, round);
      },
      nothing);
  float* down_out = w.mlp_out_norm != nullptr ? block_rows : s.x_out;
  const bool gelu = s.gelu;
  append_matmul(MatmulJob<X, W>{in, w.down, down_out, w.down_bias, w.mlp_out_norm == nullptr, t_size, e, i_size,
                                PartsOf(w, 3)},
                kDownPhase,
                [gate_up_rows, i_size, gelu](int64_t t0, int64_t t1, X* x) {
                  thread_local std::vector<float> act;
                  act.resize(static_cast<size_t>(i_size));
                  for (int64_t t = t0; t < t1; ++t) {
                    const float* gate = gate_up_rows + t * 2 * i_size;
                    if (gelu) {
                      GeluMul(gate, gate + i_size, act.data(), i_size);
                    } else {
                      SiluMul(gate, gate + i_size, act.data(), i_size);
                    }
                    StoreInput(x + t * i_size, act.data(), i_size, round);
                  }
                },
                nothing);
  if (w.mlp_out_norm != nullptr) add_normed(w.mlp_out_norm, kDownPhase);
}

// Every layer in one pass over the pool: a layer's phases follow the one before's with no return to XLA between
// them (a call's setup and XLA's step to the next call cost 10-17 us a layer on caches the weights just flushed).
// The phases point into `layers` and `plan`, which must outlive them.
template <typename W>
SharedPhases DecoderLayerPhases(std::vector<LayerRun<W>>& layers, const AttentionPlan& plan, int64_t threads) {
  // float32 x: float32 weights, int8 ones (widened to float32 in registers)
  constexpr bool f32_weights = std::is_same_v<W, float> || std::is_same_v<W, F32Panels> || IsInt8Weight<W>::value;
  using X = std::conditional_t<f32_weights, float, Bf16Input>;
  const LayerShape& s = layers[0].s;
  const AttentionArgs& a = layers[0].a;
  const int64_t t_size = s.tokens, q_size = a.num_heads * a.head_dim;
  thread_local std::vector<X> inputs;
  thread_local std::vector<float> qkv;
  thread_local std::vector<float> gate_up;
  thread_local std::vector<float> block;
  inputs.resize(static_cast<size_t>(t_size * std::max({s.hidden, q_size, s.intermediate})));
  qkv.resize(static_cast<size_t>(t_size * (q_size + 2 * a.kv_heads * a.head_dim)));
  gate_up.resize(static_cast<size_t>(t_size * 2 * s.intermediate));
  const bool sandwich = layers[0].w.attn_out_norm != nullptr || layers[0].w.mlp_out_norm != nullptr;
  block.resize(sandwich ? static_cast<size_t>(t_size * s.hidden) : 0);
  // The phases run on other threads too: they get these pointers, never the thread_local names.
  const LayerScratch<X> scratch{inputs.data(), qkv.data(), gate_up.data(), block.data()};
  auto phases = std::make_shared<std::vector<Phase>>();
  phases->reserve(12 * layers.size());
  thread_local std::vector<float> partials;  // split decodes' parts, reused by every layer in turn
  partials.resize(static_cast<size_t>(plan.partial_floats));
  for (LayerRun<W>& layer : layers) {
    layer.a.partials = partials.data();
    AppendLayerPhases(*phases, layer, plan, scratch, threads);
  }
  return phases;
}

}  // namespace
