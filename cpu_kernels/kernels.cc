// jserve's CPU kernels, called from jitted JAX code through XLA's FFI (cpu_kernels/__init__.py builds this file).
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
//   JserveProfile*:         (plain C) the phase profile: each kind of phase's time running and waiting, per worker
//
// bfloat16 weights meet bfloat16 activations: with AVX512-BF16 (vdpbf16ps) the pairs multiply in hardware with
// float32 accumulation; elsewhere both are widened to float32 in registers (the same products, exactly).

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
#include <thread>
#include <type_traits>
#include <vector>

#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JSERVE_AVX512_BF16 1
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Parallel phases over XLA's intra-op pool. A call is a list of phases run in order; each phase is `count`
// independent items claimed from a shared counter by the caller and by helper tasks on the pool, and a phase starts
// once every item of the one before is done. The caller works too and then waits only for items another thread
// has already claimed, so a helper that never gets a thread (or starts after the call returned) cannot block or
// touch freed memory: it finds no item left and returns. One helper wake-up serves every phase of a call, and a
// helper then lingers (Lingerers) so that the next call, a millisecond later in a decode step, needs none.

// What a phase does, for the profile (cpu_kernels.phase_profile): each step of the layer kernel, and "other" for
// the other kernels' phases. The order is cpu_kernels.PHASE_KINDS'.
enum PhaseKind : int {
  kOtherPhase, kQkvPhase, kRotaryPhase, kAttentionPhase, kMergePhase, kOPhase, kGateUpPhase, kDownPhase,
  kInputPhase,  // a norm or the SiLU as a phase of its own (not made by each owned matmul item)
  kNumPhaseKinds
};

// The kernels' kinds of call, for the profile (cpu_kernels.PROFILED_KERNELS' order).
enum KernelKind : int { kLayersCall, kMatmulCall, kArgmaxCall, kAttentionCall, kNumKernelKinds };

// Nanoseconds each worker index spent running each kind of phase's items and waiting for other threads' items of
// it, and each kind of call's count and nanoseconds: off unless cpu_kernels.profile_phases(True), and then a call
// pays a relaxed load per thread that runs it and a null test a phase. Workers past kProfiledWorkers are not counted.
class PhaseProfile {
 public:
  static constexpr int64_t kProfiledWorkers = 64;
  struct alignas(64) Worker {
    std::atomic<int64_t> busy[kNumPhaseKinds];
    std::atomic<int64_t> wait[kNumPhaseKinds];
  };
  std::atomic<bool> enabled{false};
  Worker workers[kProfiledWorkers] = {};
  std::atomic<int64_t> calls[kNumKernelKinds] = {}, call_ns[kNumKernelKinds] = {};
  // Of call_ns: before the call's phases began (its setup) and after they ended (its return), on the calling thread
  std::atomic<int64_t> before_ns[kNumKernelKinds] = {}, after_ns[kNumKernelKinds] = {};

  Worker* Of(int64_t worker) {
    return enabled.load(std::memory_order_relaxed) && worker < kProfiledWorkers ? &workers[worker] : nullptr;
  }
  void Reset() {
    for (Worker& w : workers)
      for (int k = 0; k < kNumPhaseKinds; ++k) w.busy[k] = 0, w.wait[k] = 0;
    for (int k = 0; k < kNumKernelKinds; ++k) calls[k] = 0, call_ns[k] = 0, before_ns[k] = 0, after_ns[k] = 0;
  }
};

PhaseProfile& TheProfile() {
  static PhaseProfile* profile = new PhaseProfile;  // never destroyed: a lingering helper may still count at exit
  return *profile;
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A worker's clock for the profile: each Ran / Waited adds the time since the last to a phase kind's running or
// waiting time. Nothing while the profile is off.
class PhaseClock {
 public:
  explicit PhaseClock(int64_t worker) : counts_(TheProfile().Of(worker)), last_(counts_ ? NowNs() : 0) {}
  void Ran(int kind) { if (counts_) Add(counts_->busy[kind]); }
  void Waited(int kind) { if (counts_) Add(counts_->wait[kind]); }

 private:
  void Add(std::atomic<int64_t>& to) {
    const int64_t now = NowNs();
    to.fetch_add(now - last_, std::memory_order_relaxed);
    last_ = now;
  }
  PhaseProfile::Worker* counts_;
  int64_t last_;
};

// When the calling thread's last RunPhases began and ended (for CallClock; 0: not profiled).
thread_local int64_t phases_began = 0, phases_ended = 0;

// Counts a kernel call and its time in the profile, from construction to destruction.
class CallClock {
 public:
  explicit CallClock(KernelKind kind)
      : kind_(kind), start_(TheProfile().enabled.load(std::memory_order_relaxed) ? NowNs() : 0) {}
  ~CallClock() {
    if (start_ == 0) return;
    const int64_t end = NowNs();
    PhaseProfile& profile = TheProfile();
    profile.calls[kind_].fetch_add(1, std::memory_order_relaxed);
    profile.call_ns[kind_].fetch_add(end - start_, std::memory_order_relaxed);
    if (phases_began >= start_ && phases_ended >= phases_began) {  // its phases ran (not an invalid argument)
      profile.before_ns[kind_].fetch_add(phases_began - start_, std::memory_order_relaxed);
      profile.after_ns[kind_].fetch_add(end - phases_ended, std::memory_order_relaxed);
    }
  }

 private:
  KernelKind kind_;
  int64_t start_;
};

// A callable with its captures stored in place, never on the heap: a layer call builds ~200 phases, and freeing
// std::function's allocations (three an owned matmul phase) cost the caller ~23 us a call where the memory reads
// ~65 GB/s (~2 us in place: docs/benchmarks.md, seventeenth session). A capture too large for `Bytes` fails to
// compile.
template <typename Signature, size_t Bytes>
class InlineFunction;

template <typename R, typename... Args, size_t Bytes>
class InlineFunction<R(Args...), Bytes> {
 public:
  InlineFunction() = default;
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, InlineFunction>>>
  InlineFunction(F f) {  // NOLINT: implicit, as std::function's
    static_assert(sizeof(F) <= Bytes && alignof(F) <= alignof(std::max_align_t), "captures too large");
    new (storage_) F(std::move(f));
    call_ = [](const void* at, Args... args) -> R { return (*static_cast<const F*>(at))(args...); };
    if constexpr (!std::is_trivially_copyable_v<F> || !std::is_trivially_destructible_v<F>) {
      manage_ = [](void* to, const void* from) {  // copies `from` into `to`; with no `from`, destroys `to`
        if (from != nullptr) {
          new (to) F(*static_cast<const F*>(from));
        } else {
          static_cast<F*>(to)->~F();
        }
      };
    }
  }
  InlineFunction(const InlineFunction& other) { CopyFrom(other); }
  InlineFunction& operator=(const InlineFunction& other) {
    if (this != &other) {
      Reset();
      CopyFrom(other);
    }
    return *this;
  }
  ~InlineFunction() { Reset(); }

  R operator()(Args... args) const { return call_(storage_, args...); }
  explicit operator bool() const { return call_ != nullptr; }

 private:
  void CopyFrom(const InlineFunction& other) {
    call_ = other.call_, manage_ = other.manage_;
    if (manage_ != nullptr) {
      manage_(storage_, other.storage_);
    } else {
      std::memcpy(storage_, other.storage_, Bytes);
    }
  }
  void Reset() {
    if (manage_ != nullptr) manage_(storage_, nullptr);
    call_ = nullptr, manage_ = nullptr;
  }
  alignas(std::max_align_t) unsigned char storage_[Bytes];
  R (*call_)(const void*, Args...) = nullptr;
  void (*manage_)(void*, const void*) = nullptr;  // nullptr: the captures are copied and dropped as bytes
};

struct Phase {
  int64_t count;
  InlineFunction<void(int64_t), 160> body;
  // Item i is worker i's own (count <= 64): each worker runs its own first, then any other not yet started (the
  // caller takes what a helper never gets to). For per-thread weight parts, each read by the thread it was laid
  // out for (see BlockParts).
  bool owned = false;
  int kind = kOtherPhase;  // PhaseKind
};

// A list of phases, shared: a layer call's may be the one the thread's call before built (LayerCallCache).
using SharedPhases = std::shared_ptr<const std::vector<Phase>>;

struct PhaseState {
  SharedPhases shared;
  const std::vector<Phase>& phases;
  std::unique_ptr<std::atomic<int64_t>[]> next, done;  // owned phases: `next` is a mask of the items started

  explicit PhaseState(SharedPhases p)
      : shared(std::move(p)),
        phases(*shared),
        next(new std::atomic<int64_t>[phases.size()]),
        done(new std::atomic<int64_t>[phases.size()]) {
    for (size_t i = 0; i < phases.size(); ++i) next[i] = 0, done[i] = 0;
  }

  void WaitFor(size_t p) const {
    while (done[p].load(std::memory_order_acquire) < phases[p].count) _mm_pause();
  }

  void Run(size_t p, int64_t i) {
    phases[p].body(i);
    done[p].fetch_add(1, std::memory_order_release);
  }

  void Work(int64_t worker) {
    PhaseClock clock(worker);
    for (size_t p = 0; p < phases.size(); ++p) {
      if (p > 0) {
        clock.Ran(phases[p - 1].kind);
        WaitFor(p - 1);
        clock.Waited(phases[p - 1].kind);
      }
      const int64_t count = phases[p].count;
      if (phases[p].owned) {
        for (int64_t k = 0; k < count; ++k) {
          const int64_t i = (worker + k) % count;
          if ((next[p].fetch_or(int64_t{1} << i) >> i & 1) == 0) Run(p, i);
        }
        continue;
      }
      for (int64_t i = next[p].fetch_add(1); i < count; i = next[p].fetch_add(1)) Run(p, i);
    }
    if (!phases.empty()) clock.Ran(phases.back().kind);
  }
};

// Helpers that stay a while after a call, each as one worker index: the next call hands its work to one directly.
// Waking a pool thread that has gone to sleep cost the caller ~90 us in this VM (docs/benchmarks.md), once for every
// layer call of a decode step. The spin is bounded (kLinger), so an idle process goes back to sleeping threads.
class Lingerers {
 public:
  // True if a lingering helper took the work as worker t (else the caller schedules it on the pool).
  bool Hand(int64_t t, const std::shared_ptr<PhaseState>& state) {
    if (t >= kMaxWorkers) return false;
    Slot& slot = slots_[t];
    int waiting = kWaiting;
    if (!slot.status.compare_exchange_strong(waiting, kClaimed, std::memory_order_acq_rel)) return false;
    slot.work.store(new std::shared_ptr<PhaseState>(state), std::memory_order_release);
    handed_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // Run by a pool task after its work as worker t: takes any work handed to worker t until kLinger passes without
  // one. At most one helper lingers as each worker index; any other returns at once.
  void Linger(int64_t t) {
    if (t >= kMaxWorkers) return;
    Slot& slot = slots_[t];
    int away = kAway;
    if (!slot.status.compare_exchange_strong(away, kWaiting, std::memory_order_acq_rel)) return;
    auto deadline = std::chrono::steady_clock::now() + kLinger;
    for (int64_t spins = 1;; ++spins) {
      // Read before exchanging: the spin only reads the line the caller writes to.
      std::shared_ptr<PhaseState>* work = slot.work.load(std::memory_order_relaxed);
      if (work != nullptr && (work = slot.work.exchange(nullptr, std::memory_order_acquire)) != nullptr) {
        (*work)->Work(t);
        delete work;
        slot.status.store(kWaiting, std::memory_order_release);
        deadline = std::chrono::steady_clock::now() + kLinger;
        continue;
      }
      if (spins % 64 == 0 && std::chrono::steady_clock::now() >= deadline) {
        int waiting = kWaiting;
        if (slot.status.compare_exchange_strong(waiting, kAway, std::memory_order_acq_rel)) return;
        // Claimed meanwhile: its work is on the way.
      }
      _mm_pause();
    }
  }

  int64_t handed() const { return handed_.load(std::memory_order_relaxed); }

 private:
  static constexpr int64_t kMaxWorkers = 64;
  static constexpr std::chrono::microseconds kLinger{1000};
  enum : int { kAway, kWaiting, kClaimed };
  struct alignas(64) Slot {
    std::atomic<int> status{kAway};
    std::atomic<std::shared_ptr<PhaseState>*> work{nullptr};
  };
  Slot slots_[kMaxWorkers];
  std::atomic<int64_t> handed_{0};
};

Lingerers& TheLingerers() {
  static Lingerers* lingerers = new Lingerers;  // never destroyed: a pool thread may still linger at exit
  return *lingerers;
}

void RunPhases(ffi::ThreadPool& pool, SharedPhases shared) {
  const std::vector<Phase>& phases = *shared;
  int64_t widest = 0;
  for (const Phase& p : phases) widest = std::max(widest, p.count);
  const int64_t threads = std::min<int64_t>(pool.num_threads(), widest);
  const bool profiled = TheProfile().enabled.load(std::memory_order_relaxed);
  if (threads <= 1) {
    if (profiled) phases_began = NowNs();
    PhaseClock clock(0);
    for (const Phase& p : phases) {
      for (int64_t i = 0; i < p.count; ++i) p.body(i);
      clock.Ran(p.kind);
    }
    if (profiled) phases_ended = NowNs();
    return;
  }
  auto state = std::make_shared<PhaseState>(std::move(shared));
  for (int64_t t = 1; t < threads; ++t) {
    if (TheLingerers().Hand(t, state)) continue;
    pool.Schedule([state, t] {
      state->Work(t);
      TheLingerers().Linger(t);
    });
  }
  if (profiled) phases_began = NowNs();
  state->Work(0);
  PhaseClock clock(0);
  state->WaitFor(state->phases.size() - 1);
  clock.Waited(state->phases.back().kind);
  if (profiled) phases_ended = NowNs();
}

void RunPhases(ffi::ThreadPool& pool, std::vector<Phase> phases) {
  RunPhases(pool, std::make_shared<const std::vector<Phase>>(std::move(phases)));
}

// Items of `block` consecutive rows out of `rows`.
inline int64_t Blocks(int64_t rows, int64_t block) { return (rows + block - 1) / block; }

// ---------------------------------------------------------------------------------------------------------------
// Vector helpers (AVX2 + FMA at least; the file is compiled with -march=native, and the Python side checks both).

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest even, NaN kept quiet: what XLA's float32 -> bfloat16 convert does.
inline uint16_t FloatToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m128i FloatToBf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  return _mm256_castsi256_si128(packed);
}

// Eight bfloat16 values (their bits) as eight floats: bfloat16 is the top half of a float32.
inline __m256 LoadBf16x8(const uint16_t* p) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight values as floats: float32 loaded as is, bfloat16 bits (uint16) widened in registers.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return LoadBf16x8(p); }
inline float Load1(const float* p) { return *p; }
inline float Load1(const uint16_t* p) { return Bf16ToFloat(*p); }

