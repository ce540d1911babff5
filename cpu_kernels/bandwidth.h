#pragma once

// The memory's all-core read bandwidth (JserveReadBandwidth), the roofline of a decode step.

#include <sys/mman.h>

#include <cstdlib>
#include <thread>

#include "prefetch.h"
#include "simd.h"

namespace {

// The memory's read bandwidth, the bound of a decode step that reads every weight once (jserve bench latency's
// roofline): `threads` threads each sum their share of a `bytes` buffer on 2 MiB pages where the kernel gives
// them, as the parameters are (the loader's host arena); the best of `repeats` passes of plain loads and as many
// with the weight stream's prefetches (PrefetchAhead), in bytes/s. Both kinds of pass count because on Intel Xeons
// the prefetched reads are ~12% faster (32.6 against 29.2 GB/s over 1 GiB): plain loads alone understate the
// memory there.
double ReadBandwidth(int64_t bytes, int64_t threads, int64_t repeats) {
  constexpr size_t kHuge = 2 << 20;
  const size_t size = (static_cast<size_t>(bytes) + kHuge - 1) / kHuge * kHuge;
  threads = std::max<int64_t>(1, threads);
  char* buffer = static_cast<char*>(std::aligned_alloc(kHuge, size));
  if (buffer == nullptr) return 0.0;
  madvise(buffer, size, MADV_HUGEPAGE);
  std::memset(buffer, 1, size);  // fault every page in before timing
  const size_t share = size / static_cast<size_t>(threads) / 128 * 128;
  std::vector<float> sums(static_cast<size_t>(threads));  // kept, so the reads are not optimised away
  double best = 0.0;
  for (int64_t pass = 0; pass < 2 * repeats; ++pass) {
    const bool prefetch = pass % 2 == 1;
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        const float* p = reinterpret_cast<const float*>(buffer + static_cast<size_t>(t) * share);
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
        for (size_t i = 0; i < share / 4; i += 32) {
          if (prefetch) PrefetchAhead(p + i);  // this step's lines, as far ahead as the weight stream asks
          a = _mm256_add_ps(a, _mm256_load_ps(p + i));
          b = _mm256_add_ps(b, _mm256_load_ps(p + i + 8));
          c = _mm256_add_ps(c, _mm256_load_ps(p + i + 16));
          d = _mm256_add_ps(d, _mm256_load_ps(p + i + 24));
        }
        sums[t] = HorizontalSum(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
      });
    }
    for (std::thread& worker : workers) worker.join();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(share) * static_cast<double>(threads) / seconds);
  }
  std::free(buffer);
  volatile float keep = sums[0];  // the sums are used: the reads stay
  (void)keep;
  return best;
}

}  // namespace
