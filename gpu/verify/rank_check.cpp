// check_rank_outputs / combined_report: the check engine per rank, one table on rank 0.
#include "gpu/verify/rank_check.hpp"

#include <sstream>

#include "check/engine.hpp"
#include "fixtures/storage/hdf5_writer.hpp"
#include "gpu/verify/fixture_verify.hpp"

namespace cpgold::gpu {
namespace {

void write_rank_candidate(const std::string& path, int rank, const sim::RankOutputs<float>& out) {
  fx::h5::Writer writer(path);
  writer.attribute("/", "rank", static_cast<int64_t>(rank));
  writer.attribute("/", "producer", std::string("cpgold verify --backend nccl (one rank)"));
  write_candidate_outputs(writer, "", out.o, out.lse, out.dq, out.dk, out.dv);
  writer.close();
}

// The lines of `text` from the first line starting with `from` (excluded) to the first starting with `to`.
std::string lines_between(const std::string& text, const std::string& from, const std::string& to, bool include_from) {
  std::istringstream in(text);
  std::ostringstream out;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!inside && line.rfind(from, 0) == 0) {
      inside = true;
      if (include_from) out << line << "\n";
      continue;
    }
    if (inside && line.rfind(to, 0) == 0) break;
    if (inside) out << line << "\n";
  }
  return out.str();
}

}  // namespace

RankCheck check_rank_outputs(const std::string& fixture_path, int rank, const sim::RankOutputs<float>& outputs,
                             const std::string& candidate_path) {
  write_rank_candidate(candidate_path, rank, outputs);
  fx::CheckReport report = fx::check(fixture_path, {candidate_path});
  // The engine checks every rank once a candidate holds per-rank tensors; this rank answers for its own.
  std::vector<fx::TensorResult> mine;
  for (fx::TensorResult& r : report.results)
    if (r.rank == rank) mine.push_back(std::move(r));
  report.results = std::move(mine);
  const std::string text = fx::render_text(report);
  RankCheck check;
  check.rank = rank;
  // The engine fails a report that compared nothing; across ranks that rule belongs to the combined verdict.
  check.compared = report.compared();
  check.no_valid_element = report.no_valid_element();
  check.pass = report.every_result_ok();
  check.undecided = report.results_undecided();  // the compared-nothing rule is the combined verdict's
  check.rows = lines_between(text, "tensor ", "(max/lim", true);  // the table's header line, then the rows
  if (!check.pass) {
    // After the margins: the failing tensors' details, up to the reproduce line.
    const std::string tail = lines_between(text, "margin to the other budget", "reproduce:", false);
    check.details = tail;
  }
  return check;
}

std::string serialise(const RankCheck& check) {
  std::ostringstream out;
  out << check.rank << "\n" << (check.pass ? 1 : check.undecided ? 2 : 0) << "\n" << check.compared << "\n" << (check.no_valid_element ? 1 : 0)
      << "\n" << check.rows.size() << "\n"
      << check.rows << check.details;
  return out.str();
}

RankCheck deserialise_rank_check(const std::string& bytes) {
  std::istringstream in(bytes);
  RankCheck check;
  int pass = 0, empty = 0;
  size_t rows = 0;
  in >> check.rank >> pass >> check.compared >> empty >> rows;
  check.no_valid_element = empty != 0;
  in.get();
  check.pass = pass == 1;
  check.undecided = pass == 2;
  const std::string rest((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check.rows = rest.substr(0, rows);
  check.details = rows < rest.size() ? rest.substr(rows) : std::string();
  return check;
}

bool combined_pass(const std::vector<RankCheck>& ranks) {
  int64_t compared = 0;
  for (const RankCheck& r : ranks) {
    if (!r.pass) return false;
    compared += r.compared;
  }
  return !ranks.empty() && (compared > 0 || ranks.front().no_valid_element);
}

bool combined_undecided(const std::vector<RankCheck>& ranks) {
  bool any = false;
  for (const RankCheck& r : ranks) {
    if (!r.pass && !r.undecided) return false;
    any |= r.undecided;
  }
  return any;
}

std::string combined_report(const std::string& fixture_path, const std::vector<RankCheck>& ranks) {
  // Each rank's rows start with the engine's header line: printed once.
  auto split_header = [](const std::string& rows) {
    const size_t newline = rows.find('\n');
    return newline == std::string::npos ? std::make_pair(rows, std::string()) : std::make_pair(rows.substr(0, newline + 1), rows.substr(newline + 1));
  };
  std::ostringstream out;
  out << "golden     " << fixture_path << "\n";
  out << "candidates every rank's outputs, checked on that rank against /ranks/<r>\n\n";
  if (!ranks.empty()) out << split_header(ranks.front().rows).first;
  int64_t compared = 0;
  for (const RankCheck& r : ranks) {
    out << split_header(r.rows).second;
    compared += r.compared;
  }
  for (const RankCheck& r : ranks)
    if (!r.pass) out << "\nrank " << r.rank << ":" << (r.details.empty() ? std::string(" no results\n") : r.details);
  for (const RankCheck& r : ranks)
    if (r.pass && r.compared == 0)
      out << "\nrank " << r.rank << " holds only padding: nothing to compare under the budget rule, its pad rows are "
          << "exactly 0\n";
  if (!ranks.empty() && compared == 0 && ranks.front().no_valid_element)
    out << "\nno valid element: the fixture's batch holds no token; only the exact rules were checked\n";
  else if (!ranks.empty() && compared == 0)
    out << "\nno element was compared on any rank (every row is padding): a check that compares nothing fails\n";
  out << "\nverdict: " << (combined_pass(ranks) ? "PASS" : combined_undecided(ranks) ? "UNDECIDED (a fixture of another "
      "engine than the CPU reference: the CPU reference's fixture decides)" : "FAIL") << "\n";
  return out.str();
}

}  // namespace cpgold::gpu
