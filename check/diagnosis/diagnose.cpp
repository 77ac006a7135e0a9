// The diagnosis of a failed check (docs/diagnosis.md): the failing results as subjects with their rows classified,
// every hypothesis test run (one file per kind beside this one), and the findings selected, most specific first.
#include "check/diagnosis/diagnose.hpp"
#include "check/diagnosis/diagnoser.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>

#include "fixtures/schema/fixture_schema.hpp"
#include "reference/input_error.hpp"
#include "reference/mask.hpp"

#include "check/diagnosis/replay.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::fx {

namespace diagnosis_detail {

const GoldenTensor& Diagnoser::golden(Quantity q) {
  auto found = golden_.find(q);
  if (found != golden_.end()) return found->second;
  GoldenTensor& t = golden_[q];
  const std::string path = golden_path(q);
  const std::vector<int64_t> d = in_.golden->info(path).dims;
  t.values = in_.golden->read_float(path);
  if (q == Quantity::lse) t.view = {t.values.data(), d[1], d[0], 1, 1, d[1]};
  else t.view = {t.values.data(), d[0], d[1], d[2], d[1] * d[2], d[2]};
  return t;
}

const DiagnosisCandidate* Diagnoser::candidate(int rank, int step, int pass, Quantity q) const {
  for (const DiagnosisCandidate& c : in_.candidates)
    if (c.rank == rank && c.step == step && c.quantity == q && (step < 0 || c.pass == pass)) return &c;
  return nullptr;
}

void Diagnoser::load_inputs() {
  if (inputs_loaded_) return;
  auto read = [&](const char* name, Tensor3<float>& t) {
    const std::string path = std::string("/inputs/") + name;
    const std::vector<int64_t> d = in_.golden->info(path).dims;
    t.rows = d[0], t.heads = d[1], t.dim = d[2];
    t.values = in_.golden->read_float(path);
  };
  read("q", iq_);
  read("k", ik_);
  read("v", iv_);
  read("dout", idout_);
  inputs_loaded_ = true;
}

TensorView<float> candidate_view(const DiagnosisCandidate& c, const std::vector<int64_t>& golden_dims, Quantity q) {
  if (q == Quantity::lse) {
    const int64_t h = golden_dims[0], t = golden_dims[1];
    if (c.lse_row_major) return view_lse_row_major(c.values->data(), t, h);
    return {c.values->data(), t, h, 1, 1, t};
  }
  return {c.values->data(), golden_dims[0], golden_dims[1], golden_dims[2], golden_dims[1] * golden_dims[2], golden_dims[2]};
}

std::string Diagnoser::result_name(const TensorResult& r) {
  return r.tensor + (r.rank >= 0 ? "@r" + std::to_string(r.rank) : std::string());
}

std::optional<TensorView<float>> Diagnoser::result_view(const TensorResult& r) const {
  const Quantity q = *parse_quantity(r.tensor);
  const DiagnosisCandidate* c = candidate(r.rank, -1, 0, q);
  if (!c || !c->values) return std::nullopt;
  const std::string dataset = r.rank >= 0 ? rank_output_path(r.rank, q) : golden_path(q);
  return candidate_view(*c, in_.golden->info(dataset).dims, q);
}

std::vector<Diagnoser::HeldResult> Diagnoser::held_results() const {
  std::vector<HeldResult> out;
  for (const TensorResult& r : report_.results) {
    if (r.missing || r.step >= 0) continue;
    if (const std::optional<TensorView<float>> view = result_view(r))
      out.push_back({&r, *parse_quantity(r.tensor), *view});
  }
  return out;
}

void Diagnoser::build_subjects() {
  // Every result the candidate holds: the failing ones to explain, the passing ones as evidence against a hypothesis
  // (a recomputed variant must agree with them too).
  for (const HeldResult& held : held_results()) {
    const TensorResult& r = *held.result;
    const Quantity q = held.quantity;
    Subject s;
    s.result = &r;
    s.name = result_name(r);
    s.quantity = q;
    s.rank = r.rank;
    s.kv = is_kv_side(q);
    s.lse = q == Quantity::lse;
    s.cand = held.view;
    s.golden = &golden(q);
    const Side& sd = side(s.kv);
    if (r.rank >= 0) s.global = sd.gather[static_cast<size_t>(r.rank)];
    else {
      s.global.resize(static_cast<size_t>(s.cand.rows));
      for (int64_t x = 0; x < s.cand.rows; ++x) s.global[static_cast<size_t>(x)] = x;
    }
    if (static_cast<int64_t>(s.global.size()) != s.cand.rows) continue;  // shapes were checked; never expected
    s.limit = r.evaluation.limits.max;
    s.mean_limit = r.evaluation.limits.mean;
    s.precision = check_precision(q, fx().spec.dtype);
    s.passing = r.ok();
    subjects_.push_back(std::move(s));
  }
  for (Subject& s : subjects_) classify(s);
}

void Diagnoser::classify(Subject& s) {
  const Side& sd = side(s.kv);
  const int64_t rows = s.cand.rows, heads = s.cand.heads, dim = s.cand.dim;
  s.item_bad = flags(static_cast<size_t>(rows * heads));
  s.row_bad = flags(static_cast<size_t>(rows));
  s.pad_nonzero = flags(static_cast<size_t>(rows));
  s.nonfinite = flags(static_cast<size_t>(rows));
  s.explained = flags(static_cast<size_t>(rows));
  const double empty = in_.empty_row_lse == EmptyRowLse::neg_inf ? -kInf : kInf;
  std::vector<std::pair<double, int64_t>> errors;  // (error, item) for a mean-only failure
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t g = s.global[static_cast<size_t>(row)];
    const bool valid = g >= 0 && g < static_cast<int64_t>(sd.valid.size()) && sd.valid[static_cast<size_t>(g)];
    if (!valid) {
      // LSE pad rows are never read; under --pad-rows unwritten neither are those of the other tensors
      if (s.lse || in_.pad_rows == PadRows::unwritten || s.passing) continue;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) {
          const float c = s.cand(row, h, x);
          if (!std::isfinite(c)) s.nonfinite[static_cast<size_t>(row)] = 1;
          else if (c != 0.f) s.pad_nonzero[static_cast<size_t>(row)] = 1;
        }
      continue;
    }
    for (int64_t h = 0; h < heads && !s.passing; ++h) {
      bool bad = false;
      double worst = 0;
      for (int64_t x = 0; x < dim; ++x) {
        const double c = s.cand(row, h, x), o = s.gold(row, h, x);
        if (s.lse && !std::isfinite(o)) {
          if (std::isnan(c)) s.nonfinite[static_cast<size_t>(row)] = 1;
          if (c != empty) bad = true;
          continue;
        }
        if (std::isnan(c) || (!std::isfinite(c) && (!s.lse || c > 0))) s.nonfinite[static_cast<size_t>(row)] = 1;
        const double e = distance(c, o);
        worst = std::max(worst, e);
        if (e > s.limit) bad = true;
      }
      if (bad) {
        s.item_bad[static_cast<size_t>(row * heads + h)] = 1;
        s.row_bad[static_cast<size_t>(row)] = 1;
        ++s.bad_items;
      } else if (worst > 0) {
        errors.push_back({worst, row * heads + h});
      }
    }
  }
  if (s.bad_items == 0 && !errors.empty() && s.result->evaluation.exact_ok() && !s.result->evaluation.mean_ok) {
    // Failed on the mean only: the items with the largest errors (above the mean limit) are the ones to explain.
    s.mean_only = true;
    std::sort(errors.begin(), errors.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    for (size_t i = 0; i < errors.size() && i < 64 && errors[i].first > s.mean_limit; ++i) {
      s.item_bad[static_cast<size_t>(errors[i].second)] = 1;
      s.row_bad[static_cast<size_t>(errors[i].second / heads)] = 1;
      ++s.bad_items;
    }
  }
  s.failing = flags(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row)
    s.failing[static_cast<size_t>(row)] = s.row_bad[static_cast<size_t>(row)] | s.pad_nonzero[static_cast<size_t>(row)] |
                                          s.nonfinite[static_cast<size_t>(row)];
}

