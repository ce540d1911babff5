#pragma once

// InlineFunction: std::function without the heap, for the phases' bodies.

#include "common.h"

namespace {

// A callable with its captures stored in place, never on the heap: a layer call builds ~200 phases, and freeing
// std::function's allocations (three an owned matmul phase) costs the caller ~23 us a call where the memory reads
// ~65 GB/s, against ~2 us in place. A capture too large for `Bytes` fails to compile.
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

}  // namespace
