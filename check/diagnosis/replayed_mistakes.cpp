// per_rank_counts, merge and the other modelled CP mistakes: the case replayed under each (replay.hpp), kept where
// the candidate matches the simulation (docs/diagnosis.md, "Replay").
#include "check/diagnosis/diagnoser.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

#include "fixtures/schema/fixture_schema.hpp"
#include "reference/input_error.hpp"
#include "check/diagnosis/replay.hpp"
#include "reference/mask.hpp"

namespace cpgold::fx::diagnosis_detail {

// Replays the case under every modelled mistake (check/diagnosis/replay.hpp) and keeps those whose simulation every compared
// result matches: the results the check failed and those it passed, as the candidate holds them.
void Diagnoser::test_replay() {
  load_inputs();
  std::vector<ReplaySubject> subjects;
  std::vector<size_t> subject_of;  // replay subject -> index in subjects_ (subjects_.size(): a passing result)
  int q_head = -1;
  for (const HeldResult& held : held_results()) {
    const TensorResult& r = *held.result;
    const Quantity q = held.quantity;
    ReplaySubject rs;
    rs.name = result_name(r);
    rs.quantity = q;
    rs.rank = r.rank;
    rs.cand = held.view;
    rs.golden = golden(q).view;
    rs.limit = r.evaluation.limits.max;
    rs.precision = check_precision(q, fx().spec.dtype);
    size_t index = subjects_.size();
    for (size_t i = 0; i < subjects_.size(); ++i)
      if (subjects_[i].result == &r) index = i;
    if (index < subjects_.size()) {
      const Subject& s = subjects_[index];
      rs.failing = s.failing;
      rs.explain_limit = s.mean_only ? s.mean_limit : s.limit;
      for (size_t item = 0; item < s.item_bad.size() && q_head < 0; ++item)
        if (s.item_bad[item]) {
          const int head = static_cast<int>(static_cast<int64_t>(item) % s.cand.heads);
          q_head = s.kv ? head * group_ : head;
        }
    }
    subject_of.push_back(index);
    subjects.push_back(std::move(rs));
  }
  if (subjects.empty()) return;
  sim::CaseInputs inputs;
  inputs.q = iq_, inputs.k = ik_, inputs.v = iv_, inputs.dout = idout_;
  ReplayOptions options;
  options.budget_seconds = in_.replay_budget_seconds;
  options.pad_rows = in_.pad_rows;
  options.empty_row_lse = in_.empty_row_lse;
  options.q_head = std::max(0, q_head);
  ReplayOutcome outcome;
  try {
    outcome = replay_mistakes(fx(), inputs, subjects, options);
  } catch (const std::exception& e) {  // the replay must never turn a verdict into an error: said, not thrown
    not_tested_.push_back(std::string("replay of modelled mistakes (") + e.what() + ")");
    return;
  }
  auto kind_of = [](sim::MistakeFamily family) {
    switch (family) {
      case sim::MistakeFamily::layout: return DiagnosisKind::chunk_order;
      case sim::MistakeFamily::counts: return DiagnosisKind::per_rank_counts;
      case sim::MistakeFamily::mask: return DiagnosisKind::mask_edge;
      case sim::MistakeFamily::merge: return DiagnosisKind::merge;
      case sim::MistakeFamily::rows: return DiagnosisKind::tail_rows_missing;
      case sim::MistakeFamily::offsets: return DiagnosisKind::per_rank_counts;
      case sim::MistakeFamily::reduction: return DiagnosisKind::merge;
    }
    return DiagnosisKind::unexplained;
  };
  // One finding per kind: of the mistakes of a kind that match (several can give the same outputs here, e.g. an
  // edge moved in every tile and in the diagonal tiles only, where only those see it), the one that changes the
  // fewest tiles is named and the others are listed beside it.
  std::map<DiagnosisKind, std::vector<const ReplayResult*>> by_kind;
  for (const ReplayResult& r : outcome.results)
    if (r.matches) by_kind[kind_of(r.family)].push_back(&r);
  for (auto& [kind, list] : by_kind)
    std::stable_sort(list.begin(), list.end(), [](const ReplayResult* a, const ReplayResult* b) {
      const size_t ta = a->tiles.empty() ? SIZE_MAX : a->tiles.size(), tb = b->tiles.empty() ? SIZE_MAX : b->tiles.size();
      return ta != tb ? ta < tb : a->worst_ratio < b->worst_ratio;
    });
  for (const auto& [kind, list] : by_kind) {
    const ReplayResult& r = *list.front();
    std::vector<std::string> also;
    for (size_t i = 1; i < list.size(); ++i) also.push_back(list[i]->mistake);
    Finding f;
    f.kind = kind;
    f.replayed = true;
    for (const auto& [replay_index, rows] : r.rows)
      if (subject_of[replay_index] < subjects_.size()) f.rows[subject_of[replay_index]] = rows;
    // Failing rows of sequences the replay left out (past its size cap): the mistake acts on every sequence alike, so
    // they count as its rows; the evidence names them.
    // So do failing rows whose failing elements all lie in heads the replay left out (p2p and all_gather replay one
    // KV head and its query heads; every head is treated alike there).
    const std::set<int> replayed(outcome.sequences.begin(), outcome.sequences.end());
    std::set<int> q_heads(outcome.heads.begin(), outcome.heads.end()), kv_heads;
    for (int h : outcome.heads) kv_heads.insert(h / group_);
    std::set<int> not_replayed;
    bool other_heads = false;
    for (size_t index = 0; index < subjects_.size(); ++index) {
      const Subject& s = subjects_[index];
      const Side& sd = side(s.kv);
      const std::set<int>& heads = s.kv ? kv_heads : q_heads;
      for (size_t row = 0; row < s.failing.size(); ++row) {
        if (!s.failing[row]) continue;
        const int64_t g = s.global[row];
        const int b = g >= 0 && g < static_cast<int64_t>(sd.sequence.size()) ? sd.sequence[static_cast<size_t>(g)] : -1;
        if (b >= 0 && replayed.count(b)) {
          // A row the check failed on heads outside the replay only.
          bool in_heads = !s.row_bad[row];  // pad or non-finite rows: judged by the replay as they are
          for (int64_t h = 0; h < s.cand.heads && !in_heads; ++h)
            in_heads = s.item_bad[row * static_cast<size_t>(s.cand.heads) + static_cast<size_t>(h)] && heads.count(static_cast<int>(h));
          if (in_heads || heads.size() == static_cast<size_t>(s.cand.heads)) continue;
          std::vector<uint8_t>& mine = f.rows[index];
          if (mine.empty()) mine = flags(s.failing.size());
          if (!mine[row]) other_heads = true;
          mine[row] = 1;
          continue;
        }
        if (b < 0) continue;
        std::vector<uint8_t>& mine = f.rows[index];
        if (mine.empty()) mine = flags(s.failing.size());
        mine[row] = 1;
        not_replayed.insert(b);
      }
    }
    f.where = where_of(f.rows);
    nlohmann::ordered_json replay;
    replay["mistake"] = r.mistake;
    replay["family"] = std::string(sim::mistake_family_name(r.family));
    replay["worst_ratio"] = r.worst_ratio;
    replay["elements"] = r.elements;
    replay["ranks"] = r.ranks;
    nlohmann::ordered_json tiles = nlohmann::ordered_json::array();
    std::vector<std::string> tile_names;
    for (const sim::TileRef& t : r.tiles) {
      tiles.push_back({{"rank", t.rank}, {"step", t.step}});
      tile_names.push_back("rank " + std::to_string(t.rank) + " step " + std::to_string(t.step));
    }
    replay["forward_tiles"] = tiles;
    replay["heads"] = outcome.heads;
    replay["sequences_replayed"] = outcome.sequences;
    if (!also.empty()) replay["also_matching"] = also;
    f.where["replay"] = replay;
    std::vector<std::string> results;
    for (const auto& [index, rows] : f.rows)
      if (std::find(rows.begin(), rows.end(), 1) != rows.end()) results.push_back(subjects_[index].name);
    f.evidence = "matches the simulation of " + r.mistake + " (" + r.description + "): worst ratio " +
                 num(r.worst_ratio) + " over " + std::to_string(r.elements) + " elements";
    if (!r.ranks.empty()) f.evidence += "; ranks " + list_text(r.ranks);
    if (f.where.contains("sequences") && !f.where["sequences"].empty())
      f.evidence += "; sequences " + list_text(f.where["sequences"].get<std::vector<int>>());
    if (!tile_names.empty())
      f.evidence += std::string(r.family == sim::MistakeFamily::merge ? "; the forward partials it merges otherwise: "
                                                                      : "; the forward tiles it changes: ") +
                    list_text(tile_names, 6);
    if (!results.empty()) f.evidence += "; failing rows of " + names_text(results);
    if (!also.empty()) f.evidence += "; the simulation of " + list_text(also, 4) + " matches as well";
    if (!not_replayed.empty()) {
      f.evidence += "; sequences " + list_text(std::vector<int>(not_replayed.begin(), not_replayed.end())) +
                    " were not replayed (the size cap) and are counted with it";
      f.where["replay"]["sequences_not_replayed"] = std::vector<int>(not_replayed.begin(), not_replayed.end());
    }
    if (other_heads) f.evidence += "; rows failing only in heads not replayed are counted with it";
    replay_findings_.push_back(std::move(f));
  }
  // The closest mistakes that did not match (or every one, when none did): how much of the failure each reproduces.
  {
    std::vector<std::string> closest;
    int64_t moving = 0;  // mistakes that move some failing row towards the candidate
    for (const ReplayResult& r : outcome.results) moving += !r.matches && (r.failing_rows_matched > 0 || r.failing_rows_closer > 0);
    for (const ReplayResult& r : outcome.results) {
      if (r.matches || closest.size() >= 3) continue;
      if (r.failing_rows_matched == 0 && r.failing_rows_closer == 0) continue;
      const double within = r.elements ? 100.0 * double(r.elements_within) / double(r.elements) : 0.0;
      closest.push_back(r.mistake + " (" + std::to_string(r.failing_rows_matched) + " of " +
                        std::to_string(r.failing_rows) + " failing rows reproduced, " +
                        std::to_string(r.failing_rows_closer) + " moved towards the candidate, " + num(within) + "% of " +
                        std::to_string(r.elements) + " elements within the tolerance, worst ratio " + num(r.worst_ratio) + ")");
      nlohmann::ordered_json j;
      j["mistake"] = r.mistake;
      j["kind"] = std::string(diagnosis_kind_name(kind_of(r.family)));
      j["failing_rows"] = r.failing_rows;
      j["failing_rows_reproduced"] = r.failing_rows_matched;
      j["failing_rows_closer"] = r.failing_rows_closer;
      j["elements"] = r.elements;
      j["elements_within"] = r.elements_within;
      j["worst_ratio"] = r.worst_ratio;
      replay_closest_json_.push_back(j);
    }
    if (!closest.empty())
      replay_closest_ = (replay_findings_.empty() ? "no replayed mistake matches (" : "of the other replayed mistakes (") +
                        std::to_string(outcome.results.size()) + " replayed) the closest: " + list_text(closest, 3);
    else if (replay_findings_.empty() && !outcome.results.empty())
      replay_closest_ = "none of the " + std::to_string(outcome.results.size()) +
                        " replayed mistakes reproduces a failing row or moves one towards the candidate";
  }
  if (!outcome.not_replayed.empty())
    not_tested_.push_back("replay of " + std::to_string(outcome.not_replayed.size()) +
                          " mistakes past the diagnosis budget, or expected to take longer than was left of it (" +
                          list_text(outcome.not_replayed, 3) + ")");
}

}  // namespace cpgold::fx::diagnosis_detail
