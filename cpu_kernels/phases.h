#pragma once

// Parallel phases over XLA's intra-op pool (RunPhases). A call is a list of phases run in order; each phase is `count`
// independent items claimed from a shared counter by the caller and by helper tasks on the pool, and a phase starts
// once every item of the one before is done. The caller works too and then waits only for items another thread
// has already claimed, so a helper that never gets a thread (or starts after the call returned) cannot block or
// touch freed memory: it finds no item left and returns. One helper wake-up serves every phase of a call, and a
// helper then lingers (Lingerers) so that the next call, a millisecond later in a decode step, needs none.

#include "inline_function.h"
#include "profile.h"

namespace {

// Which phase run this thread is running items of: a number no other phase run of the process has had, 0 between
// phases. Items of one phase on one thread may share work made from the phase's inputs (int8 matmuls quantize x
// once a thread and phase, not once an item): the same phases run again, from a layer call cache, get a new number.
inline uint64_t& CurrentPhaseRun() {
  thread_local uint64_t run = 0;
  return run;
}

// A block of numbers for one call's phases (one each), unused by any call before.
inline uint64_t NewPhaseRuns(size_t phases) {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(phases, std::memory_order_relaxed);
}

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
  const uint64_t first_run;  // phase p's CurrentPhaseRun: first_run + p

  explicit PhaseState(SharedPhases p)
      : shared(std::move(p)),
        phases(*shared),
        next(new std::atomic<int64_t>[phases.size()]),
        done(new std::atomic<int64_t>[phases.size()]),
        first_run(NewPhaseRuns(phases.size())) {
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
      CurrentPhaseRun() = first_run + p;
      if (phases[p].owned) {
        for (int64_t k = 0; k < count; ++k) {
          const int64_t i = (worker + k) % count;
          if ((next[p].fetch_or(int64_t{1} << i) >> i & 1) == 0) Run(p, i);
        }
        continue;
      }
      for (int64_t i = next[p].fetch_add(1); i < count; i = next[p].fetch_add(1)) Run(p, i);
    }
    CurrentPhaseRun() = 0;
    if (!phases.empty()) clock.Ran(phases.back().kind);
  }
};

// Helpers that stay a while after a call, each as one worker index: the next call hands its work to one directly.
// Waking a pool thread that has gone to sleep costs the caller ~90 us in a VM, once for every
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
    uint64_t run = NewPhaseRuns(phases.size());
    for (const Phase& p : phases) {
      CurrentPhaseRun() = run++;
      for (int64_t i = 0; i < p.count; ++i) p.body(i);
      clock.Ran(p.kind);
    }
    CurrentPhaseRun() = 0;
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

}  // namespace