// A row of float32 results stored as the next op's input: as is, or rounded to bfloat16 bits.
inline void StoreRow(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }
inline void StoreRow(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), FloatToBf16x8(_mm256_loadu_ps(src + i)));
  }
  for (; i < n; ++i) dst[i] = FloatToBf16(src[i]);
}

// A row stored as a bfloat16 weight's matmul input on a CPU without AVX512-BF16: rounded to bfloat16 and kept as
// float32 (the same values), so the matmuls widen only the weight, not every row of x again for every weight row.
inline void StoreRoundedRow(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = FloatToBf16x8(_mm256_loadu_ps(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
  }
  for (; i < n; ++i) dst[i] = Bf16ToFloat(FloatToBf16(src[i]));
}

// A matmul input row: bfloat16 bits (StoreRow rounds), or float32, rounded to bfloat16 values when `round`.
inline void StoreInput(uint16_t* dst, const float* src, int64_t n, bool) { StoreRow(dst, src, n); }
inline void StoreInput(float* dst, const float* src, int64_t n, bool round) {
  if (round) {
    StoreRoundedRow(dst, src, n);
  } else {
    StoreRow(dst, src, n);
  }
}

// What bfloat16 weights take as x: bfloat16 bits for vdpbf16ps, else float32 holding bfloat16 values.
#ifdef JSERVE_AVX512_BF16
using Bf16Input = uint16_t;
#else
using Bf16Input = float;
#endif

// ---------------------------------------------------------------------------------------------------------------
// Matmul y[M, N] (op)= x[M, K] . w[N, K]^T (+ bias[N]). X and W are float (float32 weights) or uint16_t (bfloat16
// weights, with x already rounded to bfloat16). `accumulate` adds the result to y (a residual connection).

// A packed weight whose blocks lie in parts at separate addresses (cpu_kernels.PartLayout): part p holds
// blocks [begin[p], begin[p + 1]) from base[p] + offset. Each kernel thread's parts of every layer lie one after
// another, so the thread's share of a step is one forward stream: where the memory reads ~60 GB/s with both cores
// streaming, the matmuls read at only 0.6-0.75 of it from shared [layers, ...] stacks, and ~0.94 from such streams
// (stream_sim.cc). Every layer's parts of a matrix share `begin` and `base` (layer 0's); `offset` moves to its own.
struct BlockParts {
  int64_t parts;
  const int64_t* begin;      // [parts + 1]
  const float* const* base;  // [parts]
  int64_t offset;            // 4-byte units from layer 0's parts to this layer's
};

template <typename X, typename W>
struct MatmulJob {
  const X* x;
  const W* w;  // packed weights with `parts`: unused
  float* y;
  const float* bias;  // nullptr: none
  bool accumulate;
  int64_t m_size, n_size, k_size;
  const BlockParts* parts = nullptr;  // packed weights only: where the blocks lie, if not one after another at w
};

template <typename X, typename W>
inline void Emit(const MatmulJob<X, W>& job, int64_t m, int64_t n, float value) {
  if (job.bias != nullptr) value += job.bias[n];
  float* out = job.y + m * job.n_size + n;
  *out = job.accumulate ? *out + value : value;
}

// Emit for a run of `cols` outputs of row m from n (a tile's row), eight at a time.
template <typename X, typename W>
inline void EmitRow(const MatmulJob<X, W>& job, int64_t m, int64_t n, const float* values, int64_t cols) {
  float* out = job.y + m * job.n_size + n;
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    __m256 v = _mm256_loadu_ps(values + c);
    if (job.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(job.bias + n + c));
    if (job.accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out + c), v);
    _mm256_storeu_ps(out + c, v);
  }
  for (; c < cols; ++c) Emit(job, m, n + c, values[c]);
}

// Few rows (decode) are bandwidth-bound: the weight is read once, front to back, one row at a time against up to
// kDecodeRows rows of x (the rest of x is read again from L1). A single forward stream is what the hardware
// prefetcher follows best: interleaving four weight rows ran at half the bandwidth here.

constexpr int64_t kDecodeRows = 4;    // x rows per pass over a weight row: 2 accumulators each + the weight
constexpr int64_t kColsPerItem = 16;  // the unit of weight rows the parallel work items are made of

// `units` units of work in consecutive runs, as item i = units [starts[i], starts[i + 1]). Guided for streams: item
// k takes ceil(remaining / (2 threads)) units, so the first items are long forward streams and the last, short ones
// even the threads out. Otherwise (every unit costs the same) equal runs, two a thread.
using ItemStarts = std::shared_ptr<const std::vector<int64_t>>;

ItemStarts RunsOf(int64_t units, int64_t threads, bool guided) {
  auto starts = std::make_shared<std::vector<int64_t>>();
  for (int64_t u = 0; u < units;) {
    starts->push_back(u);
    u += guided ? std::max<int64_t>(1, Blocks(units - u, 2 * threads)) : Blocks(units, 2 * threads);
  }
  starts->push_back(units);
  return starts;
}

// Weight rows [0, n) as guided items of kColsPerItem-row units. (Items of 64 rows left a 576-row projection's 9
// items split 5 : 4 over two threads.)
template <typename Body>
Phase GuidedColumns(int64_t n, int64_t threads, Body body) {
  const ItemStarts starts = RunsOf(Blocks(n, kColsPerItem), threads, true);
  return {static_cast<int64_t>(starts->size()) - 1, [n, starts, body](int64_t item) {
            body((*starts)[item] * kColsPerItem, std::min(n, (*starts)[item + 1] * kColsPerItem));
          }};
}

template <int64_t R, typename X, typename W>
inline void DotRows(const MatmulJob<X, W>& job, int64_t m, int64_t n) {
  const int64_t k_size = job.k_size;
  const X* x = job.x + m * k_size;
  const W* w = job.w + n * k_size;
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    const __m256 w0 = Load8(w + k), w1 = Load8(w + k + 8);
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(Load8(x + r * k_size + k), w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(Load8(x + r * k_size + k + 8), w1, acc[r][1]);
    }
  }
  for (; k + 8 <= k_size; k += 8) {
    const __m256 w0 = Load8(w + k);
    for (int64_t r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(Load8(x + r * k_size + k), w0, acc[r][0]);
  }
  for (int64_t r = 0; r < R; ++r) {
    float sum = HorizontalSum(_mm256_add_ps(acc[r][0], acc[r][1]));
    for (int64_t kk = k; kk < k_size; ++kk) sum += Load1(x + r * k_size + kk) * Load1(w + kk);
    Emit(job, m + r, n, sum);
  }
}

template <typename X, typename W>
inline float DotRow(const X* x, const W* w, int64_t k_size) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_size; k += 8) acc = _mm256_fmadd_ps(Load8(x + k), Load8(w + k), acc);
  float sum = HorizontalSum(acc);
  for (; k < k_size; ++k) sum += Load1(x + k) * Load1(w + k);
  return sum;
}

#ifdef JSERVE_AVX512_BF16
// The same with vdpbf16ps: 32 bfloat16 pairs per instruction, float32 accumulation; the tail is masked.
template <int64_t R>
inline void DotRows(const MatmulJob<uint16_t, uint16_t>& job, int64_t m, int64_t n) {
  const int64_t k_size = job.k_size;
  const uint16_t* x = job.x + m * k_size;
  const uint16_t* w = job.w + n * k_size;
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= k_size; k += 64) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + k + 32));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k_size + k)), w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k_size + k + 32)),
                                   w1);
    }
  }
  for (; k < k_size; k += 32) {
    const __mmask32 mask = k + 32 <= k_size ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (k_size - k)) - 1);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, w + k));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + r * k_size + k)),
                                   w0);
    }
  }
  for (int64_t r = 0; r < R; ++r) Emit(job, m + r, n, _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])));
}
#endif

template <typename X, typename W>
void MatmulColumns(const MatmulJob<X, W>& job, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t m = 0;
    for (; m + kDecodeRows <= job.m_size; m += kDecodeRows) DotRows<kDecodeRows>(job, m, n);
    switch (job.m_size - m) {
      case 3: DotRows<3>(job, m, n); break;
      case 2: DotRows<2>(job, m, n); break;
      case 1: DotRows<1>(job, m, n); break;
      default: break;
    }
  }
}

#ifndef JSERVE_AVX512_BF16
// bfloat16 weights against float32 x (Bf16Input without AVX512-BF16): sixteen weights are one load, split by two
// bit operations into the even-indexed and the odd-indexed ones as floats (a bfloat16 is the top half of a float32),
// where widening eight at a time costs a shuffle and a shift each. x is split to match, once per work item.
void SplitEvenOdd(const float* x, int64_t rows, int64_t k_size, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * k_size;
    float* dst = out + r * k_size;
    int64_t k = 0;
    for (; k + 16 <= k_size; k += 16) {
      for (int64_t j = 0; j < 8; ++j) {
        dst[k + j] = src[k + 2 * j];
        dst[k + 8 + j] = src[k + 2 * j + 1];
      }
    }
    for (; k < k_size; ++k) dst[k] = src[k];
  }
}

// The loop below holds more instructions per byte than a float32 weight's, so the out-of-order window reaches fewer
// cache lines ahead: a software prefetch 1 KiB ahead took a 2-thread stream over 56 MB from 16-17 to 20-21 GB/s
// on an AVX2 EPYC (23-25 on huge pages); plain float32 rows gained nothing from it (packed ones do: WideTile).
// Non-temporal (each weight is read once a step, so it should not evict what stays): batch-1 bf16 decode 79.4 ->
// 86.6 tok/s against _MM_HINT_T0.
constexpr int64_t kPrefetchBytes = 1024;

// One or two rows get four accumulators a row, not two, so the 5-cycle FMA latency cannot bound the loop.
template <int64_t R>
inline void DotRowsEvenOdd(const MatmulJob<float, uint16_t>& job, const float* x_split, int64_t m, int64_t n) {
  constexpr int64_t kChunks = R <= 2 ? 2 : 1;  // 16-weight chunks per iteration, two accumulators each
  const int64_t k_size = job.k_size;
  const uint16_t* w = job.w + n * k_size;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][2 * kChunks];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t a = 0; a < 2 * kChunks; ++a) acc[r][a] = _mm256_setzero_ps();
  }
  auto chunk = [&](int64_t k, int64_t a) {
    if (a == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kPrefetchBytes, _MM_HINT_NTA);
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(bits, high));
    for (int64_t r = 0; r < R; ++r) {
      acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x_split + r * k_size + k), even, acc[r][a]);
      acc[r][a + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x_split + r * k_size + k + 8), odd, acc[r][a + 1]);
    }
  };
  int64_t k = 0;
  for (; k + 16 * kChunks <= k_size; k += 16 * kChunks) {
    for (int64_t c = 0; c < kChunks; ++c) chunk(k + 16 * c, 2 * c);
  }
  for (; k + 16 <= k_size; k += 16) chunk(k, 0);
  for (int64_t r = 0; r < R; ++r) {
    __m256 total = acc[r][0];
    for (int64_t a = 1; a < 2 * kChunks; ++a) total = _mm256_add_ps(total, acc[r][a]);
    float sum = HorizontalSum(total);
    for (int64_t kk = k; kk < k_size; ++kk) sum += x_split[r * k_size + kk] * Bf16ToFloat(w[kk]);
    Emit(job, m + r, n, sum);
  }
}

void MatmulColumns(const MatmulJob<float, uint16_t>& job, int64_t n_begin, int64_t n_end) {
  thread_local std::vector<float> split;
  split.resize(static_cast<size_t>(job.m_size * job.k_size));
  SplitEvenOdd(job.x, job.m_size, job.k_size, split.data());
  const int64_t k_size = job.k_size;
  for (int64_t n = n_begin; n < n_end; ++n) {
    int64_t m = 0;
    for (; m + kDecodeRows <= job.m_size; m += kDecodeRows) {
      DotRowsEvenOdd<kDecodeRows>(job, split.data() + m * k_size, m, n);
    }
    const float* rest = split.data() + m * k_size;
    switch (job.m_size - m) {
      case 3: DotRowsEvenOdd<3>(job, rest, m, n); break;
      case 2: DotRowsEvenOdd<2>(job, rest, m, n); break;
      case 1: DotRowsEvenOdd<1>(job, rest, m, n); break;
      default: break;
    }
  }
}
#endif