std::vector<size_t> Diagnoser::subjects_of(std::initializer_list<Quantity> qs) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < subjects_.size(); ++i)
    if (std::find(qs.begin(), qs.end(), subjects_[i].quantity) != qs.end()) out.push_back(i);
  return out;
}

// Per-element tolerance of a comparison with a predicted value of magnitude `magnitude`: the deciding max limit,
// or the rounding floor of the check precision at that magnitude when the prediction is larger than the golden.
double Diagnoser::tol_of(const Subject& s, double magnitude) const {
  const double floor = floor_ulps(s.precision) * ulp_in(s.precision, 0.3 + std::fabs(magnitude));
  return 1.25 * std::max(s.limit, floor);
}

nlohmann::ordered_json Diagnoser::where_of(const std::map<size_t, std::vector<uint8_t>>& rows) const {
  nlohmann::ordered_json w;
  std::vector<std::string> results;
  std::set<int> ranks, sequences, heads;
  int64_t count = 0;
  for (const auto& [index, marks] : rows) {
    const Subject& s = subjects_[index];
    bool any = false;
    for (size_t row = 0; row < marks.size(); ++row) {
      if (!marks[row]) continue;
      any = true;
      ++count;
      const int64_t g = s.global[row];
      const Side& sd = side(s.kv);
      if (g >= 0 && g < static_cast<int64_t>(sd.sequence.size()) && sd.sequence[static_cast<size_t>(g)] >= 0)
        sequences.insert(sd.sequence[static_cast<size_t>(g)]);
    }
    if (!any) continue;
    results.push_back(s.name);
    if (s.rank >= 0) ranks.insert(s.rank);
  }
  w["results"] = results;
  w["ranks"] = std::vector<int>(ranks.begin(), ranks.end());
  w["sequences"] = std::vector<int>(sequences.begin(), sequences.end());
  w["rows"] = count;
  return w;
}

