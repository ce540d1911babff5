// A batch-1 decode token's weight stream without the model: how fast two threads read the 135M benchmark model's
// packed bfloat16 weights (30 layers of qkv, o, gate_up and down, or LAYERS of them, then the LM head) in the order
// and split a decode step reads them, beside a plain read of the same bytes in the same round.
//
//   g++ -O3 -march=native -std=c++17 -pthread benchmarks/stream_sim.cc -o /tmp/stream_sim
//   /tmp/stream_sim LAYOUT BARRIERS ROUNDS [LAYERS]      # e.g. /tmp/stream_sim guided 1 60 75
//
// The prefetch is the kernels' default (non-temporal, 512 bytes ahead); -DPREFETCH_HINT=_MM_HINT_T0
// -DPREFETCH_BYTES=2048 -DFAR_PREFETCH_BYTES=8192 builds what kernels.cc does on Intel (JSERVE_INTEL): the second
// request goes into L2 (T2), that far ahead. -DSIDE_BY_SIDE_BLOCKS=2 builds kernels.cc's one-row loop on Intel (two
// blocks at a time), -DPLAIN_PREFETCH=1 gives the plain read the same prefetches (read_bandwidth's best pass, the
// roofline's reference), and -DLOADS_ONLY=1 drops vdpbf16ps from the tile loop (loads and adds only).
//
// LAYOUT says where each thread's share of a matrix lies and who reads it:
//   guided      each kind of weight one [layers, ...] stack (the loader's LayerStacks); items of shrinking runs of
//               32-column blocks claimed from a shared counter (the CPU kernels' PackedPhase for a few rows)
//   halves      the same stacks; thread t reads the t-th half of every matrix
//   steal       the same stacks; each thread reads its half from the front, then takes blocks from the back of the
//               other's
//   per-thread  each thread's half of every matrix in one region of its own, in the order it reads them
//   zigzag      every matrix whole, one after another in the order they are read (a layer's four together);
//               thread t reads half t of even matrices and the other half of odd ones, so that every other step
//               from one matrix to the next continues its stream where it ended
// BARRIERS 1: both threads wait for each other after every matrix (a decode step's data dependencies); 0: never.
//
// Each round reads the whole buffer once plainly (each thread a contiguous half, as cpu_kernels.read_bandwidth's
// plain passes do) and then once as LAYOUT says; both threads run the same tile loop as the kernels' one-row tile
// (vdpbf16ps with the prefetches above; plain loads where the CPU has no AVX512-BF16). Rounds are bucketed by the
// plain read's bandwidth (above 50 GB/s: the fast state of docs/benchmarks.md), and each bucket prints the median
// pass / plain-read ratio and the threads' median wait at barriers.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

// The loops' sums, one cache line a thread: a global the optimiser must assume is read elsewhere, so the loads stay.
float sink[2 * 16];

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kThreads = 2;
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 512
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_NTA
#endif
#ifndef FAR_PREFETCH_BYTES
#define FAR_PREFETCH_BYTES 0
#endif
constexpr int64_t kPrefetchBytes = PREFETCH_BYTES;
constexpr int64_t kFarPrefetchBytes = FAR_PREFETCH_BYTES;
#ifndef LOADS_ONLY
#define LOADS_ONLY 0  // 1: the tile loop only loads and adds (the AVX2 loop), to part the memory from vdpbf16ps
#endif
#ifndef PLAIN_PREFETCH
#define PLAIN_PREFETCH 0
#endif
// 1: the plain read carries the same prefetches, as read_bandwidth's prefetched passes (the roofline takes the best).
constexpr bool kPlainPrefetch = PLAIN_PREFETCH != 0;

// The kernels' PrefetchAhead: the two lines at `at` + kPrefetchBytes, and where asked the two kFarPrefetchBytes ahead.
inline void PrefetchAhead(const char* at) {
  _mm_prefetch(at + kPrefetchBytes, PREFETCH_HINT);
  _mm_prefetch(at + kPrefetchBytes + 64, PREFETCH_HINT);
  if constexpr (kFarPrefetchBytes > 0) {
    _mm_prefetch(at + kFarPrefetchBytes, _MM_HINT_T2);
    _mm_prefetch(at + kFarPrefetchBytes + 64, _MM_HINT_T2);
  }
}
static_assert(kThreads * 16 <= static_cast<int>(sizeof(sink) / sizeof(sink[0])));

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