// Larger batches (M >= PanelMinRows) are compute-bound: the weight is packed 16 rows at a time into a k-major
// panel (widened to float32 once), and output tiles of up to 6 x 16 accumulate outer products in 12 registers: per k,
// two weight loads and six broadcasts feed twelve FMAs, with no horizontal sums.

constexpr int64_t kPanel = 16;         // weight rows (output columns) per packed panel: two 8-lane vectors
constexpr int64_t kTileRows = 6;  // x rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast
// Below this many rows, packing costs more than it saves (measured on the LM head): bfloat16 weights stream
// through vdpbf16ps fast enough to hold out longer than float32 ones.
template <typename X, typename W>
constexpr int64_t PanelMinRows() {
  return std::is_same_v<X, uint16_t> && std::is_same_v<W, uint16_t> ? 12 : 8;
}

// Transpose eight vectors of eight floats in registers (rows[i][j] -> rows[j][i]).
inline void Transpose8x8(__m256 rows[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
  const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
  const __m256 t4 = _mm256_unpacklo_ps(rows[4], rows[5]), t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
  const __m256 t6 = _mm256_unpacklo_ps(rows[6], rows[7]), t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  rows[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  rows[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  rows[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  rows[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  rows[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  rows[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  rows[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  rows[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// panel[k * 16 + j] = rows[j, k] for the 16 weight rows at `rows`, zeros past `cols`. A whole panel (K a multiple
// of 8) goes in 8 x 8 blocks loaded, widened and transposed in registers; a partial one element by element.
// Shuffles move bits exactly, so the AVX512-BF16 path packs bfloat16 pairs with it as if they were floats.
template <typename W>
void PackPanel(const W* rows, int64_t cols, int64_t k_size, float* panel) {
  // The rows are one contiguous block: request it front to back first, as the transposes below read sixteen
  // short strided streams that the hardware prefetcher follows poorly.
  const char* block = reinterpret_cast<const char*>(rows);
  for (int64_t offset = 0; offset < cols * k_size * static_cast<int64_t>(sizeof(W)); offset += 64) {
    _mm_prefetch(block + offset, _MM_HINT_T0);
  }
  if (cols == kPanel && k_size % 8 == 0) {
    for (int64_t k = 0; k < k_size; k += 8) {
      for (int64_t half = 0; half < 2; ++half) {
        __m256 block[8];
        for (int64_t j = 0; j < 8; ++j) block[j] = Load8(rows + (half * 8 + j) * k_size + k);
        Transpose8x8(block);
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kPanel + half * 8, block[i]);
      }
    }
    return;
  }
  std::fill(panel, panel + kPanel * k_size, 0.0f);
  for (int64_t k = 0; k < k_size; ++k) {
    for (int64_t j = 0; j < cols; ++j) panel[k * kPanel + j] = Load1(rows + j * k_size + k);
  }
}

inline __m256 Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline __m256 Broadcast(const uint16_t* p) { return _mm256_set1_ps(Bf16ToFloat(*p)); }

// Cache lines requested one every `every` k from inside a compute-bound tile loop: the next packed block, spread
// over the current block's tiles, so that its first tile finds it in L2. (Waiting on memory there cost a 32-row
// float32 matmul 20% of its time on an AVX2 EPYC: 58 GFLOP/s against 73 with the weight in L3.)
struct LinePrefetch {
  const char* next = nullptr;  // the next line to request
  const char* end = nullptr;   // none from here on
  int64_t every = 1;
};

// Packed bfloat16 weights without vdpbf16ps (AVX2, or AVX-512 without BF16): each uint32 of the layout holds
// (w[n, 2kp], w[n, 2kp + 1]), so one 32-byte load splits by two bit operations into eight columns' even-k and odd-k
// weights as floats (a bfloat16 is the top half of a float32). x holds bfloat16 values as floats (Bf16Input): the
// products are exact, as vdpbf16ps's are.
inline __m256 EvenHalves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 OddHalves(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// R <= 6 rows of x (row stride k_size) times one packed panel (`stride` floats from one k to the next) into an
// R x 16 tile. The accumulators are named variables (held in an array, GCC spills them to the stack on every
// iteration); those of rows past R are unused and compiled away. With kPairs the panel is one 16-column half of a
// packed bfloat16 block (`stride` uint32 from one pair of k to the next): per pair of k and 8 columns, one load
// split into even and odd k, and two broadcasts a row (12 accumulators + even + odd + one broadcast).
template <int64_t R, bool kPairs = false, typename X>
void PanelTile(const X* x, int64_t k_size, const float* panel, int64_t stride, LinePrefetch& prefetch,
               float tile[kTileRows][kPanel]) {
  static_assert(R >= 1 && R <= kTileRows);
  int64_t countdown = prefetch.every;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  auto row = [&](int64_t r) { return x + std::min(r, R - 1) * k_size; };  // rows past R are never read
  const X *x0 = row(0), *x1 = row(1), *x2 = row(2), *x3 = row(3), *x4 = row(4), *x5 = row(5);
  for (int64_t k = 0; k < k_size; k += kPairs ? 2 : 1) {
    if (--countdown == 0) {
      countdown = prefetch.every;
      if (prefetch.next < prefetch.end) _mm_prefetch(prefetch.next, _MM_HINT_T1), prefetch.next += 64;
    }
    if constexpr (kPairs) {
      // One 8-column half of the pair: its even and odd k's times two broadcasts of each row of x.
      auto columns = [&](const float* w, __m256& a0, __m256& a1, __m256& a2, __m256& a3, __m256& a4, __m256& a5) {
        const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256 even = EvenHalves(bits), odd = OddHalves(bits);
        auto row_pair = [&](const float* xk, __m256& c) {
          asm volatile("" ::: "memory");  // GCC would hoist all twelve broadcasts and spill the accumulators for them
          c = _mm256_fmadd_ps(_mm256_broadcast_ss(xk), even, c);
          c = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + 1), odd, c);
        };
        row_pair(x0 + k, a0);
        if constexpr (R > 1) row_pair(x1 + k, a1);
        if constexpr (R > 2) row_pair(x2 + k, a2);
        if constexpr (R > 3) row_pair(x3 + k, a3);
        if constexpr (R > 4) row_pair(x4 + k, a4);
        if constexpr (R > 5) row_pair(x5 + k, a5);
      };
      columns(panel + k / 2 * stride, c00, c10, c20, c30, c40, c50);
      columns(panel + k / 2 * stride + 8, c01, c11, c21, c31, c41, c51);
    } else {
      const __m256 w0 = _mm256_loadu_ps(panel + k * stride);
      const __m256 w1 = _mm256_loadu_ps(panel + k * stride + 8);
      auto row_fma = [&](const X* xr, __m256& c0, __m256& c1) {  // one row of x: a broadcast, two FMAs
        const __m256 xv = Broadcast(xr + k);
        c0 = _mm256_fmadd_ps(xv, w0, c0);
        c1 = _mm256_fmadd_ps(xv, w1, c1);
      };
      row_fma(x0, c00, c01);
      if constexpr (R > 1) row_fma(x1, c10, c11);
      if constexpr (R > 2) row_fma(x2, c20, c21);
      if constexpr (R > 3) row_fma(x3, c30, c31);
      if constexpr (R > 4) row_fma(x4, c40, c41);
      if constexpr (R > 5) row_fma(x5, c50, c51);
    }
  }
  _mm256_storeu_ps(tile[0], c00), _mm256_storeu_ps(tile[0] + 8, c01);
  if constexpr (R > 1) _mm256_storeu_ps(tile[1], c10), _mm256_storeu_ps(tile[1] + 8, c11);
  if constexpr (R > 2) _mm256_storeu_ps(tile[2], c20), _mm256_storeu_ps(tile[2] + 8, c21);
  if constexpr (R > 3) _mm256_storeu_ps(tile[3], c30), _mm256_storeu_ps(tile[3] + 8, c31);
  if constexpr (R > 4) _mm256_storeu_ps(tile[4], c40), _mm256_storeu_ps(tile[4] + 8, c41);
  if constexpr (R > 5) _mm256_storeu_ps(tile[5], c50), _mm256_storeu_ps(tile[5] + 8, c51);
}

// x rows m .. m + rows of a tile, zero-padded to `tile_rows` rows when fewer remain.
template <typename X, typename W>
const X* TileRows(const MatmulJob<X, W>& job, int64_t m, int64_t tile_rows, std::vector<X>& tail) {
  const int64_t rows = std::min(tile_rows, job.m_size - m);
  if (rows == tile_rows) return job.x + m * job.k_size;
  tail.assign(static_cast<size_t>(tile_rows * job.k_size), X{0});
  std::memcpy(tail.data(), job.x + m * job.k_size, static_cast<size_t>(rows * job.k_size) * sizeof(X));
  return tail.data();
}

// Every row of x times one panel (`cols` <= 16 real columns from n_begin; with kPairs, a half of a packed bfloat16
// block), requesting the lines of [prefetch_begin, prefetch_end) spread over its tiles. The rows are
// spread evenly over the tiles (32 rows: 6, 6, 5, 5, 5, 5): no padding rows are computed, and no tile is left so
// short that its few accumulators keep the FMA units waiting on their latency.
template <bool kPairs = false, typename X, typename W>
void PanelTiles(const MatmulJob<X, W>& job, int64_t n_begin, int64_t cols, const float* panel, int64_t stride,
                const char* prefetch_begin, const char* prefetch_end) {
  float tile[kTileRows][kPanel];
  const int64_t tiles = Blocks(job.m_size, kTileRows);
  const int64_t lines = Blocks(prefetch_end - prefetch_begin, 64);
  const int64_t steps = kPairs ? job.k_size / 2 : job.k_size;  // loop iterations a tile
  LinePrefetch prefetch{prefetch_begin, prefetch_end,
                        lines > 0 ? std::max<int64_t>(1, tiles * steps / lines) : steps + 1};
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = job.m_size / tiles + (t < job.m_size % tiles ? 1 : 0);
    const X* x = job.x + m * job.k_size;
    auto run = [&](auto height) {
      constexpr int64_t R = decltype(height)::value;
      PanelTile<R, kPairs>(x, job.k_size, panel, stride, prefetch, tile);
    };
    switch (rows) {
      case 6: run(std::integral_constant<int64_t, 6>{}); break;
      case 5: run(std::integral_constant<int64_t, 5>{}); break;
      case 4: run(std::integral_constant<int64_t, 4>{}); break;
      case 3: run(std::integral_constant<int64_t, 3>{}); break;
      case 2: run(std::integral_constant<int64_t, 2>{}); break;
      default: run(std::integral_constant<int64_t, 1>{}); break;
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
    m += rows;
  }
}

// The 16 weight rows from n_begin packed into a panel, then every row of x times it; with `prefetch_next`, the
// next 16 rows requested meanwhile (see LinePrefetch).
template <typename X, typename W>
void MatmulPanel(const MatmulJob<X, W>& job, int64_t n_begin, bool prefetch_next) {
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(kPanel * job.k_size));
  const int64_t cols = std::min(kPanel, job.n_size - n_begin);
  const W* rows = job.w + n_begin * job.k_size;
  PackPanel(rows, cols, job.k_size, panel.data());
  const char* next = reinterpret_cast<const char*>(rows + cols * job.k_size);
  const int64_t next_cols = prefetch_next ? std::min(kPanel, job.n_size - n_begin - cols) : 0;
  PanelTiles(job, n_begin, cols, panel.data(), kPanel, next, next + next_cols * job.k_size * sizeof(W));
}

// Tiles of up to kWideRows rows of x are bandwidth-bound: each streams a whole 32-column block once (AVX2: WideTile
// for float32, WidePairTile for bfloat16 pairs; AVX-512: PackedTile).
constexpr int64_t kWideRows = 2;
// Such a tile requests, at each k (or pair of k), the two lines this far ahead, non-temporal; the blocks are one
// forward stream, so near a block's end this reaches into the next. On an AVX2 EPYC batch-1 f32 decode went 48.7 ->
// 52.6-53.1 tok/s with 384-768 bytes, but fell to 45.8 at 1024 (bfloat16 pairs: level at 384-1024). On an AVX-512
// EPYC (Zen 4), switched on and off between batch-1 generations in one process: bfloat16 +6.7% (median of 30 paired
// rounds, 25 faster), float32 level (0.995, 11 of 24); T0 hints at 512-2048 bytes gained less, T1 at 1024-2048 was
// level with this (16 paired rounds). On an Intel Xeon with AVX512-BF16 a non-temporal prefetch, which fills L1
// alone there, halved one core's stream (8.4 against 14.9 GB/s plain, 16.5 with T0: benchmarks/core_bandwidth.cc)
// and two threads read the packed weights at 0.72 of the memory's bandwidth, against 1.0 with T0 hints 2 KiB ahead
// (benchmarks/stream_sim.cc): cpu_kernels builds with JSERVE_INTEL where the CPU's vendor is Intel. There a second
// request, into L2 (T2) 8 KiB ahead, keeps more lines in flight (presumably past what L1's fill buffers hold): the
// one-row vdpbf16ps loop (8 cycles a pair of k on its accumulator chain there) then read 1.10-1.13x the plain read,
// against 1.01 with the T0 request alone (T2 at 6-16 KiB alone: 1.07-1.08; stream_sim.cc with -DFAR_PREFETCH_BYTES).
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

#ifdef JSERVE_AVX512_BF16
// bfloat16 panels for vdpbf16ps: a panel holds 16 weight rows as k-pairs, (w[j, 2kp], w[j, 2kp + 1]) for j < 16,
// one 512-bit vector per pair of k. A tile is R <= 12 rows of x by two panels (32 columns): per pair of k, two
// weight loads and R broadcast pairs feed 2R vdpbf16ps (at 12 rows: 24 accumulators of the 32 registers).
template <int64_t R>
void PackedTile(const uint16_t* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
                float tile[][2 * kPanel]) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = k_size / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    if constexpr (R <= kWideRows) PrefetchAhead(panel_a + kp * stride);
    const __m512bh wa = reinterpret_cast<__m512bh>(_mm512_loadu_ps(panel_a + kp * stride));
    const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_loadu_ps(panel_b + kp * stride));
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k_size + 2 * kp, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, wa);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, wb);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], acc[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, acc[r][1]);
  }
}
#endif

template <typename X, typename W>
int64_t PanelCols() {
#ifdef JSERVE_AVX512_BF16
  if (std::is_same_v<X, uint16_t>) return 2 * kPanel;
#endif
  return kPanel;
}

// Weights packed once at load time (cpu_kernels.pack_weight), N_pad a multiple of 32, block b holding rows
// 32b .. 32b + 31 k-major: bfloat16 as uint32 pairs [N_pad / 32, K / 2, 32] (w[n, 2kp], w[n, 2kp + 1]), float32 as
// [N_pad / 32, K, 32]. Every batch size runs tiles straight over them (AVX-512: the same 1-12 row tiles; AVX2: see
// its BlockTiles, and for bfloat16 without AVX512-BF16 the pair tiles' BlockTiles): nothing is packed per call, and
// each block is one forward stream (two 16-column panels interleaved a k, or a pair of k, at a time).
struct F32Panels {};  // the weight type of a packed float32 job (its pointer is the panels' floats)

// Wide tiles (kWideRows above): on AVX2, more rows take each 16-column panel in turn, which requests the next block
// as it goes (float32 at 4 rows: 14 -> 15-19 GB/s against two wide tiles).

// A wide tile's accumulators (kSets sets, summed, of R rows by four 8-column vectors) stored as its rows.
template <int64_t kSets, int64_t R>
inline void StoreWideTile(const __m256 (&acc)[kSets][R][4], float tile[][2 * kPanel]) {
#pragma GCC unroll 2
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) {
      __m256 sum = acc[0][r][v];
      if constexpr (kSets == 2) sum = _mm256_add_ps(sum, acc[1][r][v]);
      _mm256_storeu_ps(tile[r] + 8 * v, sum);
    }
  }
}

