#pragma once

// The jserve_decoder_layers call: its checks, and the thread's kept phases from the call before.

#include "layer_args.h"

namespace {

// What a layer call's phases point into: the layers' arguments and their matrices' parts.
template <typename W>
struct LayerStorage {
  MatrixPartsOf parts;
  std::vector<LayerRun<W>> layers;
};

// A thread's last layer call, kept for its next. A decode's calls, step after step, differ only in what their
// buffers hold, and building a call's ~200 phases and the 30 layers' arguments they point into takes ~45 us where the
// memory reads ~65 GB/s: each store into a line the weight stream has flushed waits on it. A call whose key and
// attention items equal the last one's runs the same phases again.
struct LayerCallCache {
  // Everything the phases are built from but what the buffers hold: each buffer's address, type and shape, the
  // attributes and the threads (LayerCallKey); then the real tokens and the attention items.
  std::vector<int64_t> key;
  int64_t real_tokens = -1;
  AttentionArgs args;              // the shapes and metadata pointers the attention items are made from
  AttentionPlan plan;              // the attention items, which the phases read
  std::shared_ptr<void> storage;   // LayerStorage<W>
  SharedPhases phases;             // nullptr: nothing kept
  std::vector<float> rotary;       // LayerShape::rotary, [T, D]: refilled each call, sized with the key's shapes
};

LayerCallCache& TheLayerCallCache() {
  thread_local LayerCallCache cache;
  return cache;
}

std::atomic<int64_t> cached_layer_calls{0};  // calls that ran a kept call's phases (JserveCachedLayerCalls)

bool SamePlan(const AttentionPlan& a, const AttentionPlan& b) {
  auto same_item = [](const AttentionItem& x, const AttentionItem& y) {
    return x.seq == y.seq && x.kv_head_begin == y.kv_head_begin && x.kv_head_end == y.kv_head_end &&
           x.token_begin == y.token_begin && x.token_end == y.token_end && x.page_begin == y.page_begin &&
           x.page_end == y.page_end && x.partial == y.partial;
  };
  auto same_merge = [](const MergeItem& x, const MergeItem& y) { return x.first == y.first && x.count == y.count; };
  return a.partial_floats == b.partial_floats &&
         std::equal(a.items.begin(), a.items.end(), b.items.begin(), b.items.end(), same_item) &&
         std::equal(a.merges.begin(), a.merges.end(), b.merges.begin(), b.merges.end(), same_merge);
}

// Builds the layers' arguments and phases into `cache` (which then holds the only copy of them).
template <typename W>
void KeepLayers(LayerCallCache& cache, std::vector<LayerBuffers>& buffers, const LayerShape& first,
                ffi::RemainingRets& rets, int64_t stacked_layer_bytes, MatrixPartsOf&& parts, int64_t threads) {
  // An int8 cache's scales follow its pages in the results: every layer's k scales, then v scales (or stacked).
  const int64_t stacked_scale_floats = stacked_layer_bytes / cache.args.head_dim;  // int8: 1 byte a value
  const AttentionArgs& shape_args = cache.args;
  auto storage = std::make_shared<LayerStorage<W>>();
  storage->parts = std::move(parts);
  std::vector<LayerRun<W>>& layers = storage->layers;
  const size_t num_layers = buffers.size();
  layers.reserve(num_layers);  // the phases point into it: it never reallocates
  for (size_t l = 0; l < num_layers; ++l) {
    LayerShape s = first;
    if (l > 0) s.x = first.x_out;  // later layers update the residual stream in place
    AttentionArgs a = shape_args;
    void* k_pages;
    void* v_pages;
    if (stacked_layer_bytes > 0) {  // layer l's pages are the l-th slice of the one k and one v array
      k_pages = static_cast<char*>((*rets.get<ffi::AnyBuffer>(0))->untyped_data()) + l * stacked_layer_bytes;
      v_pages = static_cast<char*>((*rets.get<ffi::AnyBuffer>(1))->untyped_data()) + l * stacked_layer_bytes;
    } else {
      k_pages = (*rets.get<ffi::AnyBuffer>(l))->untyped_data();
      v_pages = (*rets.get<ffi::AnyBuffer>(num_layers + l))->untyped_data();
    }
    a.k_pages = k_pages;
    a.v_pages = v_pages;
    if (a.kv_int8 && stacked_layer_bytes > 0) {
      a.k_scales = static_cast<float*>((*rets.get<ffi::AnyBuffer>(2))->untyped_data()) + l * stacked_scale_floats;
      a.v_scales = static_cast<float*>((*rets.get<ffi::AnyBuffer>(3))->untyped_data()) + l * stacked_scale_floats;
    } else if (a.kv_int8) {
      a.k_scales = static_cast<float*>((*rets.get<ffi::AnyBuffer>(2 * num_layers + l))->untyped_data());
      a.v_scales = static_cast<float*>((*rets.get<ffi::AnyBuffer>(3 * num_layers + l))->untyped_data());
    }
    layers.push_back({s, Weights<W>(buffers[l]), a, k_pages, v_pages});
    if (!storage->parts.layers.empty()) layers.back().w.parts = storage->parts.layers[l].data();
  }
  cache.phases = DecoderLayerPhases(layers, cache.plan, threads);
  cache.storage = std::move(storage);
}

// The layer call's key (LayerCallCache): every buffer's address, type and shape (`fixed`, then the remaining
// arguments and results), then the attributes and the threads.
template <typename... Fixed>
const std::vector<int64_t>& LayerCallKey(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                         std::initializer_list<int64_t> attributes, const Fixed&... fixed) {
  thread_local std::vector<int64_t> key;
  key.clear();
  auto add = [](const auto& b) {
    key.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(b.untyped_data())));
    key.push_back(static_cast<int64_t>(b.element_type()));
    const auto dims = b.dimensions();
    key.push_back(static_cast<int64_t>(dims.size()));
    key.insert(key.end(), dims.begin(), dims.end());
  };
  (add(fixed), ...);
  key.push_back(static_cast<int64_t>(args.size()));
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = args.get<ffi::AnyBuffer>(i);
    if (b.has_value()) add(*b);
  }
  key.push_back(static_cast<int64_t>(rets.size()));
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_value()) add(**b);
  }
  key.insert(key.end(), attributes);
  return key;
}

