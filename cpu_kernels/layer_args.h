#pragma once

// The jserve_decoder_layers call's operands: per-layer or stacked weights, checked, and per-thread parts.

#include "layer.h"

namespace {

const float* Optional(ffi::Buffer<ffi::F32>& b) {
  return b.element_count() == 0 ? nullptr : b.typed_data();
}

// A layer's 14 weight operands, in the order cpu_kernels.decoder_layers passes them.
constexpr size_t kLayerWeightArgs = 14;

struct LayerBuffers {
  ffi::Buffer<ffi::F32> input_norm;
  ffi::AnyBuffer qkv;
  ffi::Buffer<ffi::F32> qkv_bias, q_norm, k_norm;
  ffi::AnyBuffer o;
  ffi::Buffer<ffi::F32> o_bias, post_norm;
  ffi::AnyBuffer gate_up;
  ffi::Buffer<ffi::F32> gate_up_bias;
  ffi::AnyBuffer down;
  ffi::Buffer<ffi::F32> down_bias;
  ffi::Buffer<ffi::F32> attn_out_norm, mlp_out_norm;  // empty: no sandwich norms
};

ffi::Error LayerBuffersAt(const ffi::RemainingArgs& args, size_t layer, std::vector<LayerBuffers>& out) {
  const size_t base = layer * kLayerWeightArgs;
  auto f32 = [&](size_t i) { return args.get<ffi::Buffer<ffi::F32>>(base + i); };
  auto any = [&](size_t i) { return args.get<ffi::AnyBuffer>(base + i); };
  auto input_norm = f32(0), qkv_bias = f32(2), q_norm = f32(3), k_norm = f32(4), o_bias = f32(6),
       post_norm = f32(7), gate_up_bias = f32(9), down_bias = f32(11), attn_out_norm = f32(12),
       mlp_out_norm = f32(13);
  auto qkv = any(1), o = any(5), gate_up = any(8), down = any(10);
  for (const auto* b : {&input_norm, &qkv_bias, &q_norm, &k_norm, &o_bias, &post_norm, &gate_up_bias, &down_bias,
                        &attn_out_norm, &mlp_out_norm}) {
    if (b->has_error()) return b->error();
  }
  for (const auto* b : {&qkv, &o, &gate_up, &down}) {
    if (b->has_error()) return b->error();
  }
  out.push_back({*input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias,
                 *down, *down_bias, *attn_out_norm, *mlp_out_norm});
  return ffi::Error::Success();
}

// Stacked weights: each of the 14 operands holds every layer, layer first ([L, ...]; an empty one stands for every
// layer's missing bias or norm). Layer l's buffers are views of the l-th slices, described in `views` (12 a layer),
// which must outlive `out`.
// With `in_parts`, the matrices' operands are the per-thread parts and three empty arrays (see MatrixParts): their
// per-layer views are left empty.
ffi::Error StackedLayerBuffers(const ffi::RemainingArgs& args, size_t num_layers, bool in_parts,
                               std::vector<XLA_FFI_Buffer>& views, std::vector<LayerBuffers>& out) {
  static const int64_t kNoElements[1] = {0};
  views.resize(num_layers * kLayerWeightArgs);
  for (size_t i = 0; i < kLayerWeightArgs; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> stack = args.get<ffi::AnyBuffer>(i);
    if (stack.has_error()) return stack.error();
    const bool matmul = i == 1 || i == 5 || i == 8 || i == 10;  // the rest are norms and biases, float32
    if (matmul && in_parts) {
      for (size_t l = 0; l < num_layers; ++l) {
        XLA_FFI_Buffer& view = views[l * kLayerWeightArgs + i];
        view.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
        view.extension_start = nullptr;
        view.dtype = static_cast<XLA_FFI_DataType>(stack->element_type());
        view.data = stack->untyped_data();
        view.rank = 1;
        view.dims = const_cast<int64_t*>(kNoElements);
      }
      continue;
    }
    const auto dims = stack->dimensions();
    const bool empty = stack->element_count() == 0;
    if (!empty && (dims.size() < 2 || dims[0] != static_cast<int64_t>(num_layers))) {
      return ffi::Error::InvalidArgument("jserve_decoder_layers: stacked weights must all be [num_layers, ...]");
    }
    if (!matmul && stack->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("jserve_decoder_layers: stacked norms and biases must be float32");
    }
    const size_t layer_bytes = empty ? 0 : stack->size_bytes() / num_layers;
    for (size_t l = 0; l < num_layers; ++l) {
      XLA_FFI_Buffer& view = views[l * kLayerWeightArgs + i];
      view.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
      view.extension_start = nullptr;
      view.dtype = static_cast<XLA_FFI_DataType>(stack->element_type());
      view.data = static_cast<char*>(stack->untyped_data()) + l * layer_bytes;
      view.rank = empty ? static_cast<int64_t>(dims.size()) : static_cast<int64_t>(dims.size()) - 1;
      view.dims = const_cast<int64_t*>(dims.begin()) + (empty ? 0 : 1);
    }
  }
  for (size_t l = 0; l < num_layers; ++l) {
    const XLA_FFI_Buffer* v = &views[l * kLayerWeightArgs];
    using F32 = ffi::Buffer<ffi::F32>;
    out.push_back({F32(v + 0), ffi::AnyBuffer(v + 1), F32(v + 2), F32(v + 3), F32(v + 4), ffi::AnyBuffer(v + 5),
                   F32(v + 6), F32(v + 7), ffi::AnyBuffer(v + 8), F32(v + 9), ffi::AnyBuffer(v + 10), F32(v + 11),
                   F32(v + 12), F32(v + 13)});
  }
  return ffi::Error::Success();
}

template <typename W>
LayerWeights<W> Weights(LayerBuffers& b) {
  return {b.input_norm.typed_data(), static_cast<const W*>(b.qkv.untyped_data()), Optional(b.qkv_bias),
          Optional(b.q_norm), Optional(b.k_norm), static_cast<const W*>(b.o.untyped_data()), Optional(b.o_bias),
          b.post_norm.typed_data(), static_cast<const W*>(b.gate_up.untyped_data()), Optional(b.gate_up_bias),
          static_cast<const W*>(b.down.untyped_data()), Optional(b.down_bias), Optional(b.attn_out_norm),
          Optional(b.mlp_out_norm)};
}

// Checks one layer's weights against the model's shapes and fills in what the caller compares across layers: the
// intermediate size, the weights' dtype and whether they are packed.
// With `in_parts` the matrices are checked by MatrixParts, and i_size, w_type and packed are given.
ffi::Error CheckLayerWeights(LayerBuffers& b, int64_t q_size, int64_t kv_size, int64_t e, int64_t d, bool in_parts,
                             int64_t& i_size, ffi::DataType& w_type, bool& packed) {
  const auto norm_ok = [e](ffi::Buffer<ffi::F32>& n) { return static_cast<int64_t>(n.element_count()) == e; };
  const auto bias_ok = [](ffi::Buffer<ffi::F32>& bias, int64_t n) {
    return bias.element_count() == 0 || static_cast<int64_t>(bias.element_count()) == n;
  };
  bool matrices_ok = true;
  if (!in_parts) {
    const WeightShape qkv_shape = ShapeOf(b.qkv), o_shape = ShapeOf(b.o), gate_up_shape = ShapeOf(b.gate_up),
                      down_shape = ShapeOf(b.down);
    i_size = down_shape.cols;
    w_type = b.qkv.element_type();
    packed = qkv_shape.packed;
    const bool same_type = b.o.element_type() == w_type && b.gate_up.element_type() == w_type &&
                           b.down.element_type() == w_type;
    const bool all_packed = qkv_shape.packed && o_shape.packed && gate_up_shape.packed && down_shape.packed;
    matrices_ok = same_type && qkv_shape.packed == all_packed &&
                  (IsBf16Bits(w_type) || w_type == ffi::DataType::F32 || all_packed) &&
                  Holds(qkv_shape, q_size + 2 * kv_size, e) && Holds(o_shape, e, q_size) &&
                  Holds(gate_up_shape, 2 * i_size, e) && Holds(down_shape, e, i_size);
  }
  const auto sandwich_ok = [e](ffi::Buffer<ffi::F32>& n) {
    return n.element_count() == 0 || static_cast<int64_t>(n.element_count()) == e;
  };
  if (!matrices_ok || !norm_ok(b.input_norm) || !sandwich_ok(b.attn_out_norm) || !sandwich_ok(b.mlp_out_norm) ||
      !norm_ok(b.post_norm) || !bias_ok(b.qkv_bias, q_size + 2 * kv_size) || !bias_ok(b.o_bias, e) ||
      !bias_ok(b.gate_up_bias, 2 * i_size) || !bias_ok(b.down_bias, e) ||
      (b.q_norm.element_count() != 0 && (static_cast<int64_t>(b.q_norm.element_count()) != d ||
                                         static_cast<int64_t>(b.k_norm.element_count()) != d))) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: weight shapes or dtypes disagree with the layer");
  }
  return ffi::Error::Success();
}

