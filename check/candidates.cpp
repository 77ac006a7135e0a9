#include "check/candidates.hpp"
#include "fixtures/golden/golden_run.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "fixtures/schema/inputs_digest.hpp"
#include "reference/sha256.hpp"
#include "reference/attention.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/program/executor.hpp"

namespace cpgold::fx {

namespace {


// (rank, step, pass, quantity); rank -1 = global, step -1 = not a step partial, pass 0 forward / 1 backward.
using Key = CandidateSet::Key;
using Candidates = CandidateSet;

// Candidate element types (fixtures/SCHEMA.md): what kernels produce. float64 is refused rather than silently
// rounded to float32 on read.
bool is_candidate_float(h5::Element e) {
  return e == h5::Element::bf16 || e == h5::Element::fp16 || e == h5::Element::fp32;
}

// A group named by an index ("/ranks/<r>", ".../steps/<s>"): canonical decimal, no sign, no leading zero.
int index_of_group(const h5::Reader& reader, const std::string& group, const std::string& name, const char* what) {
  const bool digits = !name.empty() && name.size() <= 9 && name.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || (name.size() > 1 && name[0] == '0'))
    fail_input(reader.where(group), "a ", what, " group's name must be the ", what, " in decimal (0, 1, 2, ...), found \"",
               name, "\"");
  return std::stoi(name);
}

// "/ranks/<r>"; the `rank` attribute, when present, must agree with the name.
int rank_of_group(const h5::Reader& reader, const std::string& name) {
  const std::string group = "/ranks/" + name;
  const int rank = index_of_group(reader, group, name, "rank");
  if (reader.has_attribute(group, "rank")) {
    const int64_t attribute = reader.attr_int64(group, "rank");
    if (attribute != rank)
      fail_input(reader.where(group), "attribute rank = ", attribute, " disagrees with the group name ", name);
  }
  return rank;
}

CandidateTensor load_tensor(const h5::Reader& reader, const std::string& path, Quantity quantity) {
  CandidateTensor t;
  t.where = reader.where(path);
  const h5::DatasetInfo info = reader.info(path);
  if (!is_candidate_float(info.element))
    fail_input(t.where, "expected float32, bf16 or fp16 values, found ", info.type_text, " ", h5::dims_text(info.dims));
  t.dims = info.dims;
  if (quantity == Quantity::lse) {
    std::string layout = "ht";
    if (reader.has_attribute(path, "lse_layout")) layout = reader.attr_string(path, "lse_layout");
    if (layout != "ht" && layout != "th")
      fail_input(t.where, "attribute lse_layout: expected \"ht\" ([h, t]) or \"th\" ([t, h] or [t, h, 1]), found \"",
                 layout, "\"");
    if (info.dims.size() == 3 && info.dims[2] == 1) layout = "th", t.dims.pop_back();
    t.lse_row_major = layout == "th";
  }
  // The values are read by read_candidate_files once the declared shape passed its gate (none read here).
  return t;
}

void add(Candidates& out, Key key, CandidateTensor tensor) { out.add(key, std::move(tensor)); }

void scan_outputs(const h5::Reader& reader, const std::string& group, int rank, Candidates& out) {
  for (Quantity q : kAllQuantities) {
    const std::string path = (group == "/" ? "" : group) + "/" + std::string(quantity_name(q));
    if (reader.exists(path) && !reader.is_group(path)) add(out, {rank, -1, 0, q}, load_tensor(reader, path, q));
  }
}

// The inputs a candidate file states (root attribute inputs_sha256, optionally inputs_case_json).
void scan_inputs_claim(const h5::Reader& reader, Candidates& out) {
  if (!reader.has_attribute("/", kInputsDigestAttribute)) return;
  InputsClaim claim;
  claim.source = reader.path();
  claim.sha256 = reader.attr_string("/", kInputsDigestAttribute);
  if (!is_sha256_hex(claim.sha256))
    fail_input(reader.where("/"), "attribute ", kInputsDigestAttribute, ": expected 64 lowercase hex digits, found \"",
               claim.sha256, "\"");
  if (reader.has_attribute("/", "inputs_case_json")) claim.case_json = reader.attr_string("/", "inputs_case_json");
  out.inputs.push_back(std::move(claim));
}

// A cpgold fixture given as a candidate: what it holds of an implementation's kind is its simulator's outputs (the CP
// peer in the case dtype, gathered to the global layout), so those are the candidate; its /ranks/<r>/o ... are oracle
// shards, which would pass whatever they were checked against.
bool scan_fixture_candidate(const h5::Reader& reader, Candidates& out) {
  if (!reader.is_group("/case") || !reader.has_attribute("/case", "schema_version")) return false;
  out.fixture_candidate = reader.path();
  out.global_scope = CandidateScope::cp_output;
  for (Quantity q : kAllQuantities)
    if (reader.exists(peer_path(q)) && !reader.is_group(peer_path(q))) add(out, {-1, -1, 0, q}, load_tensor(reader, peer_path(q), q));
  InputsClaim claim;
  claim.source = reader.path();
  claim.sha256 = reader.has_attribute("/case", kInputsDigestAttribute)
                     ? reader.attr_string("/case", kInputsDigestAttribute)
                     : inputs_sha256(reader);
  if (reader.has_attribute("/case", "case_json")) claim.case_json = reader.attr_string("/case", "case_json");
  out.inputs.push_back(std::move(claim));
  return true;
}

void scan_file(const h5::Reader& reader, Candidates& out) {
  if (scan_fixture_candidate(reader, out)) return;
  scan_inputs_claim(reader, out);
  int root_rank = -1;
  if (reader.has_attribute("/", "rank")) {
    const int64_t rank = reader.attr_int64("/", "rank");
    if (rank < 0 || rank > INT32_MAX)
      fail_input(reader.where("/"), "attribute rank: expected a rank >= 0, found ", rank);
    root_rank = static_cast<int>(rank);
  }
  if (reader.has_attribute("/", "scope")) {
    const std::string scope = reader.attr_string("/", "scope");
    if (scope == "cp_gathered") out.global_scope = CandidateScope::cp_output;
    else if (scope != "global") fail_input(reader.where("/"), "attribute scope: expected \"global\" or \"cp_gathered\", found \"", scope, "\"");
  }
  scan_outputs(reader, "/", root_rank, out);
  for (const std::string& name : reader.children("/ranks")) {
    const int rank = rank_of_group(reader, name);
    const std::string group = "/ranks/" + name;
    scan_outputs(reader, group, rank, out);
    for (const std::string& step : reader.children(group + "/steps")) {
      for (int pass = 0; pass < 2; ++pass) {
        const std::string sg = group + "/steps/" + step + (pass == 0 ? "/forward" : "/backward");
        for (Quantity q : kAllQuantities) {
          const std::string path = sg + "/" + std::string(quantity_name(q));
          if (reader.exists(path) && !reader.is_group(path))
            add(out, {rank, index_of_group(reader, group + "/steps/" + step, step, "step"), pass, q},
                load_tensor(reader, path, q));
        }
      }
    }
  }
}

// Datasets named like an output (o, lse, dq, dk, dv) anywhere in a candidate file that the scan did not read: a
// tensor written to the wrong path (/outputs/o, /golden/o) must not look checked.
void note_unread(const h5::Reader& reader, const Candidates& cands, const std::string& group,
                 std::vector<std::string>& warnings) {
  for (const std::string& name : reader.children(group)) {
    const std::string path = (group == "/" ? "" : group) + "/" + name;
    if (reader.is_group(path)) {
      note_unread(reader, cands, path, warnings);
      continue;
    }
    if (!parse_quantity(name)) continue;
    const std::string where = reader.where(path);
    bool read = false;
    for (const auto& [key, tensor] : cands.tensors) read |= tensor.where == where;
    if (!read)
      warnings.push_back(where + " is not read by check (outputs are read at the root, /o ..., and under "
                                 "/ranks/<r>/ and /ranks/<r>/steps/<s>/forward|backward/): it was not checked");
  }
}

}  // namespace