#ifndef SIDE_BY_SIDE_BLOCKS
#define SIDE_BY_SIDE_BLOCKS 1  // 2: where a thread reads blocks in order, two at a time, as kernels.cc's RowBlockSet
#endif

// kBlocks packed 32-column blocks read side by side (each k / 2 pairs of k, 128 bytes each: two 16-column halves),
// times one row of x: two accumulator chains a block, each column's sum in the same order whatever kBlocks.
template <int kBlocks>
void BlockSet(const char* const (&blocks)[kBlocks], int64_t k, const uint16_t* x, int t) {
#if defined(__AVX512BF16__) && !LOADS_ONLY
  __m512 acc[kBlocks][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * kp, sizeof(pair));
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
    for (int i = 0; i < kBlocks; ++i) {
      const float* w = reinterpret_cast<const float*>(blocks[i] + kp * 128);
      PrefetchAhead(reinterpret_cast<const char*>(w));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, reinterpret_cast<__m512bh>(_mm512_loadu_ps(w)));
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, reinterpret_cast<__m512bh>(_mm512_loadu_ps(w + 16)));
    }
  }
  __m512 sum = _mm512_setzero_ps();
  for (const auto& a : acc) sum = _mm512_add_ps(sum, _mm512_add_ps(a[0], a[1]));
  float out[16];
  _mm512_storeu_ps(out, sum);
  sink[t * 16] += out[0];
#else
  __m256 acc[kBlocks][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    for (int i = 0; i < kBlocks; ++i) {
      const float* w = reinterpret_cast<const float*>(blocks[i] + kp * 128);
      PrefetchAhead(reinterpret_cast<const char*>(w));
      acc[i][0] = _mm256_add_ps(_mm256_add_ps(acc[i][0], _mm256_loadu_ps(w)), _mm256_loadu_ps(w + 8));
      acc[i][1] = _mm256_add_ps(_mm256_add_ps(acc[i][1], _mm256_loadu_ps(w + 16)), _mm256_loadu_ps(w + 24));
    }
  }
  __m256 sum = _mm256_setzero_ps();
  for (const auto& a : acc) sum = _mm256_add_ps(sum, _mm256_add_ps(a[0], a[1]));
  float out[8];
  _mm256_storeu_ps(out, sum);
  sink[t * 16] += out[0] + static_cast<float>(x[0]);
#endif
}

void Block(const char* block, int64_t k, const uint16_t* x, int t) { BlockSet<1>({block}, k, x, t); }

