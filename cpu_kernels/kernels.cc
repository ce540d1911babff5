// jserve's CPU kernels, called from jitted JAX code through XLA's FFI (cpu_kernels/__init__.py builds them).
//
// XLA CPU runs the small matmuls of a decode step (M = 1..64 rows against a [out, in] weight) far below memory
// bandwidth and pays a fixed cost per op, and its paged attention has to gather every page of every token first.
// These kernels do what llama.cpp does instead: for few rows, stream each weight row once with all M rows of x in
// cache; for many, accumulate register tiles over packed weight panels; read each sequence's K/V pages in place;
// and run every decoder layer in one call, so a step pays per-op costs once, not fifteen times a layer.
//
//   jserve_matmul:          y f32[M, N] = x[M, K] . w[N, K]^T   (w float32, or bfloat16 as uint16 bits: then x is
//                           rounded to bfloat16 first, as XLA's dot of x.astype(bfloat16) does; or w packed once
//                           at load time, cpu_kernels.pack_weight)
//   jserve_argmax:          the first index of each row's maximum (the greedy sampler's argmax)
//   jserve_paged_attention: the spec of pallas_kernels/interface.py, with float32 q and out, K/V f32 or bf16 bits.
//   jserve_decoder_layers:  every Llama-family decoder layer (jserve/models/llama.py's DecoderLayer) in turn over a
//                           ragged batch: norm, qkv, q/k norm, rotary, the K/V write, attention, o, norm, gate/up,
//                           SiLU, down and both residuals; the K/V pages are updated in place (aliased to outputs).
//   JserveReadBandwidth:    (plain C, through ctypes) the memory's all-core read bandwidth, for the roofline
//   JserveHandedCalls:      (plain C) how many calls found a helper still lingering from the last (Lingerers)
//   JserveCachedLayerCalls: (plain C) how many layer calls ran the phases kept from the call before
//   JserveProfile*:         (plain C) the phase profile: each kind of phase's time running and waiting, per worker
//
// bfloat16 weights meet bfloat16 activations: with AVX512-BF16 (vdpbf16ps) the pairs multiply in hardware with
// float32 accumulation; elsewhere both are widened to float32 in registers (the same products, exactly).
//
// This file is the one translation unit: it includes every part, in the order they build on each other, and
// defines what the library exports. The parts:
//   common.h           headers, ISA switches, small helpers
//   profile.h          the phase profile
//   inline_function.h  std::function without the heap, for phase bodies
//   phases.h           parallel phases over XLA's pool, and the helpers that linger between calls
//   simd.h             vector helpers (bfloat16 conversions, row loads and stores, sums, exp)
//   matmul_job.h       the matmul job and its output stores
//   matmul_rows.h      few rows against plain weights (decode)
//   matmul_panels.h    many rows: panels packed per call, 6 x 16 register tiles
//   prefetch.h         the weight stream's prefetch distances (Intel and others)
//   matmul_blocks.h    tiles over one packed 32-column block
//   matmul_packed.h    weights packed at load time: row blocks, widened blocks, the matmul phases
//   matmul_int8.h      packed int8 weights with per-row scales, widened in registers
//   matmul.h           jserve_matmul
//   argmax.h           jserve_argmax
//   attention_rows.h   attention's inner loops over a page
//   attention.h        jserve_paged_attention
//   layer.h            the decoder layer's phases
//   layer_args.h       the layer call's operands
//   layer_call.h       jserve_decoder_layers, and the phases kept between calls
//   bandwidth.h        the read-bandwidth probe

#include "common.h"
#include "profile.h"
#include "inline_function.h"
#include "phases.h"
#include "simd.h"
#include "matmul_job.h"
#include "matmul_rows.h"
#include "matmul_panels.h"
#include "prefetch.h"
#include "matmul_blocks.h"
#include "matmul_packed.h"
#include "matmul_int8_vnni.h"
#include "matmul_int8.h"
#include "matmul.h"
#include "argmax.h"
#include "attention_rows.h"
#include "attention.h"
#include "layer.h"
#include "layer_args.h"
#include "layer_call.h"
#include "bandwidth.h"

// How many layer calls ran the phases their thread kept from the call before (LayerCallCache): its tests read it.
extern "C" int64_t JserveCachedLayerCalls() { return cached_layer_calls.load(std::memory_order_relaxed); }

// Whether int8 matmuls quantize x too (matmul_int8_vnni.h), at every row count where K allows.
extern "C" int64_t JserveInt8QuantizesActivations() {
#ifdef JSERVE_AVX512_VNNI
  return 1;
#else
  return 0;
#endif
}

// How many calls have handed their work to a lingering helper (Lingerers) in this process: its tests read it.
extern "C" int64_t JserveHandedCalls() { return TheLingerers().handed(); }

// The phase profile (PhaseProfile): switched on or off (either way zeroed), and read as nanoseconds into `out`:
// busy [workers][kinds], then wait [workers][kinds], then each kernel kind's call count, nanoseconds, and of those
// the nanoseconds before its phases began and after they ended.
extern "C" void JserveProfileEnable(int enable) {
  TheProfile().Reset();
  TheProfile().enabled.store(enable != 0);
}
extern "C" int64_t JserveProfileShape(int64_t* workers, int64_t* phase_kinds, int64_t* kernel_kinds) {
  *workers = PhaseProfile::kProfiledWorkers, *phase_kinds = kNumPhaseKinds, *kernel_kinds = kNumKernelKinds;
  return 2 * PhaseProfile::kProfiledWorkers * kNumPhaseKinds + 4 * kNumKernelKinds;
}
extern "C" void JserveProfileRead(int64_t* out) {
  PhaseProfile& profile = TheProfile();
  for (const auto& w : profile.workers)
    for (const auto& v : w.busy) *out++ = v.load(std::memory_order_relaxed);
  for (const auto& w : profile.workers)
    for (const auto& v : w.wait) *out++ = v.load(std::memory_order_relaxed);
  for (int k = 0; k < kNumKernelKinds; ++k) *out++ = profile.calls[k].load(std::memory_order_relaxed);
  for (int k = 0; k < kNumKernelKinds; ++k) *out++ = profile.call_ns[k].load(std::memory_order_relaxed);
  for (int k = 0; k < kNumKernelKinds; ++k) *out++ = profile.before_ns[k].load(std::memory_order_relaxed);
  for (int k = 0; k < kNumKernelKinds; ++k) *out++ = profile.after_ns[k].load(std::memory_order_relaxed);
}

// The memory's read bandwidth in bytes/s (ReadBandwidth).
extern "C" double JserveReadBandwidth(int64_t bytes, int64_t threads, int64_t repeats) {
  return ReadBandwidth(bytes, threads, repeats);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("int8_round"));  // int8 weights: x holds bfloat16 values

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveExpertMatmul, ExpertMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()           // [E, ...] packed weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // the expert's index, one value
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("int8_round"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales [N, B, Hkv] (int8 pages; else empty)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] (gpt-oss; else empty)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("attention_chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveDecoderLayers, DecoderLayersImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
                                  .RemainingArgs()                // 14 weights a layer (or stacked), then the pages
                                  .Ret<ffi::Buffer<ffi::F32>>()   // x_out
                                  .RemainingRets()                // the k_pages, then the v_pages (aliased)
                                  .Attr<int64_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("weight_parts")
                                  .Attr<int64_t>("intermediate_size")
                                  .Attr<int64_t>("int8_round")    // int8 weights: x rounded to bfloat16 values
                                  .Attr<int64_t>("activation"));  // 0: SiLU, 1: GELU (tanh)