// Every layer's matrices in per-thread parts (cpu_kernels.PartLayout): one [P, L, U] array of packed weights
// (bfloat16 pairs as uint32, float32, or int8 blocks with their scales: then U counts bytes) where part p of layer l
// holds, one after another from its start, blocks [n P_p, n P_(p+1)) with P_p = p / P of qkv, o, gate_up and down (n
// blocks each), U the largest part. The other three matrix operands must be empty. -> each layer's parts of its four
// matrices.
struct MatrixPartsOf {
  std::array<std::vector<int64_t>, 4> begin;     // per matrix: [parts + 1]
  std::array<std::vector<const float*>, 4> base;  // per matrix: layer 0's parts
  std::vector<std::array<BlockParts, 4>> layers;  // pointing into the above
};

ffi::Error MatrixParts(const ffi::AnyBuffer& regions, const ffi::RemainingArgs& args, int64_t parts,
                       int64_t num_layers, int64_t q_size, int64_t kv_size, int64_t e, int64_t i_size,
                       MatrixPartsOf& out) {
  const auto dims = regions.dimensions();
  const bool pairs = regions.element_type() == ffi::DataType::U32, int8 = regions.element_type() == ffi::DataType::S8;
  const std::array<int64_t, 4> n_sizes{q_size + 2 * kv_size, e, 2 * i_size, e}, k_sizes{e, q_size, e, i_size};
  bool ok = dims.size() == 3 && dims[0] == parts && dims[1] == num_layers && i_size > 0 &&
            (pairs || int8 || regions.element_type() == ffi::DataType::F32);
  for (size_t i : {5, 8, 10}) {
    ffi::ErrorOr<ffi::AnyBuffer> empty = args.get<ffi::AnyBuffer>(i);
    ok = ok && !empty.has_error() && empty->element_count() == 0;
  }
  std::array<int64_t, 4> blocks{}, block_units{};
  for (size_t k = 0; k < 4; ++k) {
    ok = ok && !(pairs && k_sizes[k] % 2 != 0);
    blocks[k] = Blocks(n_sizes[k], 2 * kPanel);
    block_units[k] = int8 ? Int8BlockUnits(k_sizes[k]) : 2 * kPanel * (pairs ? k_sizes[k] / 2 : k_sizes[k]);
  }
  int64_t layer_units = 0;
  for (int64_t p = 0; p < parts; ++p) {
    int64_t units = 0;
    for (size_t k = 0; k < 4; ++k) units += (blocks[k] * (p + 1) / parts - blocks[k] * p / parts) * block_units[k];
    layer_units = std::max(layer_units, units);
  }
  if (!ok || dims[2] != (int8 ? 4 : 1) * layer_units) {  // layer_units: 4-byte units
    return ffi::Error::InvalidArgument(
        "jserve_decoder_layers: the matrices' per-thread parts disagree with the layer's shapes");
  }
  const float* base = static_cast<const float*>(regions.untyped_data());
  for (size_t k = 0; k < 4; ++k) {
    out.begin[k].resize(static_cast<size_t>(parts + 1));
    out.base[k].resize(static_cast<size_t>(parts));
  }
  for (int64_t p = 0; p < parts; ++p) {
    const float* at = base + p * num_layers * layer_units;  // part p of layer 0
    for (size_t k = 0; k < 4; ++k) {
      out.begin[k][p] = blocks[k] * p / parts;
      out.begin[k][p + 1] = blocks[k] * (p + 1) / parts;
      out.base[k][p] = at;
      at += (out.begin[k][p + 1] - out.begin[k][p]) * block_units[k];
    }
  }
  out.layers.resize(static_cast<size_t>(num_layers));
  for (int64_t l = 0; l < num_layers; ++l) {
    for (size_t k = 0; k < 4; ++k) out.layers[l][k] = {parts, out.begin[k].data(), out.base[k].data(), l * layer_units};
  }
  return ffi::Error::Success();
}


}  // namespace
