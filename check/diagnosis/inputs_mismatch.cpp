// inputs_mismatch: the inputs a candidate states against the fixture's digest (docs/diagnosis.md). Only a digest
// decides it: outputs alone cannot tell other inputs from a wrong implementation (an unreduced dK/dV sums to another
// dO just as other dO would).
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

}  // namespace cpgold::fx::diagnosis_detail
