#pragma once
// Shared checks of the sim tests: run a case through the CP executor (float64) and the non-CP reference and compare.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include "reference/attention.hpp"
#include "reference/splitmix64.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/plan/coverage.hpp"
#include "sim/program/executor.hpp"

namespace cpgold::sim::testing {

// max |a - b| / max(max |b|, tiny) over elements; NaN anywhere gives +inf.
inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / std::max(scale, 1e-300);
}

struct Comparison {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  bool lse_inf_match = true;
  bool pads_zero = true;
  bool finite = true;
  double worst() const { return std::max({o, lse, dq, dk, dv}); }
};

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// Runs the oracle CP executor on the case and compares the gathered outputs with the non-CP float64 reference.
inline Comparison compare_with_reference(const CaseSpec& spec) {
  const Plan plan = make_plan(spec);
  const CaseInputs in = make_case_inputs(spec);
  const ThdLayout l = layout(spec);
  const AttentionCall call = non_cp_call(l, mask_window(spec), softmax_scale(spec));
  const auto q = tensor_cast<double>(in.q), k = tensor_cast<double>(in.k), v = tensor_cast<double>(in.v),
             dout = tensor_cast<double>(in.dout);
  const auto ref_f = attention_forward(call, q, k, v);
  const auto ref_b = attention_backward(call, q, k, v, ref_f.o, ref_f.lse, dout);
  const CpRun<double> run = run_cp_oracle(plan, in);
  const GlobalOutputs<double> got = gather_outputs(plan, run.ranks);
  Comparison c;
  c.o = relative_error(got.o.values, ref_f.o.values);
  c.dq = relative_error(got.dq.values, ref_b.dq.values);
  c.dk = relative_error(got.dk.values, ref_b.dk.values);
  c.dv = relative_error(got.dv.values, ref_b.dv.values);
  c.finite = all_finite(got.o.values) && all_finite(got.dq.values) && all_finite(got.dk.values) && all_finite(got.dv.values);
  std::vector<double> lg, lr;
  for (int64_t h = 0; h < got.lse.heads; ++h)
    for (int64_t r = 0; r < got.lse.rows; ++r) {
      if (!l.q.is_valid_row(r)) continue;
      const double a = got.lse(h, r), b = ref_f.lse(h, r);
      if (std::isinf(a) || std::isinf(b)) {
        if (!(a == -std::numeric_limits<double>::infinity() && b == a)) c.lse_inf_match = false;
        continue;
      }
      lg.push_back(a);
      lr.push_back(b);
    }
  c.lse = relative_error(lg, lr);
  // Pad and tail rows of O, dQ, dK, dV exactly zero, in every rank-local output as well.
  auto pads_zero = [](const Tensor3<double>& x, const PackedSequences& side, const std::vector<int64_t>& rows) {
    for (size_t i = 0; i < rows.size(); ++i)
      if (!side.is_valid_row(rows[i]))
        for (int64_t e = 0; e < x.row_stride(); ++e)
          if (x.values[i * x.row_stride() + e] != 0.0) return false;
    return true;
  };
  for (int r = 0; r < plan.cp_size; ++r) {
    const auto qi = plan.partition.q.gather_indices(r), ki = plan.partition.kv.gather_indices(r);
    const RankOutputs<double>& x = run.ranks[r];
    c.pads_zero = c.pads_zero && pads_zero(x.o, l.q, qi) && pads_zero(x.dq, l.q, qi) && pads_zero(x.dk, l.kv, ki) &&
                  pads_zero(x.dv, l.kv, ki);
  }
  return c;
}

inline void check_case(const CaseSpec& spec, double tol = 1e-12) {
  INFO("case: " << normalized_json(spec));
  const Comparison c = compare_with_reference(spec);
  CHECK(c.o <= tol);
  CHECK(c.lse <= tol);
  CHECK(c.dq <= tol);
  CHECK(c.dk <= tol);
  CHECK(c.dv <= tol);
  CHECK(c.lse_inf_match);
  CHECK(c.pads_zero);
  CHECK(c.finite);
  const Plan plan = make_plan(spec);
  const CoverageReport fwd = check_coverage(plan, PassKind::forward), bwd = check_coverage(plan, PassKind::backward);
  INFO("coverage: " << fwd.first_problem << " | " << bwd.first_problem);
  CHECK(fwd.ok());
  CHECK(bwd.ok());
}

// Small deterministic generator for test layouts (independent of std distributions).
using TestRng = SplitMix64;

// A random layout with the edge cases of docs/verification.md mixed in: zero lengths, length 1, lengths below 2W,
// lengths not divisible by 2W, a chunk r partly valid, extra padding between sequences.
inline std::vector<int32_t> random_lengths(TestRng& rng, int W, int batch, int max_len) {
  std::vector<int32_t> out;
  for (int b = 0; b < batch; ++b) {
    switch (rng.below(6)) {
      case 0: out.push_back(0); break;
      case 1: out.push_back(1); break;
      case 2: out.push_back(rng.below(2 * W)); break;
      default: out.push_back(rng.below(max_len + 1)); break;
    }
  }
  return out;
}

}  // namespace cpgold::sim::testing