// Every row of x, kWideRows at a time, through a wide tile over one 32-column block: tile(rows, x, out) with rows
// a std::integral_constant of 1 or 2.
template <typename X, typename W, typename Tile>
void WideRows(const MatmulJob<X, W>& job, int64_t n_begin, int64_t cols, Tile tile_of) {
  static_assert(kWideRows == 2);
  float tile[kWideRows][2 * kPanel];
  for (int64_t m = 0; m < job.m_size; m += kWideRows) {
    const int64_t rows = std::min(kWideRows, job.m_size - m);
    const float* x = job.x + m * job.k_size;
    if (rows == 2) {
      tile_of(std::integral_constant<int64_t, 2>{}, x, tile);
    } else {
      tile_of(std::integral_constant<int64_t, 1>{}, x, tile);
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
  }
}

#ifdef __AVX512F__
template <int64_t R>
void PackedTile(const float* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
                float tile[][2 * kPanel]) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    if constexpr (R <= kWideRows) PrefetchAhead(panel_a + k * stride);
    const __m512 wa = _mm512_loadu_ps(panel_a + k * stride);
    const __m512 wb = _mm512_loadu_ps(panel_b + k * stride);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k_size + k]);
      acc[r][0] = _mm512_fmadd_ps(xv, wa, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, wb, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(tile[r], acc[r][0]);
    _mm512_storeu_ps(tile[r] + kPanel, acc[r][1]);
  }
}

// The 1-12 row tiles of every row of x over one 32-column block of packed weight (its two 16-column panels at
// panel_a and panel_b, `stride` floats from one k to the next).
template <typename X, typename W>
void BlockTiles(const MatmulJob<X, W>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* /*next_begin*/ = nullptr, const char* /*next_end*/ = nullptr) {
  thread_local std::vector<X> x_tail;
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  constexpr int64_t kMaxRows = 12;
  float tile[kMaxRows][2 * kPanel];
  for (int64_t m = 0; m < job.m_size; m += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, job.m_size - m);
    const int64_t tile_rows = rows > 8 ? 12 : rows > 4 ? 8 : rows > 2 ? 4 : rows;  // at most 3 rows of padding
    const X* x = TileRows(job, m, tile_rows, x_tail);
    switch (tile_rows) {
      case 12: PackedTile<12>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 8: PackedTile<8>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 4: PackedTile<4>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      case 2: PackedTile<2>(x, job.k_size, panel_a, panel_b, stride, tile); break;
      default: PackedTile<1>(x, job.k_size, panel_a, panel_b, stride, tile); break;
    }
    for (int64_t r = 0; r < rows; ++r) EmitRow(job, m + r, n_begin, tile[r], cols);
  }
}
#else
// AVX2 has 16 vector registers: a tile is R <= 2 rows of x by the whole 32-column block (four weight vectors a k),
// or up to 6 rows by one 16-column panel (PanelTile, 12 accumulators).

template <int64_t R>
void WideTile(const float* x, int64_t k_size, const float* panel_a, const float* panel_b, int64_t stride,
              float tile[][2 * kPanel]) {
  static_assert(R == 1 || R == 2);
  // One row gets two sets of accumulators (even and odd k), so the FMA latency cannot bound its loop.
  constexpr int64_t kSets = R == 1 ? 2 : 1;
  __m256 acc[kSets][R][4];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 4; ++i) acc[i / (R * 4)][i / 4 % R][i % 4] = _mm256_setzero_ps();
  int64_t k = 0;
  auto step = [&](int64_t set, int64_t kk) {
    PrefetchAhead(panel_a + kk * stride);
    const __m256 w0 = _mm256_loadu_ps(panel_a + kk * stride), w1 = _mm256_loadu_ps(panel_a + kk * stride + 8);
    const __m256 w2 = _mm256_loadu_ps(panel_b + kk * stride), w3 = _mm256_loadu_ps(panel_b + kk * stride + 8);
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k_size + kk);
      acc[set][r][0] = _mm256_fmadd_ps(xv, w0, acc[set][r][0]);
      acc[set][r][1] = _mm256_fmadd_ps(xv, w1, acc[set][r][1]);
      acc[set][r][2] = _mm256_fmadd_ps(xv, w2, acc[set][r][2]);
      acc[set][r][3] = _mm256_fmadd_ps(xv, w3, acc[set][r][3]);
    }
  };
  for (; k + kSets <= k_size; k += kSets) {
#pragma GCC unroll 2
    for (int64_t set = 0; set < kSets; ++set) step(set, k + set);
  }
  for (; k < k_size; ++k) step(0, k);
  StoreWideTile(acc, tile);
}

template <typename X, typename W>
void BlockTiles(const MatmulJob<X, W>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* next_begin, const char* next_end) {
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  if (job.m_size > kWideRows) {  // the next block's first half requested over panel a's tiles, its second over b's
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    PanelTiles(job, n_begin, std::min(kPanel, cols), panel_a, stride, next_begin, next_half);
    if (cols > kPanel) PanelTiles(job, n_begin + kPanel, cols - kPanel, panel_b, stride, next_half, next_end);
    return;
  }
  WideRows(job, n_begin, cols, [&](auto rows, const float* x, float tile[][2 * kPanel]) {
    WideTile<decltype(rows)::value>(x, job.k_size, panel_a, panel_b, stride, tile);
  });
}
#endif

#ifndef JSERVE_AVX512_BF16
// Packed bfloat16 weights without vdpbf16ps (AVX2, or AVX-512 without BF16), split by EvenHalves / OddHalves.

// One or two rows of x stream a 32-column block once, as WideTile does a float32 one (128 bytes a pair of k). One
// forward stream with the prefetch is what took float32 to ~90% of the read bandwidth, where the bfloat16 row loop
// (DotRowsEvenOdd) reached ~75-80%.

template <int64_t R>
void WidePairTile(const float* x, int64_t k_size, const float* block, float tile[][2 * kPanel]) {
  static_assert(R == 1 || R == 2);
  constexpr int64_t kSets = R == 1 ? 2 : 1;  // one row: even and odd k accumulate apart (the FMA latency)
  __m256 acc[kSets][R][4];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kSets * R * 4; ++i) acc[i / (R * 4)][i / 4 % R][i % 4] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const float* w = block + kp * 2 * kPanel;
    PrefetchAhead(w);
    __m256 x_even[R], x_odd[R];
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
      x_even[r] = _mm256_broadcast_ss(x + r * k_size + 2 * kp);
      x_odd[r] = _mm256_broadcast_ss(x + r * k_size + 2 * kp + 1);
    }
#pragma GCC unroll 4
    for (int64_t v = 0; v < 4; ++v) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * v));
      const __m256 even = EvenHalves(pairs), odd = OddHalves(pairs);
#pragma GCC unroll 2
      for (int64_t r = 0; r < R; ++r) {
        acc[0][r][v] = _mm256_fmadd_ps(x_even[r], even, acc[0][r][v]);
        acc[kSets - 1][r][v] = _mm256_fmadd_ps(x_odd[r], odd, acc[kSets - 1][r][v]);
      }
    }
  }
  StoreWideTile(acc, tile);
}

// One 16-column half of a packed bfloat16 block (`stride` uint32 from one pair of k to the next) widened to a
// float32 panel [K, 16], for the compute-bound tiles of many rows (each shift then runs once a call, not a tile).
void WidenPairPanel(const float* pairs, int64_t k_size, int64_t stride, float* panel) {
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    for (int64_t h = 0; h < 2; ++h) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + kp * stride + 8 * h));
      _mm256_storeu_ps(panel + 2 * kp * kPanel + 8 * h, EvenHalves(bits));
      _mm256_storeu_ps(panel + (2 * kp + 1) * kPanel + 8 * h, OddHalves(bits));
    }
  }
}

// Up to this many rows of x, the pair tiles run straight over the packed halves; more take each half widened to
// float32 first, where the six-row tiles no longer spend two broadcasts a row on each pair of k (a sweep over a 135M
// model's matrices on an AVX2 EPYC: 3 rows 19.2 ms against 28.4 widened, 8 rows 46.5 against 48.6; 12 rows level;
// 32 rows 116 against 155-174).
constexpr int64_t kPairTileRows = 8;

// The packed float32 layout's BlockTiles, for bfloat16 pairs: wide pair tiles for one or two rows of x, pair panel
// tiles up to kPairTileRows, else each half widened and run through the float32 panel tiles (each requesting the
// next block meanwhile).
void BlockTiles(const MatmulJob<float, uint32_t>& job, int64_t n_begin, const float* panel_a, const float* panel_b,
                int64_t stride, const char* next_begin, const char* next_end) {
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  if (job.m_size > kWideRows && job.m_size <= kPairTileRows) {
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    PanelTiles<true>(job, n_begin, std::min(kPanel, cols), panel_a, stride, next_begin, next_half);
    if (cols > kPanel) PanelTiles<true>(job, n_begin + kPanel, cols - kPanel, panel_b, stride, next_half, next_end);
    return;
  }
  if (job.m_size > kWideRows) {
    thread_local std::vector<float> panel;
    panel.resize(static_cast<size_t>(kPanel * job.k_size));
    const char* next_half = next_begin + (next_end - next_begin) / 2;
    WidenPairPanel(panel_a, job.k_size, stride, panel.data());
    PanelTiles(job, n_begin, std::min(kPanel, cols), panel.data(), kPanel, next_begin, next_half);
    if (cols > kPanel) {
      WidenPairPanel(panel_b, job.k_size, stride, panel.data());
      PanelTiles(job, n_begin + kPanel, cols - kPanel, panel.data(), kPanel, next_half, next_end);
    }
    return;
  }
  WideRows(job, n_begin, cols, [&](auto rows, const float* x, float tile[][2 * kPanel]) {
    WidePairTile<decltype(rows)::value>(x, job.k_size, panel_a, tile);
  });
}
#endif

// A packed panel's length in 4-byte units: bfloat16 pairs (uint32) or float32.
template <typename W>
constexpr int64_t PanelLength(int64_t k_size) {
  return std::is_same_v<W, uint32_t> ? k_size / 2 * kPanel : k_size * kPanel;
}

// Where block `pair` (`length` 4-byte units) of a packed weight lies.
template <typename X, typename W>
inline const float* BlockAt(const MatmulJob<X, W>& job, int64_t pair, int64_t length) {
  if (job.parts == nullptr) return reinterpret_cast<const float*>(job.w) + pair * length;
  const BlockParts& parts = *job.parts;
  size_t p = 0;
  while (pair >= parts.begin[p + 1]) ++p;  // a few parts
  return parts.base[p] + parts.offset + (pair - parts.begin[p]) * length;
}