void CandidateSet::add(const Key& key, CandidateTensor tensor) {
  auto [it, inserted] = tensors.emplace(key, std::move(tensor));
  if (!inserted) fail_input(it->second.where, "the same tensor is given twice (also ", tensor.where, ")");
}

CandidateSet read_candidate_files(const std::vector<std::string>& files, const ExpectedShape& expected_shape) {
  if (files.empty()) fail_input("candidate", "give at least one candidate file");
  Candidates cands;
  cands.sources = files;
  for (const std::string& file : files) {  // one open per file: the scan, the unread-dataset warnings, the reads
    const h5::Reader reader(file);
    std::set<Key> before;
    for (const auto& [key, tensor] : cands.tensors) before.insert(key);
    scan_file(reader, cands);
    if (cands.fixture_candidate != file) note_unread(reader, cands, "/", cands.warnings);
    // The tensors of this file, described by the scan: each declared shape against the golden's first, then the
    // values (a file may declare any shape; nothing is allocated for one that does not fit).
    for (auto& [key, tensor] : cands.tensors) {
      if (before.count(key)) continue;
      if (expected_shape) {
        const auto [expected, from] = expected_shape(key, tensor);
        if (tensor.dims != expected)
          fail_input(tensor.where, "expected shape ", h5::dims_text(expected), " (from ", from, "), found ",
                     h5::dims_text(tensor.dims));
      }
      tensor.values = reader.read_float_values(tensor.where.substr(reader.path().size() + 1));
    }
  }
  return cands;
}
ExpectedShape expected_shapes(const h5::Reader& golden, const FixtureFile& fixture) {
  // Each candidate tensor's shape is the golden dataset's it is checked against: rank and step groups the fixture
  // lacks are refused here as run_checks would, before anything is read.
  return [&golden, &fixture](const CandidateSet::Key& key, const CandidateTensor& tensor) {
    const auto [rank, step, pass, q] = key;
    if (rank >= fixture.plan.cp_size)
      fail_input(tensor.where, "rank ", rank, " does not exist: the fixture has cp_size ", fixture.plan.cp_size);
    std::string dataset = rank < 0 ? golden_path(q) : rank_output_path(rank, q);
    if (step >= 0) {
      dataset = step_group(rank, step, pass == 0 ? sim::PassKind::forward : sim::PassKind::backward) + "/" +
                std::string(quantity_name(q));
      if (!fixture.traced || !golden.is_dataset(dataset))
        fail_input(tensor.where, "the golden fixture has no ", dataset, " (generate it with gen --trace)");
    }
    std::vector<int64_t> dims = golden.info(dataset).dims;
    if (q == Quantity::lse && tensor.lse_row_major && dims.size() == 2) std::swap(dims[0], dims[1]);
    return std::pair{dims, fixture.path + ":" + dataset};
  };
}
}  // namespace cpgold::fx