bool Diagnoser::all_explained_so_far() const {
  std::vector<std::vector<uint8_t>> marks(subjects_.size());
  for (size_t i = 0; i < subjects_.size(); ++i) marks[i] = flags(subjects_[i].failing.size());
  for (const Finding& f : findings_)
    for (const auto& [index, rows] : f.rows)
      for (size_t r = 0; r < rows.size(); ++r) marks[index][r] |= rows[r];
  for (size_t i = 0; i < subjects_.size(); ++i)
    for (size_t r = 0; r < marks[i].size(); ++r)
      if (subjects_[i].failing[r] && !marks[i][r]) return false;
  return true;
}

namespace {

// Symptoms: what the outputs show (garbage or NaN where it does not belong), not a mechanism.
bool is_symptom(DiagnosisKind kind) {
  return kind == DiagnosisKind::pad_rows_not_zero || kind == DiagnosisKind::nonfinite_leak;
}

int64_t count_rows(const std::map<size_t, std::vector<uint8_t>>& rows, const std::vector<Subject>& subjects) {
  int64_t n = 0;
  for (const auto& [index, marks] : rows)
    for (size_t r = 0; r < marks.size(); ++r) n += marks[r] && subjects[index].failing[r];
  return n;
}

}  // namespace

std::string Diagnoser::queryless_keys(nlohmann::ordered_json& where) const {
  const ThdLayout& l = fx().layout;
  std::vector<uint8_t> key(static_cast<size_t>(l.kv.total_rows), 0);
  std::set<std::string> tiles;
  for (const sim::Tile& t : plan().backward.tiles) {
    if (!t.computed) continue;
    for (size_t b = 0; b < t.call.sequences.size(); ++b) {
      const SequenceTile& seq = t.call.sequences[b];
      if (!seq.q.empty() || seq.kv.empty()) continue;
      for (const RowSegment& k : seq.kv)
        for (int32_t x = 0; x < k.count; ++x)
          key[static_cast<size_t>(l.kv.offset(static_cast<int>(b)) + k.position + x)] = 1;
      tiles.insert("rank " + std::to_string(t.rank) + " step " + std::to_string(t.step) + " sequence " + std::to_string(b));
    }
  }
  int64_t rows = 0;
  std::vector<std::string> names;
  for (const Subject& s : subjects_) {
    if (s.passing) continue;
    bool any = false;
    for (size_t r = 0; r < s.failing.size(); ++r) {
      if (!s.failing[r]) continue;
      const int64_t g = s.global[r];
      if (!s.kv || s.quantity == Quantity::o || g < 0 || g >= static_cast<int64_t>(key.size()) || !key[static_cast<size_t>(g)])
        return {};
      ++rows, any = true;
    }
    if (any) names.push_back(s.name);
  }
  if (rows == 0) return {};
  where["queryless_key_rows"] = rows;
  where["queryless_tiles"] = std::vector<std::string>(tiles.begin(), tiles.end());
  return "every failing row (" + std::to_string(rows) + " of " + names_text(names) +
         ") is the dK/dV of a key that a backward step holds without any query of its sequence (" +
         list_text(std::vector<std::string>(tiles.begin(), tiles.end()), 4) +
         "), where the gradients must be exactly 0: a kernel that writes dK/dV for a query-less sequence "
         "(TransformerEngine's finding 3, docs/findings/te-3-gqa-query-less-dkdv.md)";
}