// Block `pair` of the packed weight; with `prefetch_next`, requesting block pair + 1 while at it (see LinePrefetch).
template <typename X, typename W>
void MatmulPacked(const MatmulJob<X, W>& job, int64_t pair, bool prefetch_next) {
  const int64_t length = 2 * PanelLength<W>(job.k_size);  // 4-byte units a block
  const float* block = BlockAt(job, pair, length);
  const char* next = reinterpret_cast<const char*>(prefetch_next ? BlockAt(job, pair + 1, length) : block + length);
  BlockTiles(job, pair * 2 * kPanel, block, block + kPanel, 2 * kPanel,  // 32 columns a k, interleaved
             next, prefetch_next ? next + length * 4 : next);
}

// A few rows of x (decode batches of 1-4) against packed blocks [b0, b1), each block's 32 sums a row kept in
// registers and stored straight into y; false where this CPU and weight type have no such loop, or for more rows
// (the tiles run instead). The same products in the same order as the tiles, so the same bits, without a block's
// tile setup, store and emit, and with both halves of a k loaded from one pointer (10 uops a pair of k in the
// one-row loop, not 12). Batch-1 decode ran 1.06x as fast in bfloat16 (1.08x where the memory reads ~65 GB/s) and
// 1.03x in float32; unrolled by two it was level, and without its prefetches 11% slower at ~65 GB/s
// (docs/benchmarks.md, fifteenth session).
template <typename X, typename W>
bool RowBlocks(const MatmulJob<X, W>&, int64_t, int64_t) {
  return false;
}

#ifdef __AVX512F__
// R rows' sums of a block (columns n .. n + 31) into y, as EmitRow would store them.
template <int64_t R, typename X, typename W>
inline void EmitBlock(const MatmulJob<X, W>& job, int64_t n, __m512 (&low)[R], __m512 (&high)[R]) {
  for (int64_t r = 0; r < R; ++r) {
    if (n + 2 * kPanel > job.n_size) {  // the last block's padding columns are dropped
      float tile[2 * kPanel];
      _mm512_storeu_ps(tile, low[r]);
      _mm512_storeu_ps(tile + kPanel, high[r]);
      EmitRow(job, r, n, tile, job.n_size - n);
      continue;
    }
    float* out = job.y + r * job.n_size + n;
    if (job.bias != nullptr) {
      low[r] = _mm512_add_ps(low[r], _mm512_loadu_ps(job.bias + n));
      high[r] = _mm512_add_ps(high[r], _mm512_loadu_ps(job.bias + n + kPanel));
    }
    if (job.accumulate) {
      low[r] = _mm512_add_ps(_mm512_loadu_ps(out), low[r]);
      high[r] = _mm512_add_ps(_mm512_loadu_ps(out + kPanel), high[r]);
    }
    _mm512_storeu_ps(out, low[r]);
    _mm512_storeu_ps(out + kPanel, high[r]);
  }
}

// kBlocks blocks from b on, side by side: `step(w, k, low, high)` adds k's (or pair k's) products, its weights at w.
template <int64_t kBlocks, int64_t R, typename X, typename W, typename Step>
inline void RowBlockSet(const MatmulJob<X, W>& job, int64_t b, int64_t length, int64_t steps, Step step) {
  const float* block[kBlocks];
  __m512 low[kBlocks][R], high[kBlocks][R];
#pragma GCC unroll 2
  for (int64_t i = 0; i < kBlocks; ++i) {
    block[i] = BlockAt(job, b + i, length);
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) low[i][r] = high[i][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < steps; ++k) {
#pragma GCC unroll 2
    for (int64_t i = 0; i < kBlocks; ++i) {
      const float* w = block[i] + k * 2 * kPanel;
      PrefetchAhead(w);
      step(w, k, low[i], high[i]);
    }
  }
#pragma GCC unroll 2
  for (int64_t i = 0; i < kBlocks; ++i) EmitBlock<R>(job, (b + i) * 2 * kPanel, low[i], high[i]);
}

// On Intel one row of bfloat16 runs two blocks side by side: there vdpbf16ps takes ~8 cycles on its accumulator
// chain, and one block's two chains caught up too slowly after a stall in the stream (benchmarks/stream_sim.cc over
// 75 layers, from memory: 0.96-0.98 of the prefetched plain read with one block, 0.97-1.0 with two; batch-1 decode
// 1.04x on the 135M model, 1.03x on a 75-layer one). Each column's sum keeps its order, so the bits are the same.
template <int64_t R, typename W>
constexpr int64_t kSideBySideBlocks =
#ifdef JSERVE_INTEL
    R == 1 && std::is_same_v<W, uint32_t> ? 2 : 1;
#else
    1;
#endif

// RowBlocks for R rows: `step(w, k, low, high)` adds k's (or pair k's) products, its weights at w.
template <int64_t R, typename X, typename W, typename Step>
void RowBlocksOf(const MatmulJob<X, W>& job, int64_t b0, int64_t b1, int64_t steps, Step step) {
  const int64_t length = 2 * PanelLength<W>(job.k_size);
  constexpr int64_t kBlocks = kSideBySideBlocks<R, W>;
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks) RowBlockSet<kBlocks, R>(job, b, length, steps, step);
  for (; b < b1; ++b) RowBlockSet<1, R>(job, b, length, steps, step);
}

// Calls body(std::integral_constant<int64_t, R>) for R = m_size; false past 4 rows (8 accumulators).
template <typename Body>
bool WithRowCount(int64_t m_size, Body body) {
  switch (m_size) {
    case 1: body(std::integral_constant<int64_t, 1>{}); return true;
    case 2: body(std::integral_constant<int64_t, 2>{}); return true;
    case 3: body(std::integral_constant<int64_t, 3>{}); return true;
    case 4: body(std::integral_constant<int64_t, 4>{}); return true;
    default: return false;
  }
}

template <>
bool RowBlocks(const MatmulJob<float, F32Panels>& job, int64_t b0, int64_t b1) {
  return WithRowCount(job.m_size, [&](auto rows) {
    constexpr int64_t R = decltype(rows)::value;
    RowBlocksOf<R>(job, b0, b1, job.k_size, [&](const float* w, int64_t k, __m512 (&low)[R], __m512 (&high)[R]) {
      const __m512 wa = _mm512_loadu_ps(w), wb = _mm512_loadu_ps(w + kPanel);
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(job.x[r * job.k_size + k]);
        low[r] = _mm512_fmadd_ps(xv, wa, low[r]);
        high[r] = _mm512_fmadd_ps(xv, wb, high[r]);
      }
    });
  });
}
#endif

#ifdef JSERVE_AVX512_BF16
template <>
bool RowBlocks(const MatmulJob<uint16_t, uint32_t>& job, int64_t b0, int64_t b1) {
  return WithRowCount(job.m_size, [&](auto rows) {
    constexpr int64_t R = decltype(rows)::value;
    RowBlocksOf<R>(job, b0, b1, job.k_size / 2, [&](const float* w, int64_t kp, __m512 (&low)[R],
                                                    __m512 (&high)[R]) {
      const __m512bh wa = reinterpret_cast<__m512bh>(_mm512_loadu_ps(w));
      const __m512bh wb = reinterpret_cast<__m512bh>(_mm512_loadu_ps(w + kPanel));
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, job.x + r * job.k_size + 2 * kp, sizeof(pair));
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        low[r] = _mm512_dpbf16_ps(low[r], xv, wa);
        high[r] = _mm512_dpbf16_ps(high[r], xv, wb);
      }
    });
  });
}
#endif

// Compute-bound matmuls over bfloat16 pairs, where vdpbf16ps is slow: WidenedBlocks runs blocks [b0, b1) and says
// true, or says false and leaves them to the tiles.
template <typename X, typename W>
bool WidenedBlocks(const MatmulJob<X, W>&, int64_t, int64_t) {
  return false;
}

#if defined(JSERVE_AVX512_BF16) && defined(JSERVE_INTEL)
// On an Intel Xeon the packed bfloat16 tiles (vdpbf16ps) ran at ~0.6 of the float32 ones at 32 rows and more,
// though they read half the bytes (benchmarks/cpu_kernels_micro.py: gate_up at 32 rows 0.80 against 0.48 ms). So
// there, past RowBlocks' few rows, each block's two halves are widened to float32 panels [K, 16] first and x to
// float32 once an item, and the float32 tiles run over them. Each pair's odd k comes first, in the panels and in x:
// vdpbf16ps adds the odd product, then the even one, each rounded once (checked bit for bit against the
// instruction on 3.2M lanes), so these tiles give its bits, and a row's bits do not depend on its batch (denormals
// aside: vdpbf16ps flushes them).
void WidenPairsOddFirst(const float* pairs, int64_t k_size, float* panel) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k_size / 2; ++kp) {
    const __m512i bits = _mm512_loadu_si512(pairs + kp * 2 * kPanel);
    _mm512_storeu_ps(panel + 2 * kp * kPanel, _mm512_castsi512_ps(_mm512_and_si512(bits, high)));
    _mm512_storeu_ps(panel + (2 * kp + 1) * kPanel, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
  }
}

template <>
bool WidenedBlocks(const MatmulJob<uint16_t, uint32_t>& job, int64_t b0, int64_t b1) {
  const int64_t k_size = job.k_size, values = job.m_size * k_size;
  thread_local std::vector<float> x, panels;
  x.resize(static_cast<size_t>(values));
  for (int64_t i = 0; i < values; i += 2) {  // k_size is even: pairs never straddle rows
    x[i] = Bf16ToFloat(job.x[i + 1]);
    x[i + 1] = Bf16ToFloat(job.x[i]);
  }
  panels.resize(static_cast<size_t>(2 * kPanel * k_size));
  float* const panel_b = panels.data() + kPanel * k_size;
  const MatmulJob<float, F32Panels> wide{x.data(), nullptr, job.y, job.bias, job.accumulate,
                                         job.m_size, job.n_size, k_size};
  const int64_t length = 2 * PanelLength<uint32_t>(k_size);
  for (int64_t b = b0; b < b1; ++b) {
    const float* block = BlockAt(job, b, length);
    WidenPairsOddFirst(block, k_size, panels.data());
    WidenPairsOddFirst(block + kPanel, k_size, panel_b);
    BlockTiles(wide, b * 2 * kPanel, panels.data(), panel_b, kPanel);
  }
  return true;
}
#endif

// Packed blocks lie one after another, so an item of consecutive blocks is one forward stream. For a few rows of x
// (bandwidth-bound) the items are guided (RunsOf): with one 36 KiB block an item, the 576-wide projections streamed
// at 35 GB/s; at 96 KiB, 50. Many rows are compute-bound: equal runs, each block requesting the next one early.
#ifdef __AVX512F__
constexpr int64_t kStreamRows = 4;  // at most this many rows of x take guided items
#else
constexpr int64_t kStreamRows = kWideRows;
#endif

// Whether the job runs one owned item a thread, each over its thread's weight part (a few rows of x, with parts).
template <typename X, typename W>
bool OwnedBlocks(const MatmulJob<X, W>& job, int64_t threads) {
  return job.m_size <= kStreamRows && job.parts != nullptr && job.parts->parts == threads && threads <= 64;
}

// Writes a matmul's x [m, k] into the buffer it is given. Where each owned item makes its own x (a norm, the SiLU:
// a few microseconds of work), the step before the matmul needs no phase, so no wait, of its own.
// (x, item): item is the owned item's index, so that item 0 can also do what one thread alone must.
template <typename X>
using MatmulInput = InlineFunction<void(X*, int64_t), 48>;

// `input` (owned items only: OwnedBlocks) makes x for each item in a buffer of that thread's; job.x is then unused.
template <typename X, typename W>
Phase PackedPhase(const MatmulJob<X, W>& job, int64_t threads, MatmulInput<X> input = {}) {
  const bool streamed = job.m_size <= kStreamRows;
  const BlockParts* parts = job.parts;
  if (OwnedBlocks(job, threads)) {
    Phase phase{threads, [job, parts, input](int64_t p) {  // each thread its own part: the next stretch of its stream
                  MatmulJob<X, W> own = job;
                  thread_local std::vector<X> x;
                  if (input) {
                    x.resize(static_cast<size_t>(job.m_size * job.k_size));
                    input(x.data(), p);
                    own.x = x.data();
                  }
                  const int64_t begin = parts->begin[p], end = parts->begin[p + 1];
                  if (RowBlocks(own, begin, end)) return;
                  for (int64_t b = begin; b < end; ++b) MatmulPacked(own, b, false);
                }};
    phase.owned = true;
    return phase;
  }
  const ItemStarts starts = RunsOf(Blocks(job.n_size, 2 * kPanel), threads, streamed);
  return {static_cast<int64_t>(starts->size()) - 1, [job, starts, streamed](int64_t item) {
            const int64_t begin = (*starts)[item], end = (*starts)[item + 1];
            if (RowBlocks(job, begin, end) || WidenedBlocks(job, begin, end)) return;
            for (int64_t b = begin; b < end; ++b) MatmulPacked(job, b, !streamed && b + 1 < end);
          }};
}

Phase MatmulPhase(const MatmulJob<float, F32Panels>& job, int64_t threads) { return PackedPhase(job, threads); }

