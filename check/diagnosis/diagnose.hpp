#pragma once
// The diagnosis of a failed check: what it reads (the candidates as the check read them, the golden, the fixture's
// inputs) and its entry point. The kinds and the findings are check/finding.hpp.
#include <cstdint>
#include <vector>

#include "check/report.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/storage/hdf5_reader.hpp"

namespace cpgold::fx {

// One candidate tensor as the check read it (values stay owned by the caller).
struct DiagnosisCandidate {
  int rank = -1;  // -1: global
  int step = -1;  // -1: not a step partial
  int pass = 0;   // step partials: 0 forward, 1 backward
  Quantity quantity = Quantity::o;
  const Values<float>* values = nullptr;
  std::vector<int64_t> dims;   // as stored; LSE [h, t] or [t, h]
  bool lse_row_major = false;  // LSE given as [t, h]
};

struct DiagnosisInput {
  const h5::Reader* golden = nullptr;   // the golden file, open
  const FixtureFile* fixture = nullptr;
  std::vector<DiagnosisCandidate> candidates;
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;
  PadRows pad_rows = PadRows::zero;  // unwritten: pad and tail rows of O/dQ/dK/dV are not evidence
  double replay_budget_seconds = 30;  // replay of modelled mistakes: no new mistake past this; 0: no replay
};

// The findings on a failed report, most specific first; empty for a report that passes or that failed only because
// it compared nothing. The inputs the candidates state (report.inputs, against report.inputs_sha256) decide
// inputs_mismatch by digest; a check whose results all pass but whose candidate states other inputs is diagnosed so. The recomputations read the fixture's inputs; when one cannot be read they are skipped and the
// report says so (where["not_tested"]), the check's verdict and exit code stay those of the comparison.
std::vector<Diagnosis> diagnose(const DiagnosisInput& input, const CheckReport& report);

}  // namespace cpgold::fx