Diagnosis Diagnoser::unexplained_line(const std::vector<const Finding*>& partial, int64_t failing,
                                      int64_t explained, const std::string& headline) const {
  std::vector<std::string> names;
  for (const Subject& s : subjects_)
    if (!s.passing) names.push_back(s.name);
  for (const TensorResult& r : report_.results)
    if (!r.ok() && (r.missing || r.step >= 0))
      names.push_back(result_name(r) +
                      (r.step >= 0 ? "/s" + std::to_string(r.step) + (r.pass == "forward" ? "f" : "b") : "") +
                      (r.missing ? " (missing)" : ""));
  Diagnosis d;
  d.kind = DiagnosisKind::unexplained;
  d.evidence = headline.empty() ? "no modelled mistake and no tested kind accounts for every failing row of " + names_text(names)
                                 : headline + " (" + names_text(names) + ")";
  if (headline.empty() && failing > 0 && explained > 0)
    d.evidence += " (" + std::to_string(explained) + " of " + std::to_string(failing) + " failing rows fit the partial findings below)";
  nlohmann::ordered_json symptoms = nlohmann::ordered_json::array(), partials = nlohmann::ordered_json::array();
  std::vector<std::string> symptom_texts, partial_texts;
  for (const Finding* f : partial) {
    nlohmann::ordered_json j;
    j["kind"] = std::string(diagnosis_kind_name(f->kind));
    j["evidence"] = f->evidence;
    j["rows"] = count_rows(f->rows, subjects_);
    if (f->where.contains("replay")) j["mistake"] = f->where["replay"]["mistake"];
    if (is_symptom(f->kind)) {
      symptoms.push_back(j);
      symptom_texts.push_back(f->evidence);
    } else {
      partials.push_back(j);
      partial_texts.push_back(std::string(diagnosis_kind_name(f->kind)) + " on " + std::to_string(j["rows"].get<int64_t>()) +
                              " of " + std::to_string(failing) + " failing rows (" + f->evidence + ")");
    }
  }
  nlohmann::ordered_json queryless;
  const std::string keys = queryless_keys(queryless);
  if (!keys.empty()) {
    queryless["kind"] = "queryless_keys";
    queryless["evidence"] = keys;
    symptoms.push_back(queryless);
    symptom_texts.push_back(keys);
  }
  if (!symptom_texts.empty()) d.evidence += "; symptoms seen: " + list_text(symptom_texts, 3);
  if (!partial_texts.empty())
    d.evidence += std::string(headline.empty() ? "; partial fits, not a diagnosis: " : "; the fits: ") + list_text(partial_texts, 3);
  if (!replay_closest_.empty()) d.evidence += "; " + replay_closest_;
  d.evidence += "; the first divergence above is where to start";
  if (!not_tested_.empty()) d.evidence += "; not tested: " + list_text(not_tested_, 2);
  d.where["results"] = names;
  d.where["rows"] = failing;
  d.where["explained_rows"] = explained;
  d.where["symptoms"] = symptoms;
  d.where["partial"] = partials;
  d.where["closest"] = replay_closest_json_;
  return d;
}

