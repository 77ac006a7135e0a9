#pragma once
// The LSE merge of the second-half correction, logaddexp(a, b) = max + log1p(exp(min - max)), in float32 and built
// only from operations that IEEE 754 rounds correctly (fma, +, -, *, /, round-to-integer, scaling by a power of two):
// every platform that rounds to nearest and keeps subnormals gets the same bits. The CPU twin (sim/lse_halves) and
// the device kernel (gpu/kernels/thd_helpers/thd_cp_helpers.cu) instantiate this one template with their own operation sets, so the
// kernel is bit-exact against the twin without the libm of either side (host and CUDA expf / log1pf differ in the
// last bit). Accuracy: within 4 ulp of the double-precision formula (tests/sim/test_cp_helper_twins.cpp).
#include <limits>

namespace cpgold::sim {

// Ops: static fma(a, b, c), add, sub, mul, div (float, round to nearest), rint (to nearest even integer, as float)
// and pow2(int e) = 2^e for e in [-126, 127]. The template itself adds no operation of its own: every product that
// feeds a sum is an explicit fma, so no compiler contraction can change the result.
template <class Ops>
struct LseMergeFloat {
  // exp(d) for d <= 0 (d = -inf -> 0, NaN -> NaN); Cody-Waite reduction d = n ln2 + r, |r| <= 0.35, Taylor to r^7
  // (truncation below 0.13 ulp), scaled by 2^n in two exact-or-once-rounded steps so subnormal results round once.
  static constexpr float exp_nonpositive(float d) {
    if (d != d) return d;
    if (d < -104.f) return 0.f;  // exp(-104) = 6.8e-46 rounds to 0 (smallest subnormal 1.4e-45)
    const float n = Ops::rint(Ops::mul(d, 1.44269502f));
    float r = Ops::fma(n, -0.693145751953125f, d);  // ln2 high part: 16 significant bits, n * it is exact
    r = Ops::fma(n, -1.42860677e-06f, r);           // ln2 low part
    float p = 1.98412701e-04f;                      // 1/7!
    p = Ops::fma(p, r, 1.38888892e-03f);            // 1/6!
    p = Ops::fma(p, r, 8.33333377e-03f);            // 1/5!
    p = Ops::fma(p, r, 4.16666679e-02f);            // 1/4!
    p = Ops::fma(p, r, 1.66666672e-01f);            // 1/3!
    p = Ops::fma(p, r, 0.5f);
    p = Ops::fma(p, r, 1.f);
    p = Ops::fma(p, r, 1.f);
    int e = static_cast<int>(n);  // [-150, 0]
    if (e < -126) {
      p = Ops::mul(p, Ops::pow2(-64));  // exact: p stays normal
      e += 64;
    }
    return Ops::mul(p, Ops::pow2(e));
  }

  // log1p(u) for u in [0, 1]: 2 atanh(s), s = u / (2 + u) in [0, 1/3], series to s^17 (truncation below 1e-9).
  static constexpr float log1p_unit(float u) {
    const float s = Ops::div(u, Ops::add(2.f, u));
    const float z = Ops::mul(s, s);
    float q = 5.88235296e-02f;          // 1/17
    q = Ops::fma(q, z, 6.66666701e-02f);  // 1/15
    q = Ops::fma(q, z, 7.69230798e-02f);  // 1/13
    q = Ops::fma(q, z, 9.09090936e-02f);  // 1/11
    q = Ops::fma(q, z, 1.11111112e-01f);  // 1/9
    q = Ops::fma(q, z, 1.42857149e-01f);  // 1/7
    q = Ops::fma(q, z, 2.00000003e-01f);  // 1/5
    q = Ops::fma(q, z, 3.33333343e-01f);  // 1/3
    const float t = Ops::add(s, s);
    return Ops::fma(Ops::mul(t, z), q, t);
  }

  // logaddexp(a, b); two -inf give -inf, one -inf gives the other value exactly.
  static constexpr float merge(float a, float b) {
    const float hi = a > b ? a : b, lo = a > b ? b : a;
    if (hi == -std::numeric_limits<float>::infinity()) return hi;
    return Ops::add(hi, log1p_unit(exp_nonpositive(Ops::sub(lo, hi))));
  }
};

}  // namespace cpgold::sim