#ifdef JSERVE_AVX512_BF16
// bfloat16 weights not packed at load time: each call packs its 32-column blocks (two panels) first.
template <>
void MatmulPanel(const MatmulJob<uint16_t, uint16_t>& job, int64_t n_begin, bool /*prefetch_next*/) {
  const int64_t k_size = job.k_size;
  if (k_size % 2 != 0) {  // no whole pairs: stream the columns instead (never for a real model's hidden sizes)
    MatmulColumns(job, n_begin, std::min(job.n_size, n_begin + 2 * kPanel));
    return;
  }
  thread_local std::vector<float> panels;
  const int64_t pairs = k_size / 2;
  panels.resize(static_cast<size_t>(2 * kPanel * pairs));
  const float* w_pairs = reinterpret_cast<const float*>(job.w);  // row n, pair kp at w_pairs[n * pairs + kp]
  const int64_t cols = std::min(2 * kPanel, job.n_size - n_begin);
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t half_cols = std::clamp<int64_t>(cols - half * kPanel, 0, kPanel);
    float* panel = panels.data() + half * kPanel * pairs;
    if (half_cols == 0) {
      std::fill(panel, panel + kPanel * pairs, 0.0f);
    } else {
      PackPanel(w_pairs + (n_begin + half * kPanel) * pairs, half_cols, pairs, panel);
    }
  }
  BlockTiles(job, n_begin, panels.data(), panels.data() + kPanel * pairs, kPanel);
}

#endif

Phase MatmulPhase(const MatmulJob<Bf16Input, uint32_t>& job, int64_t threads) { return PackedPhase(job, threads); }

// The job as parallel items: column blocks streamed for few rows; for many, runs of panels packed per call (2 items
// a thread: every panel costs the same), each panel's tiles requesting the next panel's rows.
template <typename X, typename W>
Phase MatmulPhase(const MatmulJob<X, W>& job, int64_t threads) {
  if (job.m_size >= PanelMinRows<X, W>()) {
    const int64_t cols = PanelCols<X, W>();
    const ItemStarts starts = RunsOf(Blocks(job.n_size, cols), threads, false);
    return {static_cast<int64_t>(starts->size()) - 1, [job, cols, starts](int64_t item) {
              const int64_t end = (*starts)[item + 1];
              for (int64_t p = (*starts)[item]; p < end; ++p) MatmulPanel(job, p * cols, p + 1 < end);
            }};
  }
  return GuidedColumns(job.n_size, threads, [job](int64_t begin, int64_t end) { MatmulColumns(job, begin, end); });
}

bool IsBf16Bits(ffi::DataType type) { return type == ffi::DataType::BF16 || type == ffi::DataType::U16; }

// x rounded to bfloat16 (bits, or float32 values: Bf16Input), a row block per item (bfloat16 weights take
// bfloat16 activations).
template <typename X>
Phase RoundRowsPhase(const float* x, X* out, int64_t rows, int64_t cols) {
  constexpr int64_t kRowsPerItem = 16;
  return {Blocks(rows, kRowsPerItem), [=](int64_t item) {
            const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
            for (int64_t r = item * kRowsPerItem; r < end; ++r) StoreInput(out + r * cols, x + r * cols, cols, true);
          }};
}

// A weight's [N, K] as stored: plain [N, K], or packed (N_pad >= N rows): bfloat16 pairs uint32 [N_pad / 32, K / 2,
// 32] or float32 [N_pad / 32, K, 32].
struct WeightShape {
  int64_t rows = -1, cols = -1;
  bool packed = false;
};

WeightShape ShapeOf(const ffi::AnyBuffer& w) {
  const auto dims = w.dimensions();
  const ffi::DataType type = w.element_type();
  if (dims.size() == 3 && dims[2] == 2 * kPanel && (type == ffi::DataType::U32 || type == ffi::DataType::F32)) {
    return {dims[0] * 2 * kPanel, type == ffi::DataType::U32 ? dims[1] * 2 : dims[1], true};
  }
  if (dims.size() == 2 && type != ffi::DataType::U32) return {dims[0], dims[1], false};
  return {};
}

// Whether the weight is an [n, k] matrix (packed: padded to whole pairs of panels).
bool Holds(const WeightShape& w, int64_t n, int64_t k) {
  if (w.cols != k) return false;
  return w.packed ? w.rows == Blocks(n, 2 * kPanel) * 2 * kPanel : w.rows == n;
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y) {
  CallClock call_clock(kMatmulCall);
  const auto x_dims = x.dimensions();
  const WeightShape shape = ShapeOf(w);
  if (x_dims.size() != 2 || y->dimensions().size() != 2 || !Holds(shape, y->dimensions()[1], x_dims[1])) {
    return ffi::Error::InvalidArgument("jserve_matmul: expected x[M, K], w[N, K] (or packed) and y[M, N]");
  }
  const int64_t m_size = x_dims[0], k_size = x_dims[1], n_size = y->dimensions()[1];
  const int64_t threads = pool.num_threads();
  if (shape.packed && w.element_type() == ffi::DataType::U32) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint32_t> job{x_bf16.data(), static_cast<const uint32_t*>(w.untyped_data()),
                                             y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x.typed_data(), x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (shape.packed) {
    const MatmulJob<float, F32Panels> job{x.typed_data(), static_cast<const F32Panels*>(w.untyped_data()),
                                          y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else if (IsBf16Bits(w.element_type())) {
    thread_local std::vector<Bf16Input> x_bf16;
    x_bf16.resize(static_cast<size_t>(m_size * k_size));
    const MatmulJob<Bf16Input, uint16_t> job{x_bf16.data(), static_cast<const uint16_t*>(w.untyped_data()),
                                             y->typed_data(), nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {RoundRowsPhase(x.typed_data(), x_bf16.data(), m_size, k_size), MatmulPhase(job, threads)});
  } else if (w.element_type() == ffi::DataType::F32) {
    const MatmulJob<float, float> job{x.typed_data(), static_cast<const float*>(w.untyped_data()), y->typed_data(),
                                      nullptr, false, m_size, n_size, k_size};
    RunPhases(pool, {MatmulPhase(job, threads)});
  } else {
    return ffi::Error::InvalidArgument("jserve_matmul: w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

inline float MaxOf(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// ---------------------------------------------------------------------------------------------------------------
// Greedy sampling: the first index of each row's maximum, a NaN counting as the maximum (jnp.argmax's answer).
// XLA CPU's argmax is a variadic reduce that ran at ~1 ns an element; this is two vector passes over the row.

// The first i with pred(x[i .. i + 8)) set in its lane mask, or -1.
template <typename Pred>
int64_t FirstLane(const float* x, int64_t n, Pred pred) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(pred(_mm256_loadu_ps(x + i)));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    const int mask = _mm256_movemask_ps(pred(_mm256_set1_ps(x[i])));
    if (mask != 0) return i;
  }
  return -1;
}

int32_t ArgmaxRow(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float top = MaxOf(reinterpret_cast<const float*>(&best), 8);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    has_nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (has_nan) {
    return static_cast<int32_t>(FirstLane(x, n, [](__m256 v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }));
  }
  const __m256 target = _mm256_set1_ps(top);
  const int64_t first = FirstLane(x, n, [target](__m256 v) { return _mm256_cmp_ps(v, target, _CMP_EQ_OQ); });
  return static_cast<int32_t>(std::max<int64_t>(first, 0));  // a row of -inf: index 0, as jnp.argmax
}

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  CallClock call_clock(kArgmaxCall);
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] == 0) return ffi::Error::InvalidArgument("jserve_argmax: expected x[S, V > 0]");
  const float* rows = x.typed_data();
  int32_t* ids = out->typed_data();
  const int64_t vocab = dims[1];
  RunPhases(pool, {{dims[0], [=](int64_t r) { ids[r] = ArgmaxRow(rows + r * vocab, vocab); }}});
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Ragged paged attention. One work item is (sequence, block of up to kQueryBlock query tokens, KV heads): its rows
// are those tokens times the query heads sharing each KV head (GQA). Pages are visited once per item, in order,
// with a flash-attention style running max and sum per row.

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kSplitPages = 16;  // a decode over more pages than this is split into parts (AttentionItems)
constexpr int64_t kPrefetchPages = 2;  // pages of K/V requested ahead of the one being read
constexpr int64_t kTouchBytes = 32 << 10;  // K and V bytes of a bfloat16 cache loaded ahead at once (one L1)

// exp(x) for x <= 0 (scores minus their running max), to ~1e-7 relative: 2^n * P(r) with a degree-6 polynomial.
inline __m256 ExpNonPositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

struct AttentionArgs {
  const float* q;              // [T, q_stride]: token t's head h at q[t * q_stride + h * D]
  int64_t q_stride;
  const void* k_pages;         // [N, B, Hkv, D]
  const void* v_pages;
  bool kv_bf16;
  const int32_t* page_table;   // [S, P]
  const int32_t* query_start;  // [S + 1]
  const int32_t* seq_lens;     // [S]
  void* out;                   // [T, H, D], float32 or (out_bf16) bfloat16 bits
  bool out_bf16;
  bool out_round = false;      // float32 out rounded to bfloat16 values (a bfloat16 matmul's Bf16Input)
  int64_t num_heads, kv_heads, head_dim, page_size, pages_per_seq, num_pages;
  float scale, soft_cap;       // soft_cap 0: none
  int64_t sliding_window;      // 0: none
  float* partials = nullptr;   // split items' unnormalized rows, maxima and sums (AttentionItem::partial)
};

// A sequence's block of query tokens against a range of its KV heads: all of them when the batch has items enough
// for every thread (a page's K or V for all heads is one contiguous run: one prefetch stream, every line used),
// one head each when it has not (a lone decode still splits over threads).
struct AttentionItem {
  int64_t seq, kv_head_begin, kv_head_end, token_begin, token_end;
  int64_t page_begin = 0, page_end = std::numeric_limits<int64_t>::max();  // the part of the pages it reads
  int64_t partial = -1;  // >= 0: one part of a split decode, its state stored at partials + partial
};

// A split decode's parts (consecutive items), merged once every part is done.
struct MergeItem {
  int64_t first, count;
};

// One page-row of K or V for one KV head, as float32 (widened into `scratch` for a bf16 cache).
inline const float* KvRow(const AttentionArgs& a, const void* pages, int64_t page, int64_t slot, int64_t kv_head,
                          float* scratch) {
  const int64_t offset = ((page * a.page_size + slot) * a.kv_heads + kv_head) * a.head_dim;
  if (!a.kv_bf16) return static_cast<const float*>(pages) + offset;
  const uint16_t* row = static_cast<const uint16_t*>(pages) + offset;
  int64_t d = 0;
#ifdef __AVX512F__
  for (; d + 16 <= a.head_dim; d += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d));
    _mm512_storeu_ps(scratch + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
#endif
  for (; d + 8 <= a.head_dim; d += 8) _mm256_storeu_ps(scratch + d, LoadBf16x8(row + d));
  for (; d < a.head_dim; ++d) scratch[d] = Bf16ToFloat(row[d]);
  return scratch;
}

// Asks for a page's K and V ahead of their use: one KV head's rows (each its own short run of lines), or with
// kv_head < 0 the whole page, every head (one contiguous run each for K and V).
inline void PrefetchPage(const AttentionArgs& a, int64_t page, int64_t kv_head) {
  if (page < 0 || page >= a.num_pages) return;
  const int64_t row_bytes = a.head_dim * (a.kv_bf16 ? 2 : 4);
  const int64_t slot_bytes = a.kv_heads * row_bytes;
  for (const void* pages : {a.k_pages, a.v_pages}) {
    const char* base = static_cast<const char*>(pages) + page * a.page_size * slot_bytes;
    if (kv_head < 0) {
      for (int64_t offset = 0; offset < a.page_size * slot_bytes; offset += 64) _mm_prefetch(base + offset, _MM_HINT_T0);
      continue;
    }
    for (int64_t slot = 0; slot < a.page_size; ++slot) {
      const char* row = base + slot * slot_bytes + kv_head * row_bytes;
      for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(row + offset, _MM_HINT_T0);
    }
  }
}


// Reads one word of every line of pages [first, end) (one KV head's rows, or whole pages for kv_head < 0). Demand
// loads in a loop of nothing else keep many misses in flight, where prefetches interleaved with the arithmetic did
// not; the lines then wait in L1/L2 for the arithmetic.
inline void TouchPages(const AttentionArgs& a, const int32_t* pages, int64_t first, int64_t end, int64_t kv_head) {
  const int64_t row_bytes = a.head_dim * (a.kv_bf16 ? 2 : 4);
  const int64_t slot_bytes = a.kv_heads * row_bytes;
  uint32_t sink = 0;
  for (int64_t p = first; p < end; ++p) {
    const int64_t page = pages[p];
    if (page < 0 || page >= a.num_pages) continue;
    for (const void* kv : {a.k_pages, a.v_pages}) {
      const char* base = static_cast<const char*>(kv) + page * a.page_size * slot_bytes;
      const int64_t runs = kv_head < 0 ? 1 : a.page_size;  // whole pages: one run; one head: a run a slot
      const int64_t run_bytes = kv_head < 0 ? a.page_size * slot_bytes : row_bytes;
      for (int64_t r = 0; r < runs; ++r) {
        const char* run = base + (kv_head < 0 ? 0 : r * slot_bytes + kv_head * row_bytes);
        for (int64_t offset = 0; offset < run_bytes; offset += 64) {
          sink += *reinterpret_cast<const volatile uint32_t*>(run + offset);
        }
      }
    }
  }
  asm volatile("" : : "r"(sink));  // the loads stay
}

// Four dot products q . k_i at once (size a multiple of 8); the four horizontal sums share three hadds.
inline __m128 Dot4Avx2(const float* q, const float* const* k, int64_t size) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < size; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
  }
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

#ifdef __AVX512F__
// Four dot products q . k_i at once: 16 lanes where the size allows.
inline __m128 Dot4(const float* q, const float* const* k, int64_t size) {
  if (size % 16 != 0) return Dot4Avx2(q, k, size);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < size; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[0] + i), a0);
    a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[1] + i), a1);
    a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[2] + i), a2);
    a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[3] + i), a3);
  }
  auto fold = [](__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); };
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(fold(a0), fold(a1)), _mm256_hadd_ps(fold(a2), fold(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}
#else
inline __m128 Dot4(const float* q, const float* const* k, int64_t size) { return Dot4Avx2(q, k, size); }
#endif

// out[0..64) += sum_j weights[j] * v[j][0..64), with the output row held in eight registers.
inline void AccumulateRow64(float* out, const float* weights, const float* const* v, int64_t keys) {
#ifdef __AVX512F__
  __m512 o[4];
  for (int64_t i = 0; i < 4; ++i) o[i] = _mm512_loadu_ps(out + 16 * i);
  for (int64_t j = 0; j < keys; ++j) {
    const __m512 w = _mm512_set1_ps(weights[j]);
    for (int64_t i = 0; i < 4; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v[j] + 16 * i), o[i]);
  }
  for (int64_t i = 0; i < 4; ++i) _mm512_storeu_ps(out + 16 * i, o[i]);
#else
  __m256 o[8];
  for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_loadu_ps(out + 8 * i);
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 w = _mm256_set1_ps(weights[j]);
    for (int64_t i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + 8 * i), o[i]);
  }
  for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
