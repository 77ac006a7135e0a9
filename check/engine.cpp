#include "check/engine.hpp"
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

#include "check/diagnosis/diagnose.hpp"

namespace cpgold::fx {

namespace {

// (rank, step, pass, quantity); rank -1 = global, step -1 = not a step partial, pass 0 forward / 1 backward.
using Key = CandidateSet::Key;
using Candidates = CandidateSet;

struct Context {
  const h5::Reader& golden;
  const FixtureFile& fixture;
  EmptyRowLse empty_row_lse = EmptyRowLse::neg_inf;
  PadRows pad_rows = PadRows::zero;
  // Gathered CP peer, global layout: the fixture's verified copy (FixtureFile::outputs), else read into `read_peer`.
  std::map<Quantity, const Values<float>*> peer;
  std::map<Quantity, Values<float>> read_peer;
  Values<float> oracle;  // the oracle of the result being checked when it is not the verified global copy
  std::string engine = "cpu";  // what computed the fixture's oracle and peers (/case attribute engine)
};

void locate_global(const Context& ctx, bool kv_side, int64_t global_row, ElementLocation& loc) {
  const PackedSequences& side = kv_side ? ctx.fixture.layout.kv : ctx.fixture.layout.q;
  loc.global_row = global_row;
  for (int b = 0; b < side.batch(); ++b) {
    if (global_row >= side.offset(b) && global_row < side.offset(b) + side.padded_length(b)) {
      loc.sequence = b;
      loc.row_in_sequence = global_row - side.offset(b);
      loc.sequence_length = side.length(b);
      loc.pad_row = loc.row_in_sequence >= side.length(b);
    }
  }
}

ElementLocation locate(const Context& ctx, const TensorResult& result, Quantity quantity, const ElementIndex& index,
                       double candidate, double oracle) {
  ElementLocation loc;
  loc.rank = result.rank;
  loc.step = result.step;
  loc.row = index.row;
  loc.head = index.head;
  loc.dim = index.dim;
  loc.candidate = candidate;
  loc.oracle = oracle;
  const bool kv_side = is_kv_side(quantity);
  int64_t global_row = -1;
  if (result.step >= 0) {
    const sim::PassPlan& pass = result.pass == "forward" ? ctx.fixture.plan.forward : ctx.fixture.plan.backward;
    const AttentionCall& call = pass.tile(result.rank, result.step).call;
    for (size_t b = 0; b < call.sequences.size(); ++b)
      for (const RowSegment& seg : kv_side ? call.sequences[b].kv : call.sequences[b].q)
        if (index.row >= seg.first_row && index.row < seg.first_row + seg.count) {
          loc.sequence = static_cast<int>(b);
          loc.row_in_sequence = seg.position + (index.row - seg.first_row);
        }
    return loc;
  }
  if (result.rank >= 0) {
    const sim::SidePartition& side = kv_side ? ctx.fixture.plan.partition.kv : ctx.fixture.plan.partition.q;
    global_row = side.global_row(result.rank, index.row);
  } else {
    global_row = index.row;
  }
  locate_global(ctx, kv_side, global_row, loc);
  const auto peer = ctx.peer.find(quantity);
  if (peer != ctx.peer.end()) {
    const std::vector<int64_t>& d = ctx.golden.info(golden_path(quantity)).dims;
    const size_t at = quantity == Quantity::lse ? static_cast<size_t>(index.head * d[1] + global_row)
                                                : static_cast<size_t>((global_row * d[1] + index.head) * d[2] + index.dim);
    if (at < peer->second->size()) loc.peer = (*peer->second)[at];
  }
  return loc;
}

std::optional<ExactRule> rule_at(const Evaluation& e, const ElementIndex& index) {
  for (const ExactViolation& v : e.exact_violations)
    if (v.index == index) return v.rule;
  return std::nullopt;
}

// The stored oracle (float32) a result is compared with: the global output as open_fixture verified and kept it, a
// rank's rows of it (gathered, or the shard itself where it is not bit for bit those rows), else read from the file
// (step partials; a fixture opened without keeping its outputs).
const Values<float>& oracle_of(Context& ctx, const std::string& golden_dataset, Quantity quantity, int rank, int step) {
  const VerifiedOutputs* kept = ctx.fixture.outputs.get();
  if (kept && step < 0) {
    const VerifiedOutputs::Output& global = kept->global.at(quantity);
    if (rank < 0) return global.oracle;
    const auto shard = kept->shards.find({rank, quantity});
    if (shard != kept->shards.end()) return shard->second;
    const sim::SidePartition& side = is_kv_side(quantity) ? ctx.fixture.plan.partition.kv : ctx.fixture.plan.partition.q;
    gather_stored_rows_into(global.oracle, global.dims, quantity, side.gather_indices(rank), ctx.oracle);
    return ctx.oracle;
  }
  ctx.golden.read_float_values(golden_dataset, ctx.oracle);
  return ctx.oracle;
}

TensorResult check_one(Context& ctx, const std::string& golden_dataset, Quantity quantity, int rank, int step,
                       int pass, CandidateScope scope, const CandidateTensor* candidate, std::vector<uint8_t> valid) {
  TensorResult result;
  result.tensor = std::string(quantity_name(quantity));
  result.rank = rank;
  result.step = step;
  if (step >= 0) result.pass = pass == 0 ? "forward" : "backward";
  result.scope = scope;
  if (!candidate) {
    result.missing = true;
    result.dataset = "(missing)";
    return result;
  }
  result.dataset = candidate->where;
  const std::vector<int64_t> dims = ctx.golden.info(golden_dataset).dims;  // [t, h, d], LSE [h, t]
  const Values<float>& oracle_values = oracle_of(ctx, golden_dataset, quantity, rank, step);
  const TensorView<float> oracle =
      quantity == Quantity::lse
          ? TensorView<float>{oracle_values.data(), dims[1], dims[0], 1, 1, dims[1]}
          : TensorView<float>{oracle_values.data(), dims[0], dims[1], dims[2], dims[1] * dims[2], dims[2]};
  const StoredBudgets golden = read_output_budgets(ctx.golden, golden_dataset);
  std::vector<int64_t> expected = dims;
  TensorView<float> view;
  if (quantity == Quantity::lse) {
    const int64_t h = dims[0], t = dims[1];
    if (candidate->lse_row_major) {
      expected = {t, h};
      view = view_lse_row_major(candidate->values.data(), t, h);
    } else {
      view = {candidate->values.data(), t, h, 1, 1, t};
    }
  } else {
    view = {candidate->values.data(), dims[0], dims[1], dims[2], dims[1] * dims[2], dims[2]};
  }
  if (candidate->dims != expected)
    fail_input(candidate->where, "expected shape ", h5::dims_text(expected), " (from ", ctx.fixture.path, ":",
               golden_dataset, "), found ", h5::dims_text(candidate->dims));
  result.has_other = golden.has_non_cp;
  const Limits limits = deciding_limits(golden.budgets, scope);
  const Limits other = other_limits(golden.budgets, scope);
  result.evaluation = evaluate(quantity, oracle, view, valid, limits, other, ctx.empty_row_lse, ctx.pad_rows);
  result.evaluation.engine_bound = engine_limit_bound(ctx.engine, check_precision(quantity, ctx.fixture.spec.dtype));
  const Evaluation& e = result.evaluation;
  if (e.worst) result.worst = locate(ctx, result, quantity, *e.worst, e.worst_candidate, e.worst_oracle);
  if (e.first_divergence) {
    result.first_divergence = locate(ctx, result, quantity, *e.first_divergence, e.first_candidate, e.first_oracle);
    if (!e.exact_ok()) result.first_divergence->rule = rule_at(e, *e.first_divergence);
  }
  for (const ExactViolation& v : e.exact_violations) {
    result.exact_violations.push_back(locate(ctx, result, quantity, v.index, v.candidate, v.oracle));
    result.exact_violations.back().rule = v.rule;
  }
  return result;
}

std::vector<Quantity> selected(const CheckOptions& options) {
  if (!options.tensors.empty()) return options.tensors;
  return {std::begin(kAllQuantities), std::end(kAllQuantities)};
}

// `golden` and `fixture`: the one open handle of the golden file and what it holds.
CheckReport run_checks(const h5::Reader& golden, const FixtureFile& fixture, const Candidates& cands,
                       const CheckOptions& options, std::vector<std::string> files) {
  for (int r : options.ranks)
    if (r < 0 || r >= fixture.plan.cp_size)
      fail_input("ranks", "rank ", r, " does not exist: the fixture has cp_size ", fixture.plan.cp_size, " (ranks 0..",
                 fixture.plan.cp_size - 1, ")");
  auto rank_selected = [&](int r) {
    return options.ranks.empty() || std::find(options.ranks.begin(), options.ranks.end(), r) != options.ranks.end();
  };
  const std::string& golden_path_text = golden.path();
  Context ctx{golden, fixture, options.empty_row_lse, options.pad_rows, {}, {}, {}};
  if (golden.has_attribute("/case", "engine")) ctx.engine = golden.attr_string("/case", "engine");
  for (Quantity q : kAllQuantities) {
    if (fixture.outputs) ctx.peer[q] = &fixture.outputs->global.at(q).peer;  // verified when the fixture was opened
    else if (golden.exists(peer_path(q))) ctx.peer[q] = &(ctx.read_peer[q] = golden.read_float_values(peer_path(q)));
  }
  CheckReport report;
  report.engine = ctx.engine;
  report.golden = golden_path_text;
  report.case_json = fixture.case_json;
  report.candidates = std::move(files);
  report.empty_row_lse = options.empty_row_lse;
  report.pad_rows = options.pad_rows;
  report.fixture_candidate = cands.fixture_candidate;
  report.warnings = cands.warnings;
  report.inputs = cands.inputs;
  report.inputs_sha256 = fixture.inputs_sha256;
  report.inputs_source = fixture.inputs_source;
  report.inputs_nonfinite_valid = fixture.inputs_nonfinite_valid;
  if (!report.inputs.empty() && report.inputs_sha256.empty()) report.inputs_sha256 = inputs_sha256(golden);
  for (InputsClaim& claim : report.inputs) claim.matches = claim.sha256 == report.inputs_sha256;
  if (cands.tensors.empty())
    fail_input(report.candidates.empty() ? "candidate" : report.candidates.front(),
               "no output datasets found: expected /o, /lse, /dq, /dk, /dv at the root or under /ranks/<r>/");
  const std::vector<uint8_t> valid_q = valid_rows(fixture.layout.q), valid_kv = valid_rows(fixture.layout.kv);
  const std::vector<Quantity> wanted = selected(options);
  bool any_rank = false;
  for (const auto& [key, tensor] : cands.tensors) any_rank |= std::get<0>(key) >= 0 && std::get<1>(key) < 0;
  for (const auto& [key, tensor] : cands.tensors) {
    const auto [rank, step, pass, q] = key;
    if (rank >= fixture.plan.cp_size) fail_input(tensor.where, "rank ", rank, " does not exist: the fixture has cp_size ", fixture.plan.cp_size);
  }
  for (int r = 0; r < fixture.plan.cp_size; ++r)
    if (any_rank && rank_selected(r)) report.ranks.push_back(r);
  std::vector<int> unselected;
  for (const auto& [key, tensor] : cands.tensors) {
    const int rank = std::get<0>(key);
    if (rank >= 0 && !rank_selected(rank) && std::find(unselected.begin(), unselected.end(), rank) == unselected.end()) {
      unselected.push_back(rank);
      report.warnings.push_back("the candidates hold outputs of rank " + std::to_string(rank) +
                                ", which was not selected (ranks): not checked");
    }
  }
  for (Quantity q : wanted) {
    const auto global = cands.tensors.find({-1, -1, 0, q});
    const bool kv = is_kv_side(q);
    if (global != cands.tensors.end() || !any_rank)
      report.results.push_back(check_one(ctx, golden_path(q), q, -1, -1, 0, cands.global_scope,
                                         global == cands.tensors.end() ? nullptr : &global->second, kv ? valid_kv : valid_q));
    if (!any_rank) continue;
    for (int r = 0; r < fixture.plan.cp_size; ++r) {
      if (!rank_selected(r)) continue;
      const auto found = cands.tensors.find({r, -1, 0, q});
      const sim::SidePartition& side = kv ? fixture.plan.partition.kv : fixture.plan.partition.q;
      report.results.push_back(check_one(ctx, rank_output_path(r, q), q, r, -1, 0, CandidateScope::cp_output,
                                         found == cands.tensors.end() ? nullptr : &found->second,
                                         shard_row_flags(side, r, kv ? valid_kv : valid_q)));
    }
  }
  // What the fixture itself holds to compare in the selected tensors: an empty batch passes on its exact rules, a
  // selection of ranks holding only padding does not (check_one counts what was compared).
  for (Quantity q : wanted) {
    const std::vector<uint8_t>& valid = is_kv_side(q) ? valid_kv : valid_q;
    report.fixture_valid_rows += std::count(valid.begin(), valid.end(), uint8_t{1});
  }
  for (int r = 0; r < fixture.plan.cp_size; ++r) {
    bool holds = false;
    for (Quantity q : wanted) {
      const bool kv = is_kv_side(q);
      const std::vector<uint8_t> mine =
          shard_row_flags(kv ? fixture.plan.partition.kv : fixture.plan.partition.q, r, kv ? valid_kv : valid_q);
      holds |= std::find(mine.begin(), mine.end(), uint8_t{1}) != mine.end();
    }
    if (holds) report.ranks_with_tokens.push_back(r);
  }
  // Step partials: checked where both the fixture and the candidate carry them.
  for (const auto& [key, tensor] : cands.tensors) {
    const auto [rank, step, pass, q] = key;
    if (step < 0 || !rank_selected(rank) || std::find(wanted.begin(), wanted.end(), q) == wanted.end()) continue;
    const std::string dataset = step_group(rank, step, pass == 0 ? sim::PassKind::forward : sim::PassKind::backward) +
                                "/" + std::string(quantity_name(q));
    if (!fixture.traced || !golden.exists(dataset))
      fail_input(tensor.where, "the golden fixture has no ", dataset, " (generate it with gen --trace)");
    const sim::PassPlan& plan_pass = pass == 0 ? fixture.plan.forward : fixture.plan.backward;
    report.results.push_back(check_one(ctx, dataset, q, rank, step, pass, CandidateScope::cp_output, &tensor,
                                       rows_read(plan_pass.tile(rank, step).call, is_kv_side(q))));
  }
  if (options.diagnose && !report.pass() && !report.undecided()) {
    DiagnosisInput input;
    input.golden = &golden;
    input.fixture = &fixture;
    input.empty_row_lse = options.empty_row_lse;
    input.pad_rows = options.pad_rows;
    input.replay_budget_seconds = options.diagnosis_budget_seconds;
    for (const auto& [key, tensor] : cands.tensors)
      input.candidates.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key), &tensor.values,
                                  tensor.dims, tensor.lse_row_major});
    report.diagnosis = diagnose(input, report);
  }
  return report;
}

}  // namespace

