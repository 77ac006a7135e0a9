#pragma once
// Independent dense float64 attention for the tests: triple loops over the layout, no tiles, no AttentionCall.
#include <cmath>
#include <limits>
#include <vector>

#include "reference/tensor.hpp"
#include "reference/thd_layout.hpp"

namespace cpgold::test {

struct NaiveResult {
  Tensor3<double> o, dq, dk, dv;
  LseTensor<double> lse;
};

// q [tq, hq, dqk], k [tk, hk, dqk], v [tk, hk, dv], dout [tq, hq, dv]. wl/wr: -1 unbounded; bottom-right.
inline NaiveResult naive_attention(const ThdLayout& layout, const Tensor3<double>& q, const Tensor3<double>& k,
                                   const Tensor3<double>& v, const Tensor3<double>& dout, int wl, int wr,
                                   double scale) {
  const double ninf = -std::numeric_limits<double>::infinity();
  const int64_t hq = q.heads, hk = k.heads, group = hq / hk;
  NaiveResult r{Tensor3<double>(q.rows, hq, v.dim), Tensor3<double>(q.rows, hq, q.dim),
                Tensor3<double>(k.rows, hk, k.dim), Tensor3<double>(k.rows, hk, v.dim),
                LseTensor<double>(hq, q.rows, ninf)};
  for (int b = 0; b < layout.batch(); ++b) {
    const int64_t lq = layout.q.length(b), lk = layout.kv.length(b);
    const int64_t q0 = layout.q.offset(b), k0 = layout.kv.offset(b);
    auto allowed = [&](int64_t i, int64_t j) {
      const int64_t diag = i + lk - lq;
      if (wr >= 0 && j > diag + wr) return false;
      if (wl >= 0 && j < diag - wl) return false;
      return true;
    };
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / group;
      std::vector<std::vector<double>> p(lq, std::vector<double>(lk, 0.0));
      for (int64_t i = 0; i < lq; ++i) {
        std::vector<double> s(lk, ninf);
        double m = ninf;
        for (int64_t j = 0; j < lk; ++j) {
          if (!allowed(i, j)) continue;
          double dot = 0;
          for (int64_t x = 0; x < q.dim; ++x) dot += q(q0 + i, h, x) * k(k0 + j, g, x);
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        if (m == ninf) continue;
        double l = 0;
        for (int64_t j = 0; j < lk; ++j) l += s[j] == ninf ? 0.0 : std::exp(s[j] - m);
        r.lse(h, q0 + i) = m + std::log(l);
        for (int64_t j = 0; j < lk; ++j) p[i][j] = s[j] == ninf ? 0.0 : std::exp(s[j] - m) / l;
        for (int64_t x = 0; x < v.dim; ++x) {
          double acc = 0;
          for (int64_t j = 0; j < lk; ++j) acc += p[i][j] * v(k0 + j, g, x);
          r.o(q0 + i, h, x) = acc;
        }
      }
      for (int64_t i = 0; i < lq; ++i) {
        double d = 0;
        for (int64_t x = 0; x < v.dim; ++x) d += dout(q0 + i, h, x) * r.o(q0 + i, h, x);
        for (int64_t j = 0; j < lk; ++j) {
          if (p[i][j] == 0.0) continue;
          double dp = 0;
          for (int64_t x = 0; x < v.dim; ++x) {
            dp += dout(q0 + i, h, x) * v(k0 + j, g, x);
            r.dv(k0 + j, g, x) += p[i][j] * dout(q0 + i, h, x);
          }
          const double ds = p[i][j] * (dp - d);
          for (int64_t x = 0; x < q.dim; ++x) {
            r.dq(q0 + i, h, x) += scale * ds * k(k0 + j, g, x);
            r.dk(k0 + j, g, x) += scale * ds * q(q0 + i, h, x);
          }
        }
      }
    }
  }
  return r;
}

}  // namespace cpgold::test