#endif
}

#ifdef __AVX512F__
// A bfloat16 cache read straight into registers (head_dim 64 or 128: C = head_dim / 16 vectors a row), for the
// page-heads of decode and short prefill blocks: no widened copy of the page, and each K or V row is widened once
// for all the item's rows of that head.

inline __m512 WidenBf16x16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// scores[r * stride_s + j] = q_r . k_j for `rows` rows of q (pre-scaled, [rows, 16 C]) and keys j < keys, the K row
// of key j at k + j * stride_k (bfloat16 bits); 16 / C keys at a time, their four sums folded together.
template <int C>
void ScoresBf16(const float* q, int64_t rows, const uint16_t* k, int64_t stride_k, int64_t keys, float* scores,
                int64_t stride_s) {
  constexpr int kKeys = 16 / C;  // keys held widened in registers at once: 16 vectors
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, keys - j0);
    __m512 kv[kKeys][C];
    for (int kk = 0; kk < kKeys; ++kk)
      for (int c = 0; c < C; ++c) {
        kv[kk][c] = kk < count ? WidenBf16x16(k + (j0 + kk) * stride_k + 16 * c) : _mm512_setzero_ps();
      }
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * 16 * C;
      float sums[kKeys];
      for (int kk = 0; kk < kKeys; ++kk) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[kk][0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kv[kk][c], acc);
        sums[kk] = _mm512_reduce_add_ps(acc);
      }
      for (int64_t kk = 0; kk < count; ++kk) scores[r * stride_s + j0 + kk] = sums[kk];
    }
  }
}

// out_r += sum_j p[r * stride_p + j] * v_j for R rows whose outputs ([R, 16 C]) stay in registers.
template <int C, int R>
void AccumulateBf16(float* out, const float* p, int64_t stride_p, const uint16_t* v, int64_t stride_v,
                    int64_t keys) {
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_loadu_ps(out + (r * C + c) * 16);
  for (int64_t j = 0; j < keys; ++j) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = WidenBf16x16(v + j * stride_v + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * stride_p + j]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, o[r][c]);
}

// The same for any number of rows: blocks of up to 24 / C rows (the registers' worth).
template <int C>
void AccumulateRowsBf16(float* out, int64_t rows, const float* p, int64_t stride_p, const uint16_t* v,
                        int64_t stride_v, int64_t keys) {
  constexpr int kMax = 24 / C;
  for (int64_t r = 0; r < rows; r += kMax) {
    float* o = out + r * 16 * C;
    const float* pr = p + r * stride_p;
    switch (std::min<int64_t>(kMax, rows - r)) {
      case 1: AccumulateBf16<C, 1>(o, pr, stride_p, v, stride_v, keys); break;
      case 2: AccumulateBf16<C, 2>(o, pr, stride_p, v, stride_v, keys); break;
      case 3: AccumulateBf16<C, 3>(o, pr, stride_p, v, stride_v, keys); break;
      case 4: AccumulateBf16<C, (4 <= kMax ? 4 : kMax)>(o, pr, stride_p, v, stride_v, keys); break;
      case 5: AccumulateBf16<C, (5 <= kMax ? 5 : kMax)>(o, pr, stride_p, v, stride_v, keys); break;
      default: AccumulateBf16<C, kMax>(o, pr, stride_p, v, stride_v, keys); break;
    }
  }
}
#endif

// Without AVX-512, the few rows of a decode (R <= 4: one token's query heads of a KV head) read each K or V row
// into registers (a bfloat16 one widened there) once for all R rows. Widening a bf16 page into a float32 copy first,
// then one row's dot products at a time, took twice as long: an item of 10 pages x 3 rows, the same item run twice
// in a decode step (its pages warm), took 14 us that way and 8 us this way. Both stay out of line: inlined into
// AttendItem they cost the float32 cache's path (not otherwise changed) 1-5% of 32-sequence throughput.

// Row r's two sums of the accumulator pairs (a0, a1) and (b0, b1) of rows r and r + 1 -> [a0, a1, b0, b1].
inline __m128 PairSums(__m256 a0, __m256 a1, __m256 b0, __m256 b1) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(b0, b1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores[r * stride_s + j] = q_r . k_j for R <= 4 rows of q (pre-scaled, [R, d_size], d_size a multiple of 8) and
// keys j < keys, the K row of key j at k + j * stride_k (bfloat16 bits): two keys at a time, widened in registers,
// against every row. The accumulators are named variables: held in an array, GCC kept them on the stack.
template <int R>
__attribute__((noinline)) void ScoresAvx2(const float* q, int64_t d_size, const uint16_t* k, int64_t stride_k,
                                          int64_t keys, float* scores, int64_t stride_s) {
  for (int64_t j = 0; j < keys; j += 2) {
    const uint16_t* k0 = k + j * stride_k;
    const uint16_t* k1 = j + 1 < keys ? k0 + stride_k : k0;  // an odd last key is read twice, its copy dropped
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t c = 0; c < d_size; c += 8) {
      const __m256 x0 = Load8(k0 + c), x1 = Load8(k1 + c);
      __m256 qv = _mm256_loadu_ps(q + c);
      a00 = _mm256_fmadd_ps(qv, x0, a00);
      a01 = _mm256_fmadd_ps(qv, x1, a01);
      if constexpr (R > 1) {
        qv = _mm256_loadu_ps(q + d_size + c);
        a10 = _mm256_fmadd_ps(qv, x0, a10);
        a11 = _mm256_fmadd_ps(qv, x1, a11);
      }
      if constexpr (R > 2) {
        qv = _mm256_loadu_ps(q + 2 * d_size + c);
        a20 = _mm256_fmadd_ps(qv, x0, a20);
        a21 = _mm256_fmadd_ps(qv, x1, a21);
      }
      if constexpr (R > 3) {
        qv = _mm256_loadu_ps(q + 3 * d_size + c);
        a30 = _mm256_fmadd_ps(qv, x0, a30);
        a31 = _mm256_fmadd_ps(qv, x1, a31);
      }
    }
    const int64_t count = std::min<int64_t>(2, keys - j);
    float sums[8];
    _mm_storeu_ps(sums, PairSums(a00, a01, a10, a11));
    if constexpr (R > 2) _mm_storeu_ps(sums + 4, PairSums(a20, a21, a30, a31));
    for (int r = 0; r < R; ++r)
      for (int64_t kk = 0; kk < count; ++kk) scores[r * stride_s + j + kk] = sums[2 * r + kk];
  }
}

