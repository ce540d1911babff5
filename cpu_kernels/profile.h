#pragma once

// The phase profile (cpu_kernels.phase_profile): per worker, each kind of phase's time running and waiting,
// and per kernel its calls and their time.

#include "common.h"

namespace {

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

}  // namespace