std::vector<Diagnosis> Diagnoser::run() {
  // A pass has no diagnosis; neither has a check that failed only because it compared nothing (the report says so).
  // A candidate that states other inputs is diagnosed even when its results pass.
  if (report_.pass() || (report_.every_result_ok() && !report_.foreign_inputs())) return {};
  // Nor has one whose only failures are tensors missing from the candidate (no values to diagnose: the report names
  // them, and for a forward-only candidate points to --tensors o,lse).
  bool only_missing = !report_.foreign_inputs();
  for (const TensorResult& r : report_.results) only_missing &= r.ok() || r.missing;
  if (only_missing) return {};
  const sim::CaseSpec& spec = fx().spec;
  hq_ = spec.heads_q;
  hkv_ = sim::heads_kv(spec);
  group_ = std::max(1, hq_ / std::max(1, hkv_));
  dqk_ = spec.dim_qk;
  dv_ = sim::dim_v(spec);
  scale_ = sim::softmax_scale(spec);
  window_ = sim::mask_window(spec);
  q_.build(fx().layout.q, plan().partition.q);
  kv_.build(fx().layout.kv, plan().partition.kv);
  build_subjects();
  bool any_failing = false;
  for (const Subject& s : subjects_) any_failing |= !s.passing;

  test_digest();
  if (any_failing) {
    test_nonfinite_and_pad();
    test_chunk_order();
    test_tail_rows();
    test_output_heads();
    test_lse_forms();
    test_gradient_factor();
    test_merge();
    // The recomputations read the fixture's inputs: a dataset that cannot be read leaves them untested (said in the
    // report), never turns a failed check into an unusable-input error.
    auto attempt = [&](const char* what, void (Diagnoser::*test)()) {
      try {
        (this->*test)();
      } catch (const InputError& e) {
        not_tested_.push_back(std::string(what) + " (" + e.what() + ")");
      }
    };
    // Run even where cheaper tests explain every row: a variant that fits the same rows is another name for them.
    attempt("softmax scale, mask edge, KV heads by recomputation", &Diagnoser::test_variants);
    if (!report_.foreign_inputs() && in_.replay_budget_seconds > 0) attempt("replay of modelled mistakes", &Diagnoser::test_replay);
  }

  // Selection, a greedy cover of the failing rows: the finding that explains the most failing rows not yet explained
  // is kept first (ties: the more specific kind), until no finding adds any; a finding whose rows another one
  // explains as well is left out (one mechanism for those rows, the one that also explains the most others).
  auto rank_of = [](const Finding& f) {
    if (f.priority >= 0) return f.priority;
    switch (f.kind) {
      case DiagnosisKind::inputs_mismatch: return 0;
      case DiagnosisKind::chunk_order: return 1;
      case DiagnosisKind::head_mapping: return 2;
      case DiagnosisKind::softmax_scale: return 3;
      case DiagnosisKind::mask_edge: return 4;
      case DiagnosisKind::lse_convention: return 5;
      case DiagnosisKind::merge: return 6;
      case DiagnosisKind::per_rank_counts: return 6;
      case DiagnosisKind::tail_rows_missing: return 7;
      case DiagnosisKind::pad_rows_not_zero: return 8;
      case DiagnosisKind::nonfinite_leak: return 9;
      case DiagnosisKind::unexplained: return 11;
    }
    return 11;
  };
  std::stable_sort(findings_.begin(), findings_.end(), [&](const Finding& a, const Finding& b) { return rank_of(a) < rank_of(b); });
  std::vector<std::vector<uint8_t>> explained(subjects_.size());
  for (size_t i = 0; i < subjects_.size(); ++i) explained[i] = flags(subjects_[i].failing.size());
  auto fresh_rows = [&](const Finding& f) {
    int64_t fresh = 0;
    for (const auto& [index, rows] : f.rows)
      for (size_t r = 0; r < rows.size(); ++r) fresh += rows[r] && subjects_[index].failing[r] && !explained[index][r];
    return fresh;
  };
  std::vector<uint8_t> kept(findings_.size(), 0);
  for (size_t i = 0; i < findings_.size(); ++i)  // certain ones first (the digest)
    if (findings_[i].always) kept[i] = 1;
  for (size_t i = 0; i < findings_.size(); ++i)
    if (kept[i])
      for (const auto& [index, rows] : findings_[i].rows)
        for (size_t r = 0; r < rows.size(); ++r) explained[index][r] |= rows[r];
  // Findings that name a mechanism first; a generic one (priority 10) only for rows none of them explains.
  for (const bool generic : {false, true})
    for (;;) {
      size_t best = findings_.size();
      int64_t best_fresh = 0;
      for (size_t i = 0; i < findings_.size(); ++i) {
        if (kept[i] || (rank_of(findings_[i]) >= 10) != generic) continue;
        const int64_t fresh = fresh_rows(findings_[i]);
        if (fresh > best_fresh) best = i, best_fresh = fresh;
      }
      if (best == findings_.size()) break;
      kept[best] = 1;
      for (const auto& [index, rows] : findings_[best].rows)
        for (size_t r = 0; r < rows.size(); ++r) explained[index][r] |= rows[r];
    }

  // What is stated: the replayed mistakes first (causes the simulation confirmed, listed before the symptoms the
  // other kinds name, which stay listed), then the kept findings; a kept finding of a cause kind whose rows the
  // replayed mistakes explain already is the same failure under a less specific name and is left out.
  std::vector<std::vector<uint8_t>> replay_rows(subjects_.size());
  for (size_t i = 0; i < subjects_.size(); ++i) replay_rows[i] = flags(subjects_[i].failing.size());
  for (const Finding& f : replay_findings_)
    for (const auto& [index, rows] : f.rows)
      for (size_t r = 0; r < rows.size(); ++r) replay_rows[index][r] |= rows[r];
  auto within_replay = [&](const Finding& f) {
    if (replay_findings_.empty()) return false;
    for (const auto& [index, rows] : f.rows)
      for (size_t r = 0; r < rows.size(); ++r)
        if (rows[r] && subjects_[index].failing[r] && !replay_rows[index][r]) return false;
    return true;
  };
  std::vector<const Finding*> stated;
  std::set<DiagnosisKind> replayed_kinds;
  for (const Finding& f : replay_findings_) stated.push_back(&f), replayed_kinds.insert(f.kind);
  for (size_t i = 0; i < findings_.size(); ++i) {
    if (!kept[i]) continue;
    const Finding& f = findings_[i];
    // Of the replayed mistake's own kind it joins its line (the block matching's chunk numbers beside the replay).
    if (!f.always && !is_symptom(f.kind) && !replayed_kinds.count(f.kind) && within_replay(f)) continue;
    stated.push_back(&f);
  }
  // Every failing row must be accounted for: a kind is stated only where the findings explain the whole failure
  // (partial fits can be coincidences: a block of one row that matches another chunk, a gradient that happens to be
  // the golden times a constant). Otherwise one unexplained line lists them as partial fits beside the symptoms.
  std::vector<std::vector<uint8_t>> covered(subjects_.size());
  for (size_t i = 0; i < subjects_.size(); ++i) covered[i] = flags(subjects_[i].failing.size());
  for (const Finding* f : stated)
    for (const auto& [index, rows] : f->rows)
      for (size_t r = 0; r < rows.size(); ++r) covered[index][r] |= rows[r];
  int64_t failing = 0, uncovered = 0;
  for (size_t i = 0; i < subjects_.size(); ++i)
    for (size_t r = 0; r < subjects_[i].failing.size(); ++r)
      if (subjects_[i].failing[r]) {
        ++failing;
        uncovered += !covered[i][r];
      }
  bool digest = false;
  for (const Finding* f : stated) digest |= f->always;
  std::vector<Diagnosis> out;
  if (stated.empty() || (uncovered > 0 && !digest)) {
    std::vector<const Finding*> partial;
    for (const Finding& f : replay_findings_) partial.push_back(&f);
    for (const Finding& f : findings_)
      if (count_rows(f.rows, subjects_) > 0) partial.push_back(&f);
    out.push_back(unexplained_line(partial, failing, failing - uncovered));
    if (!not_tested_.empty()) out.back().where["not_tested"] = not_tested_;
    return out;
  }
  // Other names for the same rows: a finding of another cause kind (stated or not) that explains every failing row a
  // stated one explains; the case cannot tell them apart (one token under a wrong scale is an LSE in another base).
  auto also_fits = [&](const Finding& f) {
    std::set<std::string> kinds;
    auto covers = [&](const Finding& g) {
      if (g.kind == f.kind || is_symptom(g.kind) || g.priority >= 10) return false;
      int64_t mine = 0;
      for (const auto& [index, rows] : f.rows)
        for (size_t r = 0; r < rows.size(); ++r) {
          if (!rows[r] || !subjects_[index].failing[r]) continue;
          ++mine;
          const auto found = g.rows.find(index);
          if (found == g.rows.end() || r >= found->second.size() || !found->second[r]) return false;
        }
      return mine > 0;
    };
    for (const Finding& g : findings_)
      if (covers(g)) kinds.insert(std::string(diagnosis_kind_name(g.kind)));
    for (const Finding& g : replay_findings_)
      if (covers(g)) kinds.insert(std::string(diagnosis_kind_name(g.kind)));
    return std::vector<std::string>(kinds.begin(), kinds.end());
  };
  // Two replayed mistakes of different kinds that both reproduce the whole candidate are two names for one failure (one
  // token that a count one short and the cu // W shortcut both leave unwritten): the case cannot tell them apart.
  {
    std::set<DiagnosisKind> replayed_kinds;
    for (const Finding& f : replay_findings_) replayed_kinds.insert(f.kind);
    if (replayed_kinds.size() > 1) {
      std::vector<std::string> kinds, mistakes;
      for (const Finding& f : replay_findings_) {
        kinds.push_back(std::string(diagnosis_kind_name(f.kind)));
        mistakes.push_back(f.where["replay"]["mistake"].get<std::string>());
      }
      std::vector<const Finding*> partial;
      for (const Finding& f : replay_findings_) partial.push_back(&f);
      Diagnosis d = unexplained_line(partial, failing, failing - uncovered,
                                     "the simulations of " + list_text(mistakes, 4) + " (" + list_text(kinds, 4) +
                                         ") reproduce the candidate alike: this case cannot tell them apart");
      d.where["ambiguous"] = kinds;
      out.push_back(std::move(d));
      if (!not_tested_.empty()) out.back().where["not_tested"] = not_tested_;
      return out;
    }
  }
  // Without a replayed mistake to confirm a mechanism, two kinds that fit the same rows leave the name open (one token
  // under a scale x log2 e is an LSE in base 2 as well): the report says so instead of picking one.
  if (replay_findings_.empty()) {
    for (const Finding* fp : stated) {
      if (is_symptom(fp->kind) || fp->always) continue;
      const std::vector<std::string> other = also_fits(*fp);
      if (other.empty()) continue;
      std::vector<const Finding*> partial;
      for (const Finding& f : findings_)
        if (count_rows(f.rows, subjects_) > 0) partial.push_back(&f);
      Diagnosis d = unexplained_line(partial, failing, failing,
                                     "the failing rows fit " + std::string(diagnosis_kind_name(fp->kind)) + " and " +
                                         list_text(other, 4) + " alike: this case cannot tell them apart");
      std::vector<std::string> fits = {std::string(diagnosis_kind_name(fp->kind))};
      fits.insert(fits.end(), other.begin(), other.end());
      d.where["ambiguous"] = fits;
      out.push_back(std::move(d));
      if (!not_tested_.empty()) out.back().where["not_tested"] = not_tested_;
      return out;
    }
  }
  std::map<DiagnosisKind, std::map<size_t, std::vector<uint8_t>>> rows_of_kind;
  for (const Finding* fp : stated) {
    const Finding& f = *fp;
    for (const auto& [index, rows] : f.rows) {
      std::vector<uint8_t>& mine = rows_of_kind[f.kind][index];
      if (mine.empty()) mine = flags(rows.size());
      for (size_t r = 0; r < rows.size(); ++r) mine[r] |= rows[r];
    }
    bool joined = false;
    if (!f.replayed)
      for (Diagnosis& d : out)
        if (d.kind == f.kind) {
          d.evidence += "; " + f.evidence;
          joined = true;
          nlohmann::ordered_json w = where_of(rows_of_kind[f.kind]);  // the union's results, ranks, sequences, rows
          for (auto& [key, value] : w.items()) d.where[key] = value;
        }
    if (joined) continue;
    Diagnosis d{f.kind, f.evidence, f.where};
    if (!is_symptom(f.kind) && !f.always) {
      const std::vector<std::string> other = also_fits(f);
      if (!other.empty()) {
        d.evidence += "; the same rows fit " + list_text(other, 4) + " as well: this case cannot tell them apart";
        d.where["also_fits"] = other;
      }
    }
    out.push_back(std::move(d));
  }
  if (!not_tested_.empty()) out.back().where["not_tested"] = not_tested_;
  return out;
}

}  // namespace diagnosis_detail


std::vector<Diagnosis> diagnose(const DiagnosisInput& input, const CheckReport& report) {
  diagnosis_detail::Diagnoser diagnoser(input, report);
  return diagnoser.run();
}

}  // namespace cpgold::fx