// out_r[0, d_size) += sum_j p[r * stride_p + j] * v_j (V rows as bfloat16 bits) for R rows, d_size a multiple of
// 8 kVectors: kVectors * 8 columns at a time, R x kVectors accumulators, R broadcast weights and one V vector in
// registers.
template <int R>
__attribute__((noinline)) void AccumulateAvx2(float* out, int64_t d_size, const float* p, int64_t stride_p,
                                              const uint16_t* v, int64_t stride_v, int64_t keys) {
  constexpr int kVectors = R <= 3 ? 4 : 2;
  for (int64_t c = 0; c < d_size; c += 8 * kVectors) {
    __m256 o[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kVectors; ++i) o[r][i] = _mm256_loadu_ps(out + r * d_size + c + 8 * i);
    for (int64_t j = 0; j < keys; ++j) {
      __m256 w[R];
      for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(p + r * stride_p + j);
      for (int i = 0; i < kVectors; ++i) {
        const __m256 vv = Load8(v + j * stride_v + c + 8 * i);
        for (int r = 0; r < R; ++r) o[r][i] = _mm256_fmadd_ps(w[r], vv, o[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(out + r * d_size + c + 8 * i, o[r][i]);
  }
}

// Calls fn(std::integral_constant<int, R>) for R = rows (1 to 4).
template <typename Fn>
void WithRows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// An item's rows are, for each of its KV heads, its tokens times the query heads of the group. Pages are visited
// once, in order, with every head of the item on a page before the next page: with all heads, a page's K (then V)
// is one contiguous run read front to back, which the prefetchers follow.
void StoreAttentionRows(const AttentionArgs& a, const AttentionItem& item, const float* acc);

// The first key a query at `pos` sees (a sliding window hides the older ones).
inline int64_t LowestKey(const AttentionArgs& a, int64_t pos) {
  return a.sliding_window > 0 ? std::max<int64_t>(0, pos - a.sliding_window + 1) : 0;
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
      // bfloat16 only: float32 rows are read in place without widening, and this order was no faster for them.
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
        const bool all_visible = a.soft_cap <= 0 && key_begin + keys - 1 <= pos &&
                                 (a.sliding_window <= 0 || key_begin > pos - a.sliding_window);
        if (all_visible) {  // the usual case, without a branch per key
          page_max = MaxOf(s, keys);
        } else {
          for (int64_t j = 0; j < keys; ++j) {
            const int64_t key_pos = key_begin + j;
            const bool visible = key_pos <= pos && (a.sliding_window <= 0 || key_pos > pos - a.sliding_window);
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
    const float inv = row_sum[r] > 0 ? 1.0f / row_sum[r] : 0.0f;
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
  if (!a.kv_bf16 && k_type != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("jserve: the KV cache must be float32 or bfloat16");
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
    const float inv = sum > 0 ? 1.0f / sum : 0.0f;
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
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t sliding_window, float soft_cap) {
  CallClock call_clock(kAttentionCall);
  const auto q_dims = q.dimensions();
  if (q_dims.size() != 3) return ffi::Error::InvalidArgument("jserve_paged_attention: expected q[T, H, D]");
  AttentionArgs a;
  ffi::Error shapes = AttentionShapes(a, q_dims[1], q_dims[2], k_pages.dimensions(), page_table.dimensions(),
                                      k_pages.element_type(), v_pages.element_type());
  if (shapes.failure()) return shapes;
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

// ---------------------------------------------------------------------------------------------------------------
// One decoder layer in one call: nine phases (norm, qkv, rotary + K/V write, attention, o + residual, norm,
// gate/up, SiLU, down + residual; six where each thread streams its own weight part and makes each norm's and the
// SiLU's output itself) over the real tokens only (bucket padding costs nothing). The matmul inputs are
// float32 for float32 weights and bfloat16 bits for bfloat16 ones, rounded once where they are produced.

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
// half floats on (the same bits as before). Each layer's rotary phase computed them anew, D calls of std::cos or
// std::sin a token; at batch 1 that phase (one thread's, the other waiting) now runs ~0.15 us shorter a layer
// (benchmarks/phase_profile.py); what is left is presumably reading the q/k/v rows the other core wrote.
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
};

// Appends one layer's ten phases, or seven with owned items (attention is two: its items, then the merges of
// split decodes). Matmul inputs:
// float32, or for bfloat16 weights (plain or packed) Bf16Input: bfloat16 bits for vdpbf16ps, else float32 rounded
// to bfloat16 values.
template <typename X, typename W>
void AppendLayerPhases(std::vector<Phase>& phases, LayerRun<W>& r, const AttentionPlan& plan,
                       const LayerScratch<X>& scratch, int64_t threads) {
  constexpr bool round = !(std::is_same_v<W, float> || std::is_same_v<W, F32Panels>);  // bf16 weights: rounded
  const LayerShape& s = r.s;
  const LayerWeights<W>& w = r.w;
  AttentionArgs& a = r.a;
  const int64_t t_size = s.tokens, e = s.hidden, i_size = s.intermediate, d = a.head_dim;
  const int64_t q_size = a.num_heads * d, kv_size = a.kv_heads * d, qkv_size = q_size + 2 * kv_size;
  X* in = scratch.in;
  float* qkv_rows = scratch.qkv;
  float* gate_up_rows = scratch.gate_up;
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
    if constexpr (std::is_same_v<W, F32Panels> || std::is_same_v<W, uint32_t>) {
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
    if (slot >= 0 && slot < a.num_pages * a.page_size) {
      StoreKv(run->k_pages, a.kv_bf16, slot, k, kv_size);
      StoreKv(run->v_pages, a.kv_bf16, slot, v, kv_size);
    }
  }); }, false, kRotaryPhase});
  for (Phase& phase : AttentionPhases(a, plan)) phases.push_back(std::move(phase));
  phases.push_back(
      MatmulPhase(MatmulJob<X, W>{in, w.o, s.x_out, w.o_bias, true, t_size, e, q_size, PartsOf(w, 1)}, threads));
  phases.back().kind = kOPhase;
  append_matmul(
      MatmulJob<X, W>{in, w.gate_up, gate_up_rows, w.gate_up_bias, false, t_size, 2 * i_size, e, PartsOf(w, 2)},
      kGateUpPhase,
      [run](int64_t t0, int64_t t1, X* x) {
        const LayerShape& s = run->s;
        for (int64_t t = t0; t < t1; ++t)
          RmsNormRow(s.x_out + t * s.hidden, run->w.post_norm, s.hidden, s.eps, x + t * s.hidden, round);
      },
      nothing);
  append_matmul(MatmulJob<X, W>{in, w.down, s.x_out, w.down_bias, true, t_size, e, i_size, PartsOf(w, 3)}, kDownPhase,
                [gate_up_rows, i_size](int64_t t0, int64_t t1, X* x) {
                  thread_local std::vector<float> act;
                  act.resize(static_cast<size_t>(i_size));
                  for (int64_t t = t0; t < t1; ++t) {
                    const float* gate = gate_up_rows + t * 2 * i_size;
                    SiluMul(gate, gate + i_size, act.data(), i_size);
                    StoreInput(x + t * i_size, act.data(), i_size, round);
                  }
                },
                nothing);
}

// Every layer in one pass over the pool: a layer's phases follow the one before's with no return to XLA between
// them (a call's setup and XLA's step to the next call cost 10-17 us a layer on caches the weights just flushed).
// The phases point into `layers` and `plan`, which must outlive them.
template <typename W>
SharedPhases DecoderLayerPhases(std::vector<LayerRun<W>>& layers, const AttentionPlan& plan, int64_t threads) {
  constexpr bool f32_weights = std::is_same_v<W, float> || std::is_same_v<W, F32Panels>;
  using X = std::conditional_t<f32_weights, float, Bf16Input>;
  const LayerShape& s = layers[0].s;
  const AttentionArgs& a = layers[0].a;
  const int64_t t_size = s.tokens, q_size = a.num_heads * a.head_dim;
  thread_local std::vector<X> inputs;
  thread_local std::vector<float> qkv;
  thread_local std::vector<float> gate_up;
  inputs.resize(static_cast<size_t>(t_size * std::max({s.hidden, q_size, s.intermediate})));
  qkv.resize(static_cast<size_t>(t_size * (q_size + 2 * a.kv_heads * a.head_dim)));
  gate_up.resize(static_cast<size_t>(t_size * 2 * s.intermediate));
  // The phases run on other threads too: they get these pointers, never the thread_local names.
  const LayerScratch<X> scratch{inputs.data(), qkv.data(), gate_up.data()};
  auto phases = std::make_shared<std::vector<Phase>>();
  phases->reserve(10 * layers.size());
  thread_local std::vector<float> partials;  // split decodes' parts, reused by every layer in turn
  partials.resize(static_cast<size_t>(plan.partial_floats));
  for (LayerRun<W>& layer : layers) {
    layer.a.partials = partials.data();
    AppendLayerPhases(*phases, layer, plan, scratch, threads);
  }
  return phases;
}

const float* Optional(ffi::Buffer<ffi::F32>& b) {
  return b.element_count() == 0 ? nullptr : b.typed_data();
}

// A layer's 12 weight operands, in the order cpu_kernels.decoder_layers passes them.
constexpr size_t kLayerWeightArgs = 12;

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
};

ffi::Error LayerBuffersAt(const ffi::RemainingArgs& args, size_t layer, std::vector<LayerBuffers>& out) {
  const size_t base = layer * kLayerWeightArgs;
  auto f32 = [&](size_t i) { return args.get<ffi::Buffer<ffi::F32>>(base + i); };
  auto any = [&](size_t i) { return args.get<ffi::AnyBuffer>(base + i); };
  auto input_norm = f32(0), qkv_bias = f32(2), q_norm = f32(3), k_norm = f32(4), o_bias = f32(6),
       post_norm = f32(7), gate_up_bias = f32(9), down_bias = f32(11);
  auto qkv = any(1), o = any(5), gate_up = any(8), down = any(10);
  for (const auto* b : {&input_norm, &qkv_bias, &q_norm, &k_norm, &o_bias, &post_norm, &gate_up_bias, &down_bias}) {
    if (b->has_error()) return b->error();
  }
  for (const auto* b : {&qkv, &o, &gate_up, &down}) {
    if (b->has_error()) return b->error();
  }
  out.push_back({*input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias,
                 *down, *down_bias});
  return ffi::Error::Success();
}

// Stacked weights: each of the 12 operands holds every layer, layer first ([L, ...]; an empty one stands for every
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
                   F32(v + 6), F32(v + 7), ffi::AnyBuffer(v + 8), F32(v + 9), ffi::AnyBuffer(v + 10), F32(v + 11)});
  }
  return ffi::Error::Success();
}

template <typename W>
LayerWeights<W> Weights(LayerBuffers& b) {
  return {b.input_norm.typed_data(), static_cast<const W*>(b.qkv.untyped_data()), Optional(b.qkv_bias),
          Optional(b.q_norm), Optional(b.k_norm), static_cast<const W*>(b.o.untyped_data()), Optional(b.o_bias),
          b.post_norm.typed_data(), static_cast<const W*>(b.gate_up.untyped_data()), Optional(b.gate_up_bias),
          static_cast<const W*>(b.down.untyped_data()), Optional(b.down_bias)};
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
  if (!matrices_ok || !norm_ok(b.input_norm) ||
      !norm_ok(b.post_norm) || !bias_ok(b.qkv_bias, q_size + 2 * kv_size) || !bias_ok(b.o_bias, e) ||
      !bias_ok(b.gate_up_bias, 2 * i_size) || !bias_ok(b.down_bias, e) ||
      (b.q_norm.element_count() != 0 && (static_cast<int64_t>(b.q_norm.element_count()) != d ||
                                         static_cast<int64_t>(b.k_norm.element_count()) != d))) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: weight shapes or dtypes disagree with the layer");
  }
  return ffi::Error::Success();
}

// Every layer's matrices in per-thread parts (cpu_kernels.PartLayout): one [P, L, U] array of packed
// weights (bfloat16 pairs as uint32, or float32) where part p of layer l holds, one after another from its start,
// blocks [n P_p, n P_(p+1)) with P_p = p / P of qkv, o, gate_up and down (n blocks each), U the largest part. The
// other three matrix operands must be empty. -> each layer's parts of its four matrices.
struct MatrixPartsOf {
  std::array<std::vector<int64_t>, 4> begin;     // per matrix: [parts + 1]
  std::array<std::vector<const float*>, 4> base;  // per matrix: layer 0's parts
  std::vector<std::array<BlockParts, 4>> layers;  // pointing into the above
};

ffi::Error MatrixParts(const ffi::AnyBuffer& regions, const ffi::RemainingArgs& args, int64_t parts,
                       int64_t num_layers, int64_t q_size, int64_t kv_size, int64_t e, int64_t i_size,
                       MatrixPartsOf& out) {
  const auto dims = regions.dimensions();
  const bool pairs = regions.element_type() == ffi::DataType::U32;
  const std::array<int64_t, 4> n_sizes{q_size + 2 * kv_size, e, 2 * i_size, e}, k_sizes{e, q_size, e, i_size};
  bool ok = dims.size() == 3 && dims[0] == parts && dims[1] == num_layers && i_size > 0 &&
            (pairs || regions.element_type() == ffi::DataType::F32);
  for (size_t i : {5, 8, 10}) {
    ffi::ErrorOr<ffi::AnyBuffer> empty = args.get<ffi::AnyBuffer>(i);
    ok = ok && !empty.has_error() && empty->element_count() == 0;
  }
  std::array<int64_t, 4> blocks{}, block_units{};
  for (size_t k = 0; k < 4; ++k) {
    ok = ok && !(pairs && k_sizes[k] % 2 != 0);
    blocks[k] = Blocks(n_sizes[k], 2 * kPanel);
    block_units[k] = 2 * kPanel * (pairs ? k_sizes[k] / 2 : k_sizes[k]);
  }
  int64_t layer_units = 0;
  for (int64_t p = 0; p < parts; ++p) {
    int64_t units = 0;
    for (size_t k = 0; k < 4; ++k) units += (blocks[k] * (p + 1) / parts - blocks[k] * p / parts) * block_units[k];
    layer_units = std::max(layer_units, units);
  }
  if (!ok || dims[2] != layer_units) {
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

// What a layer call's phases point into: the layers' arguments and their matrices' parts.
template <typename W>
struct LayerStorage {
  MatrixPartsOf parts;
  std::vector<LayerRun<W>> layers;
};

// A thread's last layer call, kept for its next. A decode's calls, step after step, differ only in what their
// buffers hold, and building a call's ~200 phases and the 30 layers' arguments they point into took ~45 us where the
// memory reads ~65 GB/s: each store into a line the weight stream had flushed waited on it (docs/benchmarks.md,
// seventeenth session). A call whose key and attention items equal the last one's runs the same phases again.
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
                             int64_t intermediate_size) {
  CallClock call_clock(kLayersCall);
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || num_heads <= 0) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: expected x[T, E]");
  }
  const int64_t threads = pool.num_threads();
  const std::vector<int64_t>& key = LayerCallKey(
      args, rets, {num_heads, BitsOf(eps), BitsOf(scale), sliding_window, BitsOf(soft_cap), weight_parts,
                   intermediate_size, threads},
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
  // The weights come per layer (12 operands a layer) or stacked (12 operands, each [L, ...]: see StackedLayerBuffers),
  // then the K/V pages, each array aliased to its result: every layer's k_pages, then every layer's v_pages, or
  // stacked, one k[L, N, B, Hkv, D] and one v. Stacked, they are 14 arrays whatever the depth (a jitted step pays
  // its dispatch per array).
  const size_t kv_arrays = rets.size();
  ffi::ErrorOr<ffi::AnyBuffer> norms = args.get<ffi::AnyBuffer>(0);
  if (norms.has_error()) return norms.error();
  const bool stacked_weights = args.size() == kLayerWeightArgs + kv_arrays && norms->dimensions().size() == 2;
  const size_t num_layers = stacked_weights ? static_cast<size_t>(norms->dimensions()[0])
                            : args.size() >= kv_arrays ? (args.size() - kv_arrays) / kLayerWeightArgs : 0;
  const size_t weight_args = stacked_weights ? kLayerWeightArgs : num_layers * kLayerWeightArgs;
  if (num_layers == 0 || kv_arrays < 2 || args.size() != weight_args + kv_arrays) {
    return ffi::Error::InvalidArgument("jserve_decoder_layers: expected 12 weights a layer (or stacked), then k/v pages");
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
  const bool stacked = kv_arrays == 2 && all_kv_dims.size() == 5;
  if (stacked ? all_kv_dims[0] != static_cast<int64_t>(num_layers) : kv_arrays != 2 * num_layers) {
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
    if (pages->element_type() != k0->element_type() ||
        !std::equal(dims.begin(), dims.end(), all_kv_dims.begin(), all_kv_dims.end()) ||
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
  const LayerShape first{real_tokens, e, i_size, eps, x.typed_data(), x_out->typed_data(),
                         slot_mapping.typed_data(), cache.rotary.data()};
  const int64_t stacked_layer_bytes =
      stacked ? a.num_pages * a.page_size * kv_size * (a.kv_bf16 ? 2 : 4) : 0;
  cache.args = a;
  if (packed && w_type == ffi::DataType::U32) {
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

// How many layer calls ran the phases their thread kept from the call before (LayerCallCache): its tests read it.
extern "C" int64_t JserveCachedLayerCalls() { return cached_layer_calls.load(std::memory_order_relaxed); }

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

// The memory's read bandwidth, the bound of a decode step that reads every weight once (jserve bench latency's
// roofline): `threads` threads each sum their share of a `bytes` buffer on 2 MiB pages where the kernel gives
// them, as the parameters are (checkpoints/host_arena.py); the best of `repeats` passes of plain loads and as many
// with the weight stream's prefetches (PrefetchAhead), in bytes/s. On an Intel Xeon the prefetched reads were ~12%
// faster (32.6 against 29.2 GB/s over 1 GiB), so plain loads alone understated the memory there.
extern "C" double JserveReadBandwidth(int64_t bytes, int64_t threads, int64_t repeats) {
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

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
                                  .RemainingArgs()                // 12 weights a layer (or stacked), then the pages
                                  .Ret<ffi::Buffer<ffi::F32>>()   // x_out
                                  .RemainingRets()                // the k_pages, then the v_pages (aliased)
                                  .Attr<int64_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("weight_parts")
                                  .Attr<int64_t>("intermediate_size"));
