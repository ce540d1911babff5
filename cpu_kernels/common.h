#pragma once

// What every part of the kernels shares: the standard and XLA FFI headers, the ISA switches, and two small helpers.
//
// The parts are headers of one translation unit (kernels.cc includes them all), so the compiler sees every kernel
// at once, as it would one file: each header opens the same anonymous namespace.
//
// ISA switches, set by the compiler flags (cpu_kernels/__init__.py builds with -march=native):
//   (none)               AVX2 + FMA, the minimum (the Python side checks both before building)
//   __AVX512F__          the 16-lane tiles, the packed row blocks and attention's bfloat16 register paths
//   JSERVE_AVX512_BF16   vdpbf16ps for bfloat16 weights (AVX512-BF16 with AVX512-BW)
//   JSERVE_AVX512_VNNI   vpdpbusd for int8 weights times int8-quantized activations (AVX512-VNNI with AVX512-BW)
//   JSERVE_INTEL         set by the Python side on Intel CPUs: the weight stream's prefetch distances and hints,
//                        and the widened bfloat16 tiles (prefetch.h, matmul_packed.h)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JSERVE_AVX512_BF16 1
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JSERVE_AVX512_VNNI 1
#endif

namespace ffi = xla::ffi;

namespace {

// Items of `block` consecutive rows out of `rows`.
inline int64_t Blocks(int64_t rows, int64_t block) { return (rows + block - 1) / block; }

// bfloat16 as XLA passes it: BF16, or the uint16 bits the engine's CPU cache stores.
bool IsBf16Bits(ffi::DataType type) { return type == ffi::DataType::BF16 || type == ffi::DataType::U16; }

}  // namespace