// Padding rows carry the residual stream x[T, E] through untouched (nothing reads them).
void CarryPadding(const float* x, float* x_out, int64_t real_tokens, int64_t num_tokens, int64_t e) {
  std::memcpy(x_out + real_tokens * e, x + real_tokens * e, static_cast<size_t>((num_tokens - real_tokens) * e) * 4);
}

int64_t BitsOf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

ffi::Error DecoderLayersImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> positions,
                             ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> page_table,
                             ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> seq_lens,
                             ffi::Buffer<ffi::F32> inv_freq, ffi::RemainingArgs args,
                             ffi::ResultBuffer<ffi::F32> x_out, ffi::RemainingRets rets, int64_t num_heads,
                             float eps, float scale, int64_t sliding_window, float soft_cap, int64_t weight_parts,
                             int64_t intermediate_size, int64_t int8_round, int64_t activation) {
  CallClock call_clock(kLayersCall);
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || num_heads <= 0) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: expected x[T, E]");
  }
  const int64_t threads = pool.num_threads();
  const std::vector<int64_t>& key = LayerCallKey(
      args, rets, {num_heads, BitsOf(eps), BitsOf(scale), sliding_window, BitsOf(soft_cap), weight_parts,
                   intermediate_size, int8_round, activation, threads},
      x, positions, slot_mapping, page_table, query_start, seq_lens, inv_freq, *x_out);
  LayerCallCache& cache = TheLayerCallCache();
  if (cache.phases != nullptr && key == cache.key) {  // the buffers of the call before: its phases?
    const int64_t num_tokens = x_dims[0], e = x_dims[1], num_seqs = page_table.dimensions()[0];
    const int64_t real_tokens = std::clamp<int64_t>(query_start.typed_data()[num_seqs], 0, num_tokens);
    thread_local AttentionPlan plan;  // reused: its vectors keep their storage
    ffi::Error valid = AttentionItems(cache.args, num_seqs, real_tokens, threads, plan);
    if (valid.failure()) return valid;
    if (real_tokens == cache.real_tokens && SamePlan(plan, cache.plan)) {
      CarryPadding(x.typed_data(), x_out->typed_data(), real_tokens, num_tokens, e);
      RotaryTable(positions.typed_data(), inv_freq.typed_data(), real_tokens, cache.args.head_dim / 2,
                  cache.rotary.data());
      cached_layer_calls.fetch_add(1, std::memory_order_relaxed);
      RunPhases(pool, cache.phases);
      return ffi::Error::Success();
    }
  }
  cache.phases.reset();  // built anew below, or nothing kept if the call fails
  cache.storage.reset();
  // The weights come per layer (14 operands a layer) or stacked (14 operands, each [L, ...]: see StackedLayerBuffers),
  // then the K/V pages, each array aliased to its result: every layer's k_pages, then every layer's v_pages, or
  // stacked, one k[L, N, B, Hkv, D] and one v. Stacked, they are 16 arrays whatever the depth (a jitted step pays
  // its dispatch per array). An int8 cache adds its float32 scales after them, [N, B, Hkv] a layer (or stacked),
  // k's then v's: the pages are then the first half of the K/V arrays.
  const size_t kv_arrays = rets.size();
  ffi::ErrorOr<ffi::AnyBuffer> norms = args.get<ffi::AnyBuffer>(0);
  if (norms.has_error()) return norms.error();
  const bool stacked_weights = args.size() == kLayerWeightArgs + kv_arrays && norms->dimensions().size() == 2;
  const size_t num_layers = stacked_weights ? static_cast<size_t>(norms->dimensions()[0])
                            : args.size() >= kv_arrays ? (args.size() - kv_arrays) / kLayerWeightArgs : 0;
  const size_t weight_args = stacked_weights ? kLayerWeightArgs : num_layers * kLayerWeightArgs;
  if (num_layers == 0 || kv_arrays < 2 || args.size() != weight_args + kv_arrays) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: expected 14 weights a layer (or stacked), then k/v pages");
  }
  std::vector<LayerBuffers> buffers;
  buffers.reserve(num_layers);
  // weight_parts > 0: the stacked matrices are in that many per-thread parts (MatrixParts).
  const bool in_parts = weight_parts > 0;
  if (in_parts && !stacked_weights) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: per-thread weight parts need stacked weights");
  }
  std::vector<XLA_FFI_Buffer> views;  // the stacked weights' per-layer slices, which `buffers` point into
  if (stacked_weights) {
    ffi::Error got = StackedLayerBuffers(args, num_layers, in_parts, views, buffers);
    if (got.failure()) return got;
  } else {
    for (size_t l = 0; l < num_layers; ++l) {
      ffi::Error got = LayerBuffersAt(args, l, buffers);
      if (got.failure()) return got;
    }
  }
  ffi::ErrorOr<ffi::AnyBuffer> k0 = args.get<ffi::AnyBuffer>(weight_args);
  if (k0.has_error()) return k0.error();
  const auto all_kv_dims = k0->dimensions();
  const bool int8 = k0->element_type() == ffi::DataType::S8;
  const size_t page_arrays = int8 ? kv_arrays / 2 : kv_arrays;  // the rest: the scales
  const bool stacked = page_arrays == 2 && all_kv_dims.size() == 5;
  if ((int8 && kv_arrays % 4 != 0) ||
      (stacked ? all_kv_dims[0] != static_cast<int64_t>(num_layers) : page_arrays != 2 * num_layers)) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: expected k/v pages for each layer (or stacked)");
  }
  const auto kv_dims = stacked ? all_kv_dims.last(4) : all_kv_dims;
  AttentionArgs a;
  ffi::Error shapes = AttentionShapes(a, num_heads, kv_dims.size() == 4 ? kv_dims[3] : 0, kv_dims,
                                      page_table.dimensions(), k0->element_type(), k0->element_type());
  if (shapes.failure()) return shapes;
  const int64_t num_tokens = x_dims[0], e = x_dims[1], d = a.head_dim;
  const int64_t q_size = num_heads * d, kv_size = a.kv_heads * d;
  if (d > 512 || d % 2 != 0 || static_cast<int64_t>(inv_freq.element_count()) != d / 2) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: unsupported head size or rotary table");
  }
  int64_t i_size = 0;
  ffi::DataType w_type = ffi::DataType::F32;
  bool packed = false;
  MatrixPartsOf parts;  // in_parts: each layer's matrices' parts
  if (in_parts) {
    ffi::ErrorOr<ffi::AnyBuffer> regions = args.get<ffi::AnyBuffer>(1);
    if (regions.has_error()) return regions.error();
    ffi::Error got = MatrixParts(*regions, args, weight_parts, static_cast<int64_t>(num_layers), q_size, kv_size, e,
                                 intermediate_size, parts);
    if (got.failure()) return got;
    i_size = intermediate_size, w_type = regions->element_type(), packed = true;
  }
  for (size_t l = 0; l < num_layers; ++l) {
    int64_t layer_i = i_size;
    ffi::DataType layer_type = w_type;
    bool layer_packed = packed;
    ffi::Error ok = CheckLayerWeights(buffers[l], q_size, kv_size, e, d, in_parts, layer_i, layer_type,
                                      layer_packed);
    if (ok.failure()) return ok;
    if (l == 0) i_size = layer_i, w_type = layer_type, packed = layer_packed;
    if (layer_i != i_size || layer_type != w_type || layer_packed != packed) {
      return ffi::Error::InvalidArgument("jserve_decoder_layers: every layer must have the same weight shapes");
    }
  }
  for (size_t kv = 0; kv < kv_arrays; ++kv) {
    ffi::ErrorOr<ffi::AnyBuffer> pages = args.get<ffi::AnyBuffer>(weight_args + kv);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(kv);
    if (pages.has_error()) return pages.error();
    if (out.has_error()) return out.error();
    const auto dims = pages->dimensions();
    const bool scales = kv >= page_arrays;  // an int8 cache's scales: the pages' shape without head_dim
    const auto want = scales ? all_kv_dims.first(all_kv_dims.size() - 1) : all_kv_dims;
    if (pages->element_type() != (scales ? ffi::DataType::F32 : k0->element_type()) ||
        !std::equal(dims.begin(), dims.end(), want.begin(), want.end()) ||
        (*out)->untyped_data() != pages->untyped_data()) {
      return ffi::Error::InvalidArgument("jserve_decoder_layers: every layer's pages must match (and be aliased)");
    }
  }
  a.page_table = page_table.typed_data();
  a.query_start = query_start.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.scale = scale;
  a.soft_cap = soft_cap;
  a.sliding_window = sliding_window;
  const int64_t num_seqs = page_table.dimensions()[0];
  const int64_t real_tokens = std::clamp<int64_t>(a.query_start[num_seqs], 0, num_tokens);
  CarryPadding(x.typed_data(), x_out->typed_data(), real_tokens, num_tokens, e);
  ffi::Error valid = AttentionItems(a, num_seqs, real_tokens, threads, cache.plan);
  if (valid.failure()) return valid;
  cache.rotary.resize(static_cast<size_t>(num_tokens * d));  // the same shapes keep its storage (and the phases)
  RotaryTable(positions.typed_data(), inv_freq.typed_data(), real_tokens, d / 2, cache.rotary.data());
  if (activation != 0 && activation != 1) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: activation must be 0 (SiLU) or 1 (GELU, tanh)");
  }
  const LayerShape first{real_tokens, e, i_size, eps, x.typed_data(), x_out->typed_data(),
                         slot_mapping.typed_data(), cache.rotary.data(), activation == 1};
  const int64_t stacked_layer_bytes =
      stacked ? a.num_pages * a.page_size * kv_size * (a.kv_int8 ? 1 : a.kv_bf16 ? 2 : 4) : 0;
  cache.args = a;
  if (packed && w_type == ffi::DataType::S8 && int8_round != 0) {
    KeepLayers<Int8Blocks<true>>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  } else if (packed && w_type == ffi::DataType::S8) {
    KeepLayers<Int8Blocks<false>>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  } else if (packed && w_type == ffi::DataType::U32) {
    KeepLayers<uint32_t>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  } else if (packed) {
    KeepLayers<F32Panels>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  } else if (IsBf16Bits(w_type)) {
    KeepLayers<uint16_t>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  } else {
    KeepLayers<float>(cache, buffers, first, rets, stacked_layer_bytes, std::move(parts), threads);
  }
  cache.key = key;
  cache.real_tokens = real_tokens;
  RunPhases(pool, cache.phases);
  return ffi::Error::Success();
}

}  // namespace