void set_conventions(CheckOptions& options, const std::string& empty_row_lse, const std::string& empty_row_field,
                     const std::string& pad_rows, const std::string& pad_rows_field) {
  const auto lse = parse_empty_row_lse(empty_row_lse);
  if (!lse) fail_input(empty_row_field, "expected neg-inf or pos-inf, got \"", empty_row_lse, "\"");
  const auto pads = parse_pad_rows(pad_rows);
  if (!pads) fail_input(pad_rows_field, "expected zero or unwritten, got \"", pad_rows, "\"");
  options.empty_row_lse = *lse;
  options.pad_rows = *pads;
}

std::vector<Quantity> parse_tensor_list(const std::string& text, const std::string& field) {
  std::vector<Quantity> out;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t end = text.find(',', begin);
    const std::string name = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const auto quantity = parse_quantity(name);
    if (name.empty()) fail_input(field, "empty item ", i, " in \"", text, "\" (expected o, lse, dq, dk, dv)");
    if (!quantity) fail_input(field, "unknown tensor \"", name, "\" (expected o, lse, dq, dk, dv)");
    if (std::find(out.begin(), out.end(), *quantity) != out.end())
      fail_input(field, "tensor \"", name, "\" is given twice in \"", text, "\"");
    out.push_back(*quantity);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

std::vector<int> parse_rank_list(const std::string& text, const std::string& field) {
  std::vector<int> out;
  size_t begin = 0;
  for (;;) {
    const size_t end = text.find(',', begin);
    const std::string item = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    size_t used = 0;
    int rank = -1;
    try {
      rank = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || rank < 0 || item[0] == '+' || item[0] == ' ')
      fail_input(field, "expected ranks as non-negative integers separated by commas (e.g. 0,2), got \"", text, "\"");
    if (std::find(out.begin(), out.end(), rank) != out.end())
      fail_input(field, "rank ", rank, " is given twice in \"", text, "\"");
    out.push_back(rank);
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}
namespace {
// The golden given again as a candidate: almost always swapped or repeated arguments.
void refuse_same_file(const std::string& golden, const std::vector<std::string>& candidates, const CheckOptions& options) {
  if (options.allow_same_file) return;
  for (const std::string& file : candidates) {
    std::error_code ec;
    if (file == golden || std::filesystem::equivalent(golden, file, ec))
      fail_input(file, "is the golden fixture itself: a fixture checked against itself reads its own stored simulator "
                 "outputs (/peer) as the candidate and says nothing about an implementation. The order is GOLDEN "
                 "CANDIDATE... (were the arguments swapped?); to check the stored simulator outputs on purpose, pass "
                 "--allow-same-file (Python: allow_same_file=True)");
  }
}
}  // namespace

CheckReport check(const std::string& golden, const std::vector<std::string>& candidates, const CheckOptions& options) {
  if (candidates.empty()) fail_input("candidate", "give at least one candidate file");
  refuse_same_file(golden, candidates, options);
  const h5::Reader reader(golden);
  // The outputs whose budgets open_fixture verifies are kept for the comparison: each is read and decoded once.
  return check(reader, open_fixture(reader, OpenOptions{false, true}), candidates, options);
}
CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const std::vector<std::string>& candidates,
                  const CheckOptions& options) {
  if (candidates.empty()) fail_input("candidate", "give at least one candidate file");
  refuse_same_file(golden.path(), candidates, options);
  const ExpectedShape expected_shape = expected_shapes(golden, fixture);
  return check(golden, fixture, read_candidate_files(candidates, expected_shape), options);
}

CheckReport check(const h5::Reader& golden, const FixtureFile& fixture, const CandidateSet& candidates,
                  const CheckOptions& options) {
  return run_checks(golden, fixture, candidates, options, candidates.sources);
}

CheckReport self_check(const std::string& golden, const CheckOptions& options) {
  const h5::Reader reader(golden);
  const FixtureFile fixture = open_fixture(reader, OpenOptions{false});
  auto input = [&](const char* name) {
    const h5::DatasetInfo info = reader.info(std::string("/inputs/") + name);
    Tensor3<float> t(info.dims[0], info.dims[1], info.dims[2]);
    t.values = reader.read_float(std::string("/inputs/") + name);
    return t;
  };
  const sim::CaseInputs inputs{input("q"), input("k"), input("v"), input("dout")};
  sim::ExecutorOptions executor;
  executor.record_trace = fixture.traced;
  executor.kernel.row_block = 48;     // another tile size than the reference's 64
  executor.kernel.scale_on_k = true;  // the scale applied to K (in float32) instead of the scores
  const sim::CpRun<float> cp = sim::run_cp_peer(fixture.plan, inputs, fixture.spec.dtype, executor);
  const sim::GlobalOutputs<float> gathered = sim::gather_outputs(fixture.plan, cp.ranks);

  Candidates cands;
  cands.global_scope = CandidateScope::cp_output;  // gathered CP outputs: the CP budget decides
  auto put = [&](Key key, const std::string& path, const std::vector<float>& values, std::vector<int64_t> dims) {
    cands.tensors[key] = CandidateTensor{"self-check:" + path, Values<float>(values.begin(), values.end()),
                                         std::move(dims), false};
  };
  auto put_outputs = [&](int rank, const std::string& prefix, const Tensor3<float>& o, const LseTensor<float>& lse,
                         const Tensor3<float>& dq, const Tensor3<float>& dk, const Tensor3<float>& dv) {
    put({rank, -1, 0, Quantity::o}, prefix + "/o", o.values, {o.rows, o.heads, o.dim});
    put({rank, -1, 0, Quantity::lse}, prefix + "/lse", lse.values, {lse.heads, lse.rows});
    put({rank, -1, 0, Quantity::dq}, prefix + "/dq", dq.values, {dq.rows, dq.heads, dq.dim});
    put({rank, -1, 0, Quantity::dk}, prefix + "/dk", dk.values, {dk.rows, dk.heads, dk.dim});
    put({rank, -1, 0, Quantity::dv}, prefix + "/dv", dv.values, {dv.rows, dv.heads, dv.dim});
  };
  put_outputs(-1, "", gathered.o, gathered.lse, gathered.dq, gathered.dk, gathered.dv);
  for (int r = 0; r < fixture.plan.cp_size; ++r) {
    const sim::RankOutputs<float>& mine = cp.ranks[static_cast<size_t>(r)];
    put_outputs(r, rank_group(r), mine.o, mine.lse, mine.dq, mine.dk, mine.dv);
  }
  for (const sim::ForwardStepTrace<float>& t : cp.trace.forward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::forward);
    put({t.rank, t.step, 0, Quantity::o}, g + "/o", t.o.values, {t.o.rows, t.o.heads, t.o.dim});
    put({t.rank, t.step, 0, Quantity::lse}, g + "/lse", t.lse.values, {t.lse.heads, t.lse.rows});
  }
  for (const sim::BackwardStepTrace<float>& t : cp.trace.backward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::backward);
    put({t.rank, t.step, 1, Quantity::dq}, g + "/dq", t.dq.values, {t.dq.rows, t.dq.heads, t.dq.dim});
    put({t.rank, t.step, 1, Quantity::dk}, g + "/dk", t.dk.values, {t.dk.rows, t.dk.heads, t.dk.dim});
    put({t.rank, t.step, 1, Quantity::dv}, g + "/dv", t.dv.values, {t.dv.rows, t.dv.heads, t.dv.dim});
  }
  return run_checks(reader, fixture, cands, options,
                    {"self-check: CP simulator in " + std::string(dtype_name(fixture.spec.dtype)) +
                     ", scale on K, row block 48 (" + std::string(sim::comm_name(fixture.plan.comm)) + ", W=" +
                     std::to_string(fixture.plan.cp_size) + ")"});
}
}  // namespace cpgold::fx
