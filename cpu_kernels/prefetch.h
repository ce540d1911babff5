#pragma once

// The weight stream's software prefetch (PrefetchAhead). At each k (or pair of k), a bandwidth-bound tile (up to
// kWideRows rows of x), a decode row block and the bandwidth probe request the two lines kWidePrefetchBytes ahead;
// the packed blocks are one forward stream, so near a block's end this reaches into the next.
//
// Other vendors: non-temporal, 512 bytes ahead. On an AVX2 EPYC this makes batch-1 float32 decode ~8% faster
// (384-768 bytes do as well; 1024 is slower than no prefetch), and on an AVX-512 EPYC (Zen 4) batch-1 bfloat16
// decode ~7% faster, float32 level; T0 hints at 512-2048 bytes gain less, T1 at 1024-2048 bytes as much.
//
// Intel (JSERVE_INTEL, which cpu_kernels sets where the CPU's vendor is Intel): there a non-temporal prefetch fills
// L1 alone and halves one core's stream (8.4 against 14.9 GB/s plain, 16.5 with T0), so the requests are T0, 2 KiB
// ahead, at which two threads read the packed weights at the memory's full bandwidth (0.72 of it non-temporal). A
// second request, into L2 (T2) 8 KiB ahead, keeps more lines in flight, presumably more than L1's fill buffers
// hold: with it the one-row vdpbf16ps loop (8 cycles a pair of k on its accumulator chain there) reads 1.10-1.13x as
// fast as plain loads, against 1.01x with T0 alone.

#include "common.h"

namespace {

#ifdef JSERVE_INTEL
constexpr int64_t kWidePrefetchBytes = 2048;
constexpr auto kWidePrefetchHint = _MM_HINT_T0;
constexpr int64_t kFarPrefetchBytes = 8192;
#else
constexpr int64_t kWidePrefetchBytes = 512;
constexpr auto kWidePrefetchHint = _MM_HINT_NTA;
constexpr int64_t kFarPrefetchBytes = 0;
#endif
inline void PrefetchAhead(const void* at) {
  const char* ahead = static_cast<const char*>(at) + kWidePrefetchBytes;
  _mm_prefetch(ahead, kWidePrefetchHint);
  _mm_prefetch(ahead + 64, kWidePrefetchHint);
  if constexpr (kFarPrefetchBytes > 0) {
    const char* far = static_cast<const char*>(at) + kFarPrefetchBytes;
    _mm_prefetch(far, _MM_HINT_T2);
    _mm_prefetch(far + 64, _MM_HINT_T2);
  }
}

}  // namespace
