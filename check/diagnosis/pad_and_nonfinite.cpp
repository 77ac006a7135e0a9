// pad_rows_not_zero and nonfinite_leak: what pad and tail rows hold, and NaN or Inf anywhere (docs/diagnosis.md).
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
// pad_rows_not_zero and nonfinite_leak: what the exact classes saw, counted over every row.
void Diagnoser::test_nonfinite_and_pad() {
  Finding pad, nonfinite;
  pad.kind = DiagnosisKind::pad_rows_not_zero;
  nonfinite.kind = DiagnosisKind::nonfinite_leak;
  int64_t pad_rows = 0, tail_rows = 0, nf_pad = 0, nf_valid = 0;
  double largest = 0;
  std::set<int> pad_sequences, nf_sequences;
  std::vector<std::string> pad_names, nf_names;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    const Side& sd = side(s.kv);
    std::vector<uint8_t> p = flags(s.failing.size()), n = flags(s.failing.size());
    bool any_p = false, any_n = false;
    for (int64_t row = 0; row < s.cand.rows; ++row) {
      const size_t r = static_cast<size_t>(row);
      const int64_t g = s.global[r];
      const int seq = g >= 0 && g < static_cast<int64_t>(sd.sequence.size()) ? sd.sequence[static_cast<size_t>(g)] : -1;
      if (s.pad_nonzero[r] && !s.nonfinite[r]) {
        p[r] = 1, any_p = true;
        (seq >= 0 ? pad_rows : tail_rows) += 1;
        if (seq >= 0) pad_sequences.insert(seq);
        for (int64_t h = 0; h < s.cand.heads; ++h)
          for (int64_t x = 0; x < s.cand.dim; ++x) largest = std::max(largest, std::fabs(double(s.cand(row, h, x))));
      }
      if (s.nonfinite[r]) {
        n[r] = 1, any_n = true;
        const bool valid = g >= 0 && g < static_cast<int64_t>(sd.valid.size()) && sd.valid[static_cast<size_t>(g)];
        (valid ? nf_valid : nf_pad) += 1;
        if (seq >= 0 && valid) nf_sequences.insert(seq);
      }
    }
    if (any_p) pad.rows[i] = p, pad_names.push_back(s.name);
    if (any_n) nonfinite.rows[i] = n, nf_names.push_back(s.name);
  }
  if (!pad.rows.empty()) {
    std::ostringstream e;
    e << names_text(pad_names) << ": ";
    if (pad_rows) e << pad_rows << " pad row(s) of sequence(s) " << list_text(std::vector<int>(pad_sequences.begin(), pad_sequences.end()));
    if (pad_rows && tail_rows) e << " and ";
    if (tail_rows) e << tail_rows << " tail row(s) past the last sequence";
    e << " hold finite non-zero values (largest |x| = " << num(largest) << "); the contract has them exactly 0";
    pad.evidence = e.str();
    pad.where = where_of(pad.rows);
    pad.where["pad_rows"] = pad_rows;
    pad.where["tail_rows"] = tail_rows;
    add(std::move(pad));
  }
  if (!nonfinite.rows.empty()) {
    const sim::PadFill fill = fx().spec.pad_fill;
    const bool pads_nonfinite = fill == sim::PadFill::nan || fill == sim::PadFill::inf;
    std::ostringstream e;
    e << names_text(nf_names) << ": NaN/Inf in ";
    if (nf_valid) e << nf_valid << " valid row(s) of sequence(s) " << list_text(std::vector<int>(nf_sequences.begin(), nf_sequences.end()));
    if (nf_valid && nf_pad) e << " and ";
    if (nf_pad) e << nf_pad << " pad/tail row(s)";
    e << "; the inputs' pad rows hold " << sim::pad_fill_name(fill) << " (pad_fill)";
    if (pads_nonfinite) e << (nf_valid ? ": pad values reach valid outputs (pad keys or values are read into the arithmetic)"
                                       : ": pad values are written to pad rows instead of 0");
    else e << ": the non-finite values are made by the kernel, not read from pads";
    nonfinite.evidence = e.str();
    nonfinite.where = where_of(nonfinite.rows);
    nonfinite.where["valid_rows"] = nf_valid;
    nonfinite.where["pad_rows"] = nf_pad;
    nonfinite.where["pad_fill"] = std::string(sim::pad_fill_name(fill));
    add(std::move(nonfinite));
  }
}

}  // namespace cpgold::fx::diagnosis_detail
