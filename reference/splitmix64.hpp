#pragma once
// splitmix64 (Steele, Lea and Flood, 2014): the one seeded generator behind every random layout, random case and
// input tensor. Its sequence is fixed by the seed alone and the same on every platform and compiler, where the
// std:: distributions are not; fixtures and their committed golden set depend on these exact bits.
#include <cstddef>
#include <cstdint>

namespace cpgold {

// The mixing function of a state that has already been advanced.
constexpr uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t kSplitMix64Increment = 0x9E3779B97F4A7C15ull;

// One step from x as a counter-based hash: splitmix64(x) is the first output of a generator seeded with x.
constexpr uint64_t splitmix64(uint64_t x) { return splitmix64_mix(x + kSplitMix64Increment); }

struct SplitMix64 {
  uint64_t state;
  uint64_t next() { return splitmix64_mix(state += kSplitMix64Increment); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }          // [0, 1)
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }  // [0, n)
  int between(int lo, int hi) { return lo + below(hi - lo + 1); }                   // [lo, hi]
  bool chance(int percent) { return below(100) < percent; }
  template <class T, size_t N>
  const T& pick(const T (&items)[N]) { return items[below(static_cast<int>(N))]; }
};

}  // namespace cpgold