// The plain read: four 32-byte loads a 128 bytes, no prefetch unless PLAIN_PREFETCH. The same loop as cpu_kernels'
// JserveReadBandwidth (the roofline's reference), copied because this program builds alone, without XLA's FFI headers.
void PlainRead(const char* p, size_t bytes, int t) {
  const float* f = reinterpret_cast<const float*>(p);
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i < bytes / 4; i += 32) {
    if constexpr (kPlainPrefetch) PrefetchAhead(reinterpret_cast<const char*>(f + i));
    a = _mm256_add_ps(a, _mm256_load_ps(f + i));
    b = _mm256_add_ps(b, _mm256_load_ps(f + i + 8));
    c = _mm256_add_ps(c, _mm256_load_ps(f + i + 16));
    d = _mm256_add_ps(d, _mm256_load_ps(f + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  sink[t * 16] += out[0];
}

struct Barrier {
  std::atomic<int> count{0}, generation{0};
  void Wait() {
    const int g = generation.load(std::memory_order_acquire);
    if (count.fetch_add(1) + 1 == kThreads) {
      count.store(0);
      generation.fetch_add(1, std::memory_order_release);
    } else {
      while (generation.load(std::memory_order_acquire) == g) _mm_pause();
    }
  }
};

struct Matrix {
  int64_t blocks, k;                  // 32-column blocks, and the reduction size
  std::vector<const char*> block_at;  // where each block lies under the layout
};

// Claims one block of a half packed as (front << 32 | back): the owner from the front, a thief from the back.
int64_t Claim(std::atomic<uint64_t>& half, bool front) {
  uint64_t v = half.load();
  while (true) {
    const uint64_t f = v >> 32, b = v & 0xffffffffu;
    if (f >= b) return -1;
    const uint64_t next = front ? ((f + 1) << 32 | b) : (f << 32 | (b - 1));
    if (half.compare_exchange_weak(v, next)) return static_cast<int64_t>(front ? f : b - 1);
  }
}

int64_t Median(std::vector<double> v, double* out) {
  std::sort(v.begin(), v.end());
  *out = v.empty() ? 0.0 : v[v.size() / 2];
  return static_cast<int64_t>(v.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s guided|halves|steal|per-thread|zigzag BARRIERS(0|1) ROUNDS [LAYERS]\n", argv[0]);
    return 2;
  }
  const std::string layout = argv[1];
  const bool barriers = std::atoi(argv[2]) != 0;
  const int rounds = std::atoi(argv[3]);
  // 30: the 135M model, about the size of some CPUs' L3; 75 read 588 MB, more than the development machines' L3.
  const int num_layers = argc > 4 ? std::atoi(argv[4]) : 30;
  if (num_layers < 1) {
    std::fprintf(stderr, "LAYERS must be a positive count, not %s\n", argv[4]);
    return 2;
  }
  if (layout != "guided" && layout != "halves" && layout != "steal" && layout != "per-thread" && layout != "zigzag") {
    std::fprintf(stderr, "unknown layout %s\n", layout.c_str());
    return 2;
  }
  // [out, in] of each kind, as the 135M benchmark model's; the LM head reads last.
  const int64_t kinds[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  const int64_t head[2] = {49152, 576};
  auto bytes_of = [](int64_t n, int64_t k) { return n * k * 2; };
  size_t total = bytes_of(head[0], head[1]);
  for (const auto& kind : kinds) total += num_layers * bytes_of(kind[0], kind[1]);
  const size_t huge = 2 << 20, mapped = (total + huge - 1) / huge * huge + huge;
  char* base = static_cast<char*>(std::aligned_alloc(huge, mapped));
  madvise(base, mapped, MADV_HUGEPAGE);
  std::memset(base, 1, mapped);

  // Matrices in the order a token reads them, and where each block lies.
  std::vector<Matrix> order;
  for (int l = 0; l <= num_layers; ++l) {
    for (int m = 0; m < 4 && !(l == num_layers && m > 0); ++m) {
      const int64_t n = l == num_layers ? head[0] : kinds[m][0], k = l == num_layers ? head[1] : kinds[m][1];
      order.push_back({n / 32, k, std::vector<const char*>(static_cast<size_t>(n / 32))});
    }
  }
  if (layout == "per-thread") {
    size_t cursor[kThreads] = {0, total / kThreads};
    for (Matrix& matrix : order) {
      for (int t = 0; t < kThreads; ++t) {
        for (int64_t b = matrix.blocks * t / kThreads; b < matrix.blocks * (t + 1) / kThreads; ++b) {
          matrix.block_at[b] = base + cursor[t];
          cursor[t] += 64 * matrix.k;
        }
      }
    }
  } else if (layout == "zigzag") {
    size_t cursor = 0;
    for (Matrix& matrix : order) {
      for (int64_t b = 0; b < matrix.blocks; ++b) matrix.block_at[b] = base + cursor + b * 64 * matrix.k;
      cursor += matrix.blocks * 64 * matrix.k;
    }
  } else {  // stacks: kind m of layer l at stack m, slice l; the LM head after them
    size_t stack[5] = {0, 0, 0, 0, 0};
    for (int m = 1; m <= 4; ++m) stack[m] = stack[m - 1] + num_layers * bytes_of(kinds[m - 1][0], kinds[m - 1][1]);
    for (size_t i = 0; i < order.size(); ++i) {
      const int l = static_cast<int>(i / 4), m = static_cast<int>(i % 4);
      const size_t start = l == num_layers ? stack[4] : stack[m] + l * bytes_of(kinds[m][0], kinds[m][1]);
      for (int64_t b = 0; b < order[i].blocks; ++b) order[i].block_at[b] = base + start + b * 64 * order[i].k;
    }
  }
  // Guided items: runs of ceil(remaining / (2 * threads)) blocks, as the kernels' RunsOf.
  std::vector<std::vector<int64_t>> runs(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    for (int64_t u = 0; u < order[i].blocks;) {
      runs[i].push_back(u);
      u += std::max<int64_t>(1, (order[i].blocks - u + 2 * kThreads - 1) / (2 * kThreads));
    }
    runs[i].push_back(order[i].blocks);
  }
  std::vector<std::atomic<int64_t>> next_item(order.size());
  std::vector<std::atomic<uint64_t>> halves(order.size() * kThreads);
  alignas(64) uint16_t x[2048];
  for (uint16_t& v : x) v = 0x3f80;  // 1.0

  Barrier barrier;
  std::vector<double> plain_gbs(rounds), pass_gbs(rounds), waits[kThreads];
  for (auto& w : waits) w.assign(rounds, 0.0);
  auto worker = [&](int t) {
    for (int r = 0; r < rounds; ++r) {
      barrier.Wait();
      if (t == 0) {  // reset the claims; the other thread is in the plain read and touches none
        for (auto& n : next_item) n.store(0);
        for (size_t i = 0; i < order.size(); ++i)
          for (int h = 0; h < kThreads; ++h)
            halves[i * kThreads + h].store(static_cast<uint64_t>(order[i].blocks * h / kThreads) << 32 |
                                           static_cast<uint64_t>(order[i].blocks * (h + 1) / kThreads));
      }
      const auto t0 = Clock::now();
      const size_t share = total / kThreads / 128 * 128;
      PlainRead(base + t * share, share, t);
      barrier.Wait();
      const auto t1 = Clock::now();
      double waited = 0.0;
      for (size_t i = 0; i < order.size(); ++i) {
        const Matrix& matrix = order[i];
        if (layout == "guided") {
          const int64_t items = static_cast<int64_t>(runs[i].size()) - 1;
          for (int64_t item = next_item[i].fetch_add(1); item < items; item = next_item[i].fetch_add(1))
            for (int64_t b = runs[i][item]; b < runs[i][item + 1]; ++b) Block(matrix.block_at[b], matrix.k, x, t);
        } else if (layout == "steal") {
          for (int64_t b; (b = Claim(halves[i * kThreads + t], true)) >= 0;) Block(matrix.block_at[b], matrix.k, x, t);
          for (int64_t b; (b = Claim(halves[i * kThreads + (t + 1) % kThreads], false)) >= 0;)
            Block(matrix.block_at[b], matrix.k, x, t);
        } else {
          const int half = layout == "zigzag" && i % 2 == 1 ? kThreads - 1 - t : t;
          const int64_t end = matrix.blocks * (half + 1) / kThreads;
          int64_t b = matrix.blocks * half / kThreads;
          if constexpr (SIDE_BY_SIDE_BLOCKS == 2) {
            for (; b + 1 < end; b += 2) BlockSet<2>({matrix.block_at[b], matrix.block_at[b + 1]}, matrix.k, x, t);
          }
          for (; b < end; ++b) Block(matrix.block_at[b], matrix.k, x, t);
        }
        if (barriers) {
          const auto w0 = Clock::now();
          barrier.Wait();
          waited += Seconds(w0, Clock::now());
        }
      }
      barrier.Wait();
      waits[t][r] = waited * 1e3;
      if (t == 0) {
        plain_gbs[r] = total / Seconds(t0, t1) / 1e9;
        pass_gbs[r] = total / Seconds(t1, Clock::now()) / 1e9;
      }
    }
  };
  std::thread helper(worker, 1);
  worker(0);
  helper.join();

  for (const bool fast : {true, false}) {
    std::vector<double> plain, pass, ratio, wait0, wait1;
    for (int r = 0; r < rounds; ++r) {
      if ((plain_gbs[r] > 50.0) != fast) continue;
      plain.push_back(plain_gbs[r]);
      pass.push_back(pass_gbs[r]);
      ratio.push_back(pass_gbs[r] / plain_gbs[r]);
      wait0.push_back(waits[0][r]);
      wait1.push_back(waits[1][r]);
    }
    double p, q, ra, w0, w1;
    const int64_t n = Median(plain, &p);
    Median(pass, &q);
    Median(ratio, &ra);
    Median(wait0, &w0);
    Median(wait1, &w1);
    if (n > 0) {
      std::printf("%s %s barriers=%d: %s state, %lld rounds: plain read %.1f GB/s, pass %.1f GB/s, ratio %.3f, "
                  "waits %.2f / %.2f ms\n", argv[0], layout.c_str(), barriers ? 1 : 0, fast ? "fast" : "slow",
                  static_cast<long long>(n), p, q, ra, w0, w1);
    }
  }
  return 0;
}
