#pragma once
// The candidates of a check: the tensors of an implementation under test, read from candidate files
// (fixtures/SCHEMA.md, "Candidate files") or handed over in memory (the Python extension), with the inputs their
// sources state and the shapes the golden fixture expects of them.
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "check/budget_rule.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/storage/hdf5_reader.hpp"

namespace cpgold::fx {

// One tensor of an implementation under test, in memory: float values (bf16/fp16 widened exactly), row-major.
struct CandidateTensor {
  std::string where;           // "file:/path", "array o@r1": named in errors and reports
  Values<float> values;
  std::vector<int64_t> dims;   // [t, h, d]; LSE [h, t], or [t, h] with lse_row_major
  bool lse_row_major = false;  // LSE given as [t, h] (or [t, h, 1], whose dims are then [t, h])
};

// The inputs a candidate source states it was computed from (root attribute inputs_sha256, SCHEMA.md).
struct InputsClaim {
  std::string source;     // the file (or "arrays")
  std::string sha256;     // its inputs_sha256
  std::string case_json;  // the case of those inputs when the source names it (attribute inputs_case_json), or ""
  bool matches = true;    // equal to the fixture's inputs digest (set by check)
};

// What a check reads: candidate tensors by (rank or -1, step or -1, pass 0 forward / 1 backward, quantity), the scope
// of the global ones, the inputs the sources state, and whether a source is itself a cpgold fixture.
struct CandidateSet {
  using Key = std::tuple<int, int, int, Quantity>;
  std::map<Key, CandidateTensor> tensors;
  CandidateScope global_scope = CandidateScope::global_only;
  std::vector<std::string> sources;  // files, or a description of in-memory arrays: the report's "candidate" lines
  std::vector<InputsClaim> inputs;
  std::string fixture_candidate;     // a candidate file that is a cpgold fixture (its /peer outputs were read), or ""
  std::vector<std::string> warnings;  // datasets named like outputs that were not read
  void add(const Key& key, CandidateTensor tensor);  // InputError if the same tensor comes twice
};

// The shape a candidate tensor must declare, and where that comes from ("golden.h5:/golden/o"); InputError where the
// tensor has no place in the golden at all. Asked before any value of the tensor is read.
using ExpectedShape =
    std::function<std::pair<std::vector<int64_t>, std::string>(const CandidateSet::Key&, const CandidateTensor&)>;

// Reads candidate files (fixtures/SCHEMA.md, "Candidate files"). A file that is itself a cpgold fixture gives its
// stored simulator outputs (/peer: the CP peer, gathered) as global CP outputs. InputError for unusable files. With
// `expected_shape`, every tensor's declared shape is compared with it before its values are read (a file declaring
// [4194304, 4, 64] over a few kB allocates nothing).
CandidateSet read_candidate_files(const std::vector<std::string>& files, const ExpectedShape& expected_shape = {});
// The shapes of the golden `fixture` (open in `golden`, both outliving the result) for its candidates: the rule
// `check` applies to candidate files, and the Python extension to arrays before it copies any of them.
ExpectedShape expected_shapes(const h5::Reader& golden, const FixtureFile& fixture);

}  // namespace cpgold::fx
