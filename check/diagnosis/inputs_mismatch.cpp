// inputs_mismatch: the inputs a candidate states against the fixture's digest, and outputs that are well-formed
// attention these inputs cannot give (docs/diagnosis.md).
#include "check/diagnosis/diagnoser.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

#include "fixtures/schema/fixture_schema.hpp"
#include "reference/input_error.hpp"
#include "reference/mask.hpp"

namespace cpgold::fx::diagnosis_detail {

// ---------------------------------------------------------------------------------------------------------------
// inputs_mismatch by digest: the inputs a candidate states (root attribute inputs_sha256, or a fixture given as the
// candidate) against the fixture's inputs digest, as the check compared them (report.inputs).
void Diagnoser::test_digest() {
  for (const InputsClaim& claim : report_.inputs) {
    if (claim.matches) continue;
    Finding f;
    f.kind = DiagnosisKind::inputs_mismatch;
    f.always = true;
    f.evidence = "the candidate " + claim.source + " was computed from other inputs: its inputs_sha256 is " +
                 claim.sha256.substr(0, 16) + "..., the fixture's inputs have " + report_.inputs_sha256.substr(0, 16) +
                 "...";
    for (size_t i = 0; i < subjects_.size(); ++i) f.rows[i] = subjects_[i].failing;
    f.where = where_of(f.rows);
    f.where["file"] = claim.source;
    f.where["method"] = "digest";
    f.where["candidate_inputs_sha256"] = claim.sha256;
    f.where["fixture_inputs_sha256"] = report_.inputs_sha256;
    if (!claim.case_json.empty()) f.where["candidate_case_json"] = claim.case_json;
    add(std::move(f));
    return;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// inputs_mismatch without digests: well-formed attention outputs (finite, pads zero, the keyless rows of the golden,
// sum over keys of dK = 0) that these inputs cannot give: O rows outside the range of their visible V rows, or dV
// summing to another dO than the fixture's (sum over keys of dV = sum over rows with keys of dO, per sequence and KV
// head). Tested only when nothing more specific fits.
void Diagnoser::test_inputs_by_recomputation() {
  for (const Subject& s : subjects_)
    for (size_t r = 0; r < s.failing.size(); ++r)
      if (s.pad_nonzero[r] || s.nonfinite[r]) return;  // not well-formed
  for (const TensorResult& r : report_.results)
    if (!r.missing && !r.evaluation.exact_ok()) return;
  load_inputs();
  const ThdLayout& l = fx().layout;
  // A global tensor of a quantity: the global candidate, or the ranks' candidates put together.
  auto global_of = [&](Quantity q, std::vector<double>& out, std::vector<int64_t>& dims) {
    const bool kv = is_kv_side(q);
    const Side& sd = side(kv);
    const std::vector<int64_t> gd = in_.golden->info(golden_path(q)).dims;
    dims = gd;
    out.assign(static_cast<size_t>(gd[0] * gd[1] * gd[2]), 0.0);
    if (const DiagnosisCandidate* c = candidate(-1, -1, 0, q)) {
      const TensorView<float> v = candidate_view(*c, gd, q);
      for (int64_t row = 0; row < gd[0]; ++row)
        for (int64_t h = 0; h < gd[1]; ++h)
          for (int64_t x = 0; x < gd[2]; ++x) out[static_cast<size_t>((row * gd[1] + h) * gd[2] + x)] = v(row, h, x);
      return true;
    }
    for (int r = 0; r < plan().cp_size; ++r) {
      const DiagnosisCandidate* c = candidate(r, -1, 0, q);
      if (!c) return false;
      const TensorView<float> v = candidate_view(*c, in_.golden->info(rank_output_path(r, q)).dims, q);
      for (int64_t row = 0; row < v.rows; ++row) {
        const int64_t g = sd.gather[static_cast<size_t>(r)][static_cast<size_t>(row)];
        for (int64_t h = 0; h < gd[1]; ++h)
          for (int64_t x = 0; x < gd[2]; ++x) out[static_cast<size_t>((g * gd[1] + h) * gd[2] + x)] = v(row, h, x);
      }
    }
    return true;
  };
  auto limit_of = [&](Quantity q, bool mean) {
    double limit = 0;
    for (const TensorResult& r : report_.results)
      if (r.tensor == quantity_name(q) && r.step < 0 && !r.missing)
        limit = std::max(limit, mean ? r.evaluation.limits.mean : r.evaluation.limits.max);
    return limit;
  };
  const Variant base = base_variant();
  std::vector<std::string> evidence;
  // Backward: dK sums to zero over each sequence's keys (well-formed), dV to the sum of dO over rows with keys.
  std::vector<double> dk, dvv;
  std::vector<int64_t> dkd, dvd;
  bool backward_wellformed = true;
  if (global_of(Quantity::dk, dk, dkd)) {
    const double limit = limit_of(Quantity::dk, false);
    for (int b = 0; b < l.batch() && backward_wellformed; ++b) {
      const int64_t n = l.kv.length(b);
      for (int64_t g = 0; g < dkd[1] && backward_wellformed; ++g)
        for (int64_t x = 0; x < dkd[2]; ++x) {
          double sum = 0;
          for (int64_t j = 0; j < n; ++j) sum += dk[static_cast<size_t>(((l.kv.offset(b) + j) * dkd[1] + g) * dkd[2] + x)];
          if (std::fabs(sum) > double(n) * limit + 1e-6) {
            backward_wellformed = false;
            break;
          }
        }
    }
    if (!backward_wellformed) return;
  }
  int64_t dout_components = 0, dout_off = 0;
  if (global_of(Quantity::dv, dvv, dvd)) {
    const double limit = limit_of(Quantity::dv, false), mean_limit = limit_of(Quantity::dv, true);
    const GoldenTensor& glse = golden(Quantity::lse);
    for (int b = 0; b < l.batch(); ++b) {
      const int64_t n = l.kv.length(b);
      if (n == 0) continue;
      for (int64_t g = 0; g < dvd[1]; ++g)
        for (int64_t x = 0; x < dvd[2]; ++x) {
          double sum_dv = 0, sum_do = 0;
          for (int64_t j = 0; j < n; ++j) sum_dv += dvv[static_cast<size_t>(((l.kv.offset(b) + j) * dvd[1] + g) * dvd[2] + x)];
          for (int h = static_cast<int>(g) * group_; h < (static_cast<int>(g) + 1) * group_; ++h)
            for (int64_t i = 0; i < l.q.length(b); ++i) {
              const int64_t row = l.q.offset(b) + i;
              if (!std::isfinite(double(glse.view(row, h, 0)))) continue;  // no key: no contribution
              sum_do += idout_(row, h, x);
            }
          const double tol = std::max(4 * std::sqrt(double(n)) * limit, double(n) * mean_limit) + 1e-6;
          ++dout_components;
          if (std::fabs(sum_dv - sum_do) > tol) ++dout_off;
        }
    }
  }
  const bool dout_differs = dout_components > 0 && 2 * dout_off >= dout_components;
  if (dout_differs)
    evidence.push_back("dV sums over each sequence's keys to another dO than the fixture's (" + std::to_string(dout_off) +
                       " of " + std::to_string(dout_components) + " sequence x KV head x dim sums off by more than the budget" +
                       (dkd.empty() ? "" : ", while dK sums to 0 as attention's backward must") + "): dout differs");
  // Forward: O and LSE wrong nearly everywhere, and O rows outside the range of the fixture's visible V rows.
  int64_t o_items = 0, o_bad = 0, lse_items = 0, lse_bad = 0;
  for (const Subject& s : subjects_) {
    if (s.quantity != Quantity::o && s.quantity != Quantity::lse) continue;
    for (int64_t row = 0; row < s.cand.rows; ++row) {
      const int64_t g = s.global[static_cast<size_t>(row)];
      if (!q_.valid[static_cast<size_t>(g)]) continue;
      for (int64_t h = 0; h < s.cand.heads; ++h) {
        if (!std::isfinite(double(golden(Quantity::lse).view(g, h, 0)))) continue;
        (s.lse ? lse_items : o_items) += 1;
        if (s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) (s.lse ? lse_bad : o_bad) += 1;
      }
    }
  }
  bool forward_other = false;
  if (o_items > 0 && lse_items > 0 && 10 * o_bad >= 9 * o_items && 10 * lse_bad >= 9 * lse_items) {
    std::vector<double> o;
    std::vector<int64_t> od;
    if (global_of(Quantity::o, o, od)) {
      const double limit = limit_of(Quantity::o, false);
      int64_t outside = 0, tested = 0;
      // Rows with the fewest visible keys say the most: the first rows of each sequence first, 512 at most.
      std::vector<std::pair<int64_t, int64_t>> rows;  // (visible keys, global row)
      for (int b = 0; b < l.batch(); ++b)
        for (int64_t i = 0; i < l.q.length(b); ++i) {
          int64_t keys = 0;
          for (int64_t j = 0; j < l.kv.length(b); ++j) keys += visible(base, b, i, j);
          if (keys > 0) rows.push_back({keys, l.q.offset(b) + i});
        }
      std::sort(rows.begin(), rows.end());
      if (rows.size() > 512) rows.resize(512);
      for (const auto& [keys, row] : rows) {
        const int b = q_.sequence[static_cast<size_t>(row)];
        const int64_t i = q_.position[static_cast<size_t>(row)];
        for (int64_t h = 0; h < od[1]; ++h) {
          const int g = h / group_;
          bool out = false;
          for (int64_t x = 0; x < od[2] && !out; ++x) {
            double lo = kInf, hi = -kInf;
            for (int64_t j = 0; j < l.kv.length(b); ++j)
              if (visible(base, b, i, j)) {
                const double v = iv_(l.kv.offset(b) + j, g, x);
                lo = std::min(lo, v), hi = std::max(hi, v);
              }
            const double c = o[static_cast<size_t>((row * od[1] + h) * od[2] + x)];
            out = c < lo - limit || c > hi + limit;
          }
          ++tested;
          outside += out;
        }
      }
      if (outside > 0) {
        forward_other = true;
        evidence.push_back("O and LSE are wrong on " + std::to_string(o_bad) + " of " + std::to_string(o_items) + " and " +
                           std::to_string(lse_bad) + " of " + std::to_string(lse_items) +
                           " valid rows x heads, and " + std::to_string(outside) + " of " + std::to_string(tested) +
                           " tested O rows lie outside the range of their visible V rows, which attention over these "
                           "inputs cannot give");
      }
    }
  }
  if (!forward_other && !dout_differs) return;
  Finding f;
  f.kind = DiagnosisKind::inputs_mismatch;
  f.evidence = "the outputs are well-formed attention (finite, pad rows 0, the golden's keyless rows) computed from other "
               "inputs: " + list_text(evidence, 2);
  for (size_t i = 0; i < subjects_.size(); ++i) f.rows[i] = subjects_[i].failing;
  f.where = where_of(f.rows);
  f.where["method"] = "recomputation";
  f.where["dout_differs"] = dout_differs;
  f.where["forward_differs"] = forward_other;
  add(std::move(f));
}

}  // namespace cpgold::fx::diagnosis_detail
