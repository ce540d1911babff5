// How much of the memory's read bandwidth one core reaches on its own, and whether software prefetches lift it.
// Where a core's own reads are capped at about half of what both cores read together, a core that is not streaming
// (waiting at a barrier, attending) leaves that half of the memory idle; where one core nearly saturates the memory,
// it does not (docs/benchmarks.md, sixteenth session).
//
//   g++ -O2 -march=native -std=c++17 -pthread benchmarks/core_bandwidth.cc -o /tmp/core_bandwidth
//   /tmp/core_bandwidth ROUNDS      # e.g. /tmp/core_bandwidth 200
//
// Each round reads a 256 MiB buffer on 2 MiB pages: with both threads (each a contiguous half, as
// cpu_kernels.read_bandwidth does), then with one thread plainly and with prefetches 2 KiB ahead of its loads
// (hints T0, T1, T2, NTA). Rounds are bucketed by the two threads' bandwidth (above 50 GB/s: the fast state), and each
// bucket prints the medians.
//
// Then it asks whether a core can fetch a stretch ahead of its use (while it would otherwise wait): one thread reads
// a 324 KiB stretch (a thread's part of the benchmark model's o matrix) cold, or 30 us after a loop of prefetches
// (T0) or of loads (one word a line) over it, and prints the median read times.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

// The loops' sums: a global the optimiser must assume is read elsewhere, so the loads stay.
float sink[2 * 16];

constexpr int kPlain = -1;  // no software prefetch
constexpr int kAhead = 2048;

template <int kHint>
void ReadShare(const char* p, size_t bytes, float* out) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i < bytes; i += 128) {
    if constexpr (kHint != kPlain) {
      _mm_prefetch(p + i + kAhead, static_cast<_mm_hint>(kHint));
      _mm_prefetch(p + i + kAhead + 64, static_cast<_mm_hint>(kHint));
    }
    const float* f = reinterpret_cast<const float*>(p + i);
    a = _mm256_add_ps(a, _mm256_load_ps(f));
    b = _mm256_add_ps(b, _mm256_load_ps(f + 8));
    c = _mm256_add_ps(c, _mm256_load_ps(f + 16));
    d = _mm256_add_ps(d, _mm256_load_ps(f + 24));
  }
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// GB/s of `threads` threads each reading its contiguous share of the buffer.
template <int kHint>
double Read(const char* buffer, size_t bytes, int threads) {
  const size_t share = bytes / threads / 4096 * 4096;
  const double start = Now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([=] { ReadShare<kHint>(buffer + t * share, share, sink + 16 * t); });
  }
  for (std::thread& worker : workers) worker.join();
  const double seconds = Now() - start;
  return static_cast<double>(share) * threads / seconds / 1e9;
}

// Microseconds to read `bytes` from p after asking for them beforehand as `how` says (0: not at all; 1: a loop of
// T0 prefetches, a line each; 2: a loop of loads, a word a line), then spinning 30 us.
double ReadAfter(const char* p, size_t bytes, int how) {
  unsigned touched = 0;
  for (size_t i = 0; how != 0 && i < bytes; i += 64) {
    if (how == 1) _mm_prefetch(p + i, _MM_HINT_T0);
    if (how == 2) touched += *reinterpret_cast<const volatile unsigned*>(p + i);
  }
  for (const double until = Now() + 30e-6; Now() < until;) _mm_pause();
  const double start = Now();
  ReadShare<kPlain>(p, bytes, sink);
  sink[8] = static_cast<float>(touched);
  return (Now() - start) * 1e6;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s ROUNDS\n", argv[0]);
    return 2;
  }
  const int rounds = std::atoi(argv[1]);
  constexpr size_t kBytes = 256 << 20, kHuge = 2 << 20;
  const size_t padded = kBytes + kHuge;  // room for the prefetches past the end
  char* buffer = static_cast<char*>(std::aligned_alloc(kHuge, padded));
  madvise(buffer, padded, MADV_HUGEPAGE);
  std::memset(buffer, 1, padded);
  constexpr int kColumns = 6;
  const char* names[kColumns] = {"2 threads", "1 thread", "1 thread T0", "1 thread T1", "1 thread T2", "1 thread NTA"};
  std::vector<double> fast[kColumns], slow[kColumns];
  for (int r = 0; r < rounds; ++r) {
    const double both = Read<kPlain>(buffer, kBytes, 2);
    const double row[kColumns] = {both,
                                  Read<kPlain>(buffer, kBytes, 1),
                                  Read<_MM_HINT_T0>(buffer, kBytes, 1),
                                  Read<_MM_HINT_T1>(buffer, kBytes, 1),
                                  Read<_MM_HINT_T2>(buffer, kBytes, 1),
                                  Read<_MM_HINT_NTA>(buffer, kBytes, 1)};
    for (int c = 0; c < kColumns; ++c) (both > 50 ? fast : slow)[c].push_back(row[c]);
  }
  for (int state = 0; state < 2; ++state) {
    const std::vector<double>* columns = state == 0 ? fast : slow;
    if (columns[0].empty()) continue;
    std::printf("%s state, %zu rounds, median GB/s:", state == 0 ? "fast" : "slow", columns[0].size());
    for (int c = 0; c < kColumns; ++c) std::printf("  %s %.1f", names[c], Median(columns[c]));
    std::printf("\n");
  }
  constexpr size_t kStretch = 324 << 10;
  std::vector<double> after[3];
  size_t offset = 0;
  for (int r = 0; r < 200; ++r) {
    for (int how = 0; how < 3; ++how) {
      offset = (offset + (7 << 20) + 4096) % (kBytes - kStretch) / 4096 * 4096;  // far from the last, cold
      after[how].push_back(ReadAfter(buffer + offset, kStretch, how));
    }
  }
  std::printf("324 KiB read in (median us): cold %.2f, after a prefetch loop %.2f, after a load loop %.2f\n",
              Median(after[0]), Median(after[1]), Median(after[2]));
  std::free(buffer);
  return 0;
}
