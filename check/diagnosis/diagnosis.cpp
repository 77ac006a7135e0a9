#include "check/diagnosis/diagnosis.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <set>

#include "check/diagnosis/diagnosis_engine.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "check/diagnosis/replay.hpp"
#include "reference/input_error.hpp"
#include "reference/mask.hpp"
#include "sim/case_spec.hpp"

namespace cpgold::fx {

std::string_view diagnosis_kind_name(DiagnosisKind kind) {
  switch (kind) {
    case DiagnosisKind::inputs_mismatch: return "inputs_mismatch";
    case DiagnosisKind::chunk_order: return "chunk_order";
    case DiagnosisKind::head_mapping: return "head_mapping";
    case DiagnosisKind::softmax_scale: return "softmax_scale";
    case DiagnosisKind::mask_edge: return "mask_edge";
    case DiagnosisKind::lse_convention: return "lse_convention";
    case DiagnosisKind::merge: return "merge";
    case DiagnosisKind::per_rank_counts: return "per_rank_counts";
    case DiagnosisKind::tail_rows_missing: return "tail_rows_missing";
    case DiagnosisKind::pad_rows_not_zero: return "pad_rows_not_zero";
    case DiagnosisKind::nonfinite_leak: return "nonfinite_leak";
    case DiagnosisKind::unexplained: return "unexplained";
  }
  return "?";
}

std::optional<DiagnosisKind> parse_diagnosis_kind(std::string_view name) {
  for (DiagnosisKind kind : kAllDiagnosisKinds)
    if (diagnosis_kind_name(kind) == name) return kind;
  return std::nullopt;
}

std::string render_diagnosis_text(const std::vector<Diagnosis>& findings) {
  std::string out;
  for (const Diagnosis& d : findings)
    out += "diagnosis: " + std::string(diagnosis_kind_name(d.kind)) + ": " + d.evidence + "\n";
  return out;
}

nlohmann::ordered_json diagnosis_json(const std::vector<Diagnosis>& findings) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const Diagnosis& d : findings) {
    nlohmann::ordered_json j;
    j["kind"] = std::string(diagnosis_kind_name(d.kind));
    j["evidence"] = d.evidence;
    j["where"] = d.where.is_null() ? nlohmann::ordered_json::object() : d.where;
    out.push_back(j);
  }
  return out;
}

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

void Diagnoser::build_subjects() {
  for (const TensorResult& r : report_.results) {
    if (r.missing || r.ok() || r.step >= 0) continue;
    const std::optional<TensorView<float>> view = result_view(r);
    if (!view) continue;
    const Quantity q = *parse_quantity(r.tensor);
    Subject s;
    s.result = &r;
    s.name = result_name(r);
    s.quantity = q;
    s.rank = r.rank;
    s.kv = is_kv_side(q);
    s.lse = q == Quantity::lse;
    s.cand = *view;
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
      if (s.lse || in_.pad_rows == PadRows::unwritten) continue;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; ++x) {
          const float c = s.cand(row, h, x);
          if (!std::isfinite(c)) s.nonfinite[static_cast<size_t>(row)] = 1;
          else if (c != 0.f) s.pad_nonzero[static_cast<size_t>(row)] = 1;
        }
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
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

// ---------------------------------------------------------------------------------------------------------------
// tail_rows_missing: in every group of rows (a sequence globally, or a sequence on a rank in rank-local order, or
// one chunk of it), the failing valid rows are the last k, the rows before them right, and the k rows unwritten.
void Diagnoser::test_tail_rows() {
  struct Group {
    std::vector<int64_t> rows;  // subject rows of the valid rows, in order
    int rank = -1, sequence = -1;
    int64_t expected = -1;      // rows a cu // W count leaves out (-1: no such prediction)
  };
  // The rank-local view of `rank`: per sequence (or per chunk with halves) the valid local rows in order, mapped by
  // `to_subject` to rows of the subject.
  auto rank_groups = [&](const Side& sd, int rank, bool halves, const std::function<int64_t(int64_t)>& to_subject) {
    std::vector<Group> out;
    const sim::SidePartition& part = *sd.part;
    const int w = part.cp_size();
    const std::vector<int32_t>& cu = sd.seqs->cu_seqlens;
    for (int b = 0; b < sd.seqs->batch(); ++b) {
      const int64_t start = sd.seqs->offset(b) / w;
      const int64_t c = part.chunk_size(b);
      for (int half = 0; half < (halves ? 2 : 1); ++half) {
        Group g;
        g.rank = rank;
        g.sequence = b;
        const int64_t first = start + (halves ? half * c : 0), count = halves ? c : 2 * c;
        const int64_t shortcut = halves ? cu[static_cast<size_t>(b + 1)] / (2 * w) - cu[static_cast<size_t>(b)] / (2 * w)
                                        : cu[static_cast<size_t>(b + 1)] / w - cu[static_cast<size_t>(b)] / w;
        g.expected = 0;
        for (int64_t x = first; x < first + count; ++x) {
          const int64_t global = sd.gather[static_cast<size_t>(rank)][static_cast<size_t>(x)];
          if (!sd.valid[static_cast<size_t>(global)]) continue;
          g.rows.push_back(to_subject(x));
          if (x - first >= shortcut) ++g.expected;
        }
        out.push_back(std::move(g));
      }
    }
    return out;
  };
  struct Fit {
    bool ok = false;
    bool some_kept = true;  // constant k: a group keeps a right row (else it needs another result that does)
    std::string pattern;
    std::vector<uint8_t> rows;
    std::vector<int64_t> ks;
    std::set<int> sequences, ranks;
  };
  auto missing_row = [](const Subject& s, int64_t row) {
    if (s.lse) {
      const double first = s.cand(row, 0, 0);
      if (!(first == 0 || std::isinf(first))) return false;
      for (int64_t h = 0; h < s.cand.heads; ++h)
        if (double(s.cand(row, h, 0)) != first) return false;
      return true;
    }
    for (int64_t h = 0; h < s.cand.heads; ++h)
      for (int64_t x = 0; x < s.cand.dim; ++x)
        if (s.cand(row, h, x) != 0.f) return false;
    return true;
  };
  // Per group: k_bad trailing failing rows (every failing row of the group among them, each unwritten), k_miss
  // trailing unwritten rows (a tail row whose golden value is itself 0, a row without keys, counts as either).
  auto fit = [&](const Subject& s, const std::vector<Group>& groups, bool use_expected) {
    struct Tail {
      int64_t bad = 0, missing = 0, size = 0, expected = -1;
      int rank = -1, sequence = -1;
    };
    std::vector<Tail> tails;
    int64_t bad_rows = 0, covered = 0;
    for (uint8_t b : s.row_bad) bad_rows += b;
    for (const Group& g : groups) {
      Tail t;
      t.size = static_cast<int64_t>(g.rows.size());
      t.expected = g.expected;
      t.rank = g.rank;
      t.sequence = g.sequence;
      auto from_end = [&](int64_t i) { return g.rows[g.rows.size() - 1 - static_cast<size_t>(i)]; };
      while (t.bad < t.size && s.row_bad[static_cast<size_t>(from_end(t.bad))]) {
        if (!missing_row(s, from_end(t.bad))) return Fit{};
        ++t.bad;
      }
      for (int64_t i = t.bad; i < t.size; ++i)
        if (s.row_bad[static_cast<size_t>(from_end(i))]) return Fit{};  // a failing row before the tail
      t.missing = t.bad;
      while (t.missing < t.size && missing_row(s, from_end(t.missing))) ++t.missing;
      covered += t.bad;
      tails.push_back(t);
    }
    if (covered == 0 || covered != bad_rows) return Fit{};
    Fit f;
    f.rows = flags(s.failing.size());
    auto take = [&](const Group& g, const Tail& t, int64_t k) {
      for (int64_t i = 0; i < std::min(k, t.size); ++i) f.rows[static_cast<size_t>(g.rows[g.rows.size() - 1 - static_cast<size_t>(i)])] = 1;
      if (k > 0) {
        f.ks.push_back(k);
        f.sequences.insert(t.sequence);
        if (t.rank >= 0) f.ranks.insert(t.rank);
      }
    };
    bool cu = use_expected;
    for (const Tail& t : tails) cu &= t.bad <= t.expected && t.expected <= std::max(t.bad, t.missing);
    if (cu) {
      f.pattern = "cu";
      for (size_t i = 0; i < tails.size(); ++i) take(groups[i], tails[i], tails[i].expected);
      f.ok = true;
      return f;
    }
    int64_t k = 0;
    for (const Tail& t : tails) k = std::max(k, t.bad);
    bool constant = true, some_kept = false;
    for (const Tail& t : tails) {
      if (t.bad == 0) continue;
      constant &= k <= std::max(t.bad, t.missing);
      some_kept |= k < t.size;
    }
    if (!constant) return Fit{};
    f.some_kept = some_kept;  // whole sequences at 0 are no tail unless another result shows the same k with a kept row
    f.pattern = "constant";
    for (size_t i = 0; i < tails.size(); ++i)
      if (tails[i].bad > 0) take(groups[i], tails[i], k);
    f.ok = true;
    return f;
  };

  Finding finding;
  finding.kind = DiagnosisKind::tail_rows_missing;
  std::map<std::string, std::vector<std::string>> by_pattern;  // pattern text -> subjects
  std::set<int> sequences, ranks;
  struct Chosen {
    size_t subject;
    std::string view;
    Fit fit;
  };
  std::vector<Chosen> chosen;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    if (s.bad_items == 0 || s.mean_only) continue;
    const Side& sd = side(s.kv);
    const int w = plan().cp_size;
    std::vector<std::pair<std::string, Fit>> fits;  // most specific first
    auto try_ranks = [&](bool halves, const std::string& name) {
      std::vector<Group> groups;
      for (int r = 0; r < w; ++r) {
        if (s.rank >= 0 && r != s.rank) continue;
        std::vector<Group> gr = rank_groups(sd, r, halves, [&](int64_t x) {
          return s.rank >= 0 ? x : sd.gather[static_cast<size_t>(r)][static_cast<size_t>(x)];
        });
        groups.insert(groups.end(), gr.begin(), gr.end());
      }
      Fit f = fit(s, groups, w > 1);
      if (f.ok) fits.push_back({name, std::move(f)});
    };
    if (w > 1 || s.rank >= 0) try_ranks(false, w > 1 ? "rank" : "global");
    if (w > 1) try_ranks(true, "chunk");
    if (s.rank < 0) {
      std::vector<Group> groups;
      for (int b = 0; b < sd.seqs->batch(); ++b) {
        Group g;
        g.sequence = b;
        for (int32_t x = 0; x < sd.seqs->length(b); ++x) g.rows.push_back(sd.seqs->offset(b) + x);
        groups.push_back(std::move(g));
      }
      Fit f = fit(s, groups, false);
      if (f.ok) fits.push_back({"global", std::move(f)});
    }
    if (fits.empty()) continue;
    // cu // W first, then a constant k over rank-local sequences, then over global sequences.
    std::stable_sort(fits.begin(), fits.end(), [](const auto& a, const auto& b) { return (a.second.pattern == "cu") > (b.second.pattern == "cu"); });
    const auto& [view, f] = fits.front();
    chosen.push_back({i, view, f});
  }
  // A result whose every affected group lost all its rows counts when another one shows the same k with rows kept.
  std::set<std::string> kept_patterns;
  for (const Chosen& c : chosen)
    if (c.fit.some_kept) kept_patterns.insert(c.view + "/" + c.fit.pattern + "/" + std::to_string(c.fit.ks.empty() ? 0 : c.fit.ks.front()));
  for (const Chosen& c : chosen) {
    const size_t i = c.subject;
    const Subject& s = subjects_[i];
    const std::string& view = c.view;
    const Fit& f = c.fit;
    if (!f.some_kept && !kept_patterns.count(view + "/" + f.pattern + "/" + std::to_string(f.ks.empty() ? 0 : f.ks.front())))
      continue;
    std::string text;
    if (f.pattern == "cu")
      text = view == "chunk" ? "the valid rows past cu_seqlens // (2W) of each chunk on each rank"
                             : "the valid rows past cu_seqlens // W of each sequence on each rank";
    else
      text = "the last " + std::to_string(f.ks.front()) + " valid row(s) of each affected sequence" +
             (view == "global" ? "" : view == "rank" ? " on each rank (rank-local order)" : " in each chunk");
    by_pattern[text].push_back(s.name);
    sequences.insert(f.sequences.begin(), f.sequences.end());
    ranks.insert(f.ranks.begin(), f.ranks.end());
    finding.rows[i] = f.rows;
  }
  if (finding.rows.empty()) return;
  std::ostringstream e;
  bool first = true;
  for (const auto& [text, names] : by_pattern) {
    e << (first ? "" : "; ") << text << " in " << names_text(names);
    first = false;
  }
  int64_t rows = 0;
  for (const auto& [index, marks] : finding.rows)
    for (uint8_t m : marks) rows += m;
  e << " hold 0 (never written) while every other valid row is right (" << rows << " row(s) of sequence(s) "
    << list_text(std::vector<int>(sequences.begin(), sequences.end())) << ")";
  finding.evidence = e.str();
  finding.where = where_of(finding.rows);
  add(std::move(finding));
}

// ---------------------------------------------------------------------------------------------------------------
// chunk_order: block matching. Every chunk-sized block of a failing result is compared with the golden rows of each
// chunk of the same sequence; a block that holds another chunk's rows names it. Whole-tensor orders as well: a global
// tensor in rank order (the ranks' local rows concatenated), a rank holding a contiguous slice in sequence order.
void Diagnoser::test_chunk_order() {
  const int w = plan().cp_size;
  // Does `count` rows of the subject from `first` hold the golden rows of chunk `chunk` of sequence b?
  // informative: the source has valid rows with values past the limit (an all-pad or all-zero source only says that
  // the block is zero).
  auto holds = [&](const Subject& s, int64_t first, int b, int chunk, bool& informative) {
    const Side& sd = side(s.kv);
    const int64_t c = sd.part->chunk_size(b);
    informative = false;
    for (int64_t i = 0; i < c; ++i) {
      const int64_t row = first + i;
      const int64_t pos = chunk * c + i;
      const int64_t g = sd.seqs->offset(b) + pos;
      const bool valid = pos < sd.seqs->length(b);
      if (!valid) {
        if (s.lse) continue;
        for (int64_t h = 0; h < s.cand.heads; ++h)
          for (int64_t x = 0; x < s.cand.dim; ++x)
            if (s.cand(row, h, x) != 0.f) return false;
        continue;
      }
      for (int64_t h = 0; h < s.cand.heads; ++h)
        for (int64_t x = 0; x < s.cand.dim; ++x) {
          const double o = s.golden->view(g, h, x);
          if (distance(s.cand(row, h, x), o) > s.limit) {
            if (s.lse && !std::isfinite(o) && !std::isfinite(double(s.cand(row, h, x)))) continue;
            return false;
          }
          // A zero golden row (one visible key gives dQ = 0) matches any zero block: it names nothing.
          if (s.lse ? std::isfinite(o) : std::fabs(o) > s.limit) informative = true;
        }
    }
    return true;
  };
  struct SlotMatch {
    int rank = 0, sequence = 0, slot = 0, expected = 0;
    int holds = -1;             // informative match
    std::vector<int> all_pad;   // all-pad chunks the (zero) block matches
  };
  Finding finding;
  finding.kind = DiagnosisKind::chunk_order;
  std::map<std::string, std::vector<std::string>> texts;  // description (or @rule) -> subject names
  std::map<std::string, std::set<int>> rule_ranks;        // @rule -> ranks that follow it
  std::vector<nlohmann::ordered_json> detail;
  struct Block {  // the moved blocks of one subject and rank
    size_t subject = 0;
    int rank = 0;
    std::vector<SlotMatch> moved;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    const Side& sd = side(s.kv);
    std::vector<uint8_t> rows = flags(s.failing.size());
    // Whole-tensor orders first.
    const int64_t tpr = sd.part->local_sequence_rows();
    auto whole = [&](const std::function<int64_t(int64_t)>& source, int64_t count) {
      bool informative = false;
      for (int64_t row = 0; row < count; ++row) {
        const int64_t g = source(row);
        if (g < 0 || g >= static_cast<int64_t>(sd.valid.size())) return false;
        const bool valid = sd.valid[static_cast<size_t>(g)];
        for (int64_t h = 0; h < s.cand.heads; ++h)
          for (int64_t x = 0; x < s.cand.dim; ++x) {
            const double c = s.cand(row, h, x);
            if (!valid) {
              if (!s.lse && c != 0) return false;
              continue;
            }
            const double o = s.golden->view(g, h, x);
            if (s.lse && !std::isfinite(o) && !std::isfinite(c)) continue;
            if (distance(c, o) > s.limit) return false;
            if (s.global[static_cast<size_t>(row)] != g && (s.lse ? std::isfinite(o) : std::fabs(o) > s.limit)) informative = true;
          }
      }
      return informative;
    };
    if (w > 1 && s.rank < 0) {
      const std::vector<int64_t> map = sd.part->rank_order_to_sequence_order();
      if (whole([&](int64_t x) { return map[static_cast<size_t>(x)]; }, static_cast<int64_t>(map.size()))) {
        for (size_t x = 0; x < map.size(); ++x) rows[x] = 1;
        texts["the global tensor is in rank order (the ranks' local rows one after the other), not in sequence order"]
            .push_back(s.name);
        finding.rows[i] = rows;
        continue;
      }
    }
    if (w > 1 && s.rank >= 0) {
      const int r = s.rank;
      if (whole([&](int64_t x) { return r * tpr + x; }, tpr)) {
        for (int64_t x = 0; x < tpr; ++x) rows[static_cast<size_t>(x)] = 1;
        texts["@slice"].push_back(s.name);
        rule_ranks["@slice"].insert(r);
        finding.rows[i] = rows;
        continue;
      }
    }
    // Block matching, per rank and sequence: the blocks of chunks r and 2W-1-r.
    for (int r = 0; r < w; ++r) {
      if (s.rank >= 0 && r != s.rank) continue;
      std::vector<SlotMatch> moved;
      for (int b = 0; b < sd.seqs->batch(); ++b) {
        const int64_t c = sd.part->chunk_size(b);
        if (c == 0) continue;
        for (int slot = 0; slot < 2; ++slot) {
          const int expected = slot == 0 ? r : 2 * w - 1 - r;
          const int64_t first = s.rank >= 0 ? sd.seqs->offset(b) / w + slot * c : sd.seqs->offset(b) + expected * c;
          bool block_failing = false;
          for (int64_t x = first; x < first + c; ++x) block_failing |= s.failing[static_cast<size_t>(x)] != 0;
          if (!block_failing) continue;
          bool informative = false;
          if (holds(s, first, b, expected, informative)) continue;
          SlotMatch m{r, b, slot, expected, -1, {}};
          for (int chunk = 0; chunk < 2 * w; ++chunk) {
            if (chunk == expected) continue;
            if (!holds(s, first, b, chunk, informative)) continue;
            if (informative) {
              m.holds = chunk;
              break;
            }
            m.all_pad.push_back(chunk);
          }
          if (m.holds >= 0 || !m.all_pad.empty()) moved.push_back(m);
        }
      }
      if (!moved.empty()) blocks.push_back({i, r, std::move(moved)});
    }
  }
  // Name each rank's pattern from the blocks that match a chunk with values (swapped pair, another rank's chunks, a
  // contiguous split, or a list); blocks that only match all-pad chunks (an LSE row holding a pad chunk's -inf, a zero
  // block) count where they fit the pattern another result of the same rank showed.
  struct Pattern {
    std::string text;
    std::function<int(const SlotMatch&)> source;  // empty: a list, not reusable
  };
  std::map<int, Pattern> patterns;
  bool seen_swap = false, seen_contiguous = false;  // rank-independent rules seen on some rank
  auto fits = [&](const std::vector<SlotMatch>& moved, const std::function<int(const SlotMatch&)>& want) {
    for (const SlotMatch& m : moved) {
      const int c = want(m);
      if (m.holds >= 0 ? m.holds != c : std::find(m.all_pad.begin(), m.all_pad.end(), c) == m.all_pad.end()) return false;
    }
    return true;
  };
  auto accept = [&](const Block& block, const std::string& text) {
    const Subject& s = subjects_[block.subject];
    const Side& sd = side(s.kv);
    texts[text].push_back(s.name);
    if (text[0] == '@') rule_ranks[text].insert(block.rank);
    std::vector<uint8_t>& rows = finding.rows[block.subject];
    if (rows.empty()) rows = flags(s.failing.size());
    for (const SlotMatch& m : block.moved) {
      const int64_t c = sd.part->chunk_size(m.sequence);
      const int64_t first = s.rank >= 0 ? sd.seqs->offset(m.sequence) / w + m.slot * c : sd.seqs->offset(m.sequence) + m.expected * c;
      for (int64_t x = first; x < first + c; ++x) rows[static_cast<size_t>(x)] = 1;
      if (detail.size() < 32) {
        nlohmann::ordered_json d;
        d["result"] = s.name;
        d["rank"] = m.rank;
        d["sequence"] = m.sequence;
        d["expected_chunk"] = m.expected;
        d["holds_chunk"] = m.holds >= 0 ? nlohmann::ordered_json(m.holds) : nlohmann::ordered_json(m.all_pad);
        detail.push_back(d);
      }
    }
  };
  for (const Block& block : blocks) {
    const std::vector<SlotMatch>& moved = block.moved;
    const int r = block.rank;
    bool informative = false;
    for (const SlotMatch& m : moved) informative |= m.holds >= 0;
    if (!informative) continue;
    Pattern p;
    const std::function<int(const SlotMatch&)> swap = [w, r](const SlotMatch& m) { return m.slot == 0 ? 2 * w - 1 - r : r; };
    const std::function<int(const SlotMatch&)> contiguous = [r](const SlotMatch& m) { return m.slot == 0 ? 2 * r : 2 * r + 1; };
    int other = -1;
    for (const SlotMatch& m : moved)
      if (m.holds >= 0) other = m.slot == 0 ? m.holds : 2 * w - 1 - m.holds;
    const std::function<int(const SlotMatch&)> permuted = [w, other](const SlotMatch& m) { return m.slot == 0 ? other : 2 * w - 1 - other; };
    if (fits(moved, swap)) p = {"@swap", swap};
    else if (w > 1 && fits(moved, contiguous)) p = {"@contiguous", contiguous};
    else if (other >= 0 && other < w && other != r && fits(moved, permuted))
      p = {"the place of rank " + std::to_string(r) + " holds rank " + std::to_string(other) + "'s rows (chunks " +
               std::to_string(other) + " and " + std::to_string(2 * w - 1 - other) + "): ranks permuted",
           permuted};
    else {
      std::vector<std::string> moves;
      for (const SlotMatch& m : moved)
        if (m.holds >= 0)
          moves.push_back("chunk " + std::to_string(m.holds) + " in the place of chunk " + std::to_string(m.expected) +
                          " (sequence " + std::to_string(m.sequence) + ")");
      p.text = "rank " + std::to_string(r) + ": " + list_text(moves, 4);
    }
    accept(block, p.text);
    if (p.source && !patterns.count(r)) patterns[r] = p;
    seen_swap |= p.text == "@swap";
    seen_contiguous |= p.text == "@contiguous";
  }
  for (const Block& block : blocks) {
    bool informative = false;
    for (const SlotMatch& m : block.moved) informative |= m.holds >= 0;
    if (informative) continue;
    const int r = block.rank;
    const auto found = patterns.find(r);
    if (found != patterns.end() && fits(block.moved, found->second.source)) {
      accept(block, found->second.text);
      continue;
    }
    // A rule the other ranks follow (a rank whose chunks are all padding shows no values of its own).
    if (seen_contiguous && w > 1 && fits(block.moved, [r](const SlotMatch& m) { return m.slot == 0 ? 2 * r : 2 * r + 1; }))
      accept(block, "@contiguous");
    else if (seen_swap && fits(block.moved, [w, r](const SlotMatch& m) { return m.slot == 0 ? 2 * w - 1 - r : r; }))
      accept(block, "@swap");
  }
  if (finding.rows.empty()) return;
  std::ostringstream e;
  bool first = true;
  const int64_t tpr = q_.part->local_sequence_rows();
  for (const auto& [key, all_names] : texts) {
    std::vector<std::string> names;
    for (const std::string& n : all_names)
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    std::string text = key;
    if (key[0] == '@') {
      // The rule with each rank's numbers (rank 2 of W = 4 holds chunks 2 and 5), not its symbols.
      const std::set<int>& rs = rule_ranks[key];
      auto per_rank = [&](const std::function<std::string(int)>& of) {
        std::vector<std::string> parts;
        for (int r : rs) parts.push_back("rank " + std::to_string(r) + " " + of(r));
        return list_text(parts, 4);
      };
      auto own = [w](int r) { return "chunks " + std::to_string(r) + " and " + std::to_string(2 * w - 1 - r); };
      if (key == "@swap")
        text = per_rank([&](int r) { return own(r) + " swapped"; }) +
               " (each of the two chunks holds the other's rows)";
      if (key == "@contiguous")
        text = per_rank([&](int r) {
                 return "holds chunks " + std::to_string(2 * r) + " and " + std::to_string(2 * r + 1) + " instead of " +
                        own(r);
               }) + " (a contiguous split in sequence order)";
      if (key == "@slice")
        text = per_rank([&](int r) {
                 return "holds rows [" + std::to_string(r * tpr) + ", " + std::to_string((r + 1) * tpr) +
                        ") of the global tensor instead of " + own(r);
               }) + " (a contiguous slice in sequence order)";
    }
    e << (first ? "" : "; ") << text << " in " << names_text(names);
    first = false;
  }
  finding.evidence = e.str();
  finding.where = where_of(finding.rows);
  finding.where["chunks"] = detail;
  add(std::move(finding));
}

// ---------------------------------------------------------------------------------------------------------------
// head_mapping, output side: a head of the candidate holds another head's golden rows (a2a head scatter, heads
// permuted on the way out).
void Diagnoser::test_output_heads() {
  Finding finding;
  finding.kind = DiagnosisKind::head_mapping;
  std::map<std::string, std::vector<std::string>> texts;
  for (size_t i = 0; i < subjects_.size(); ++i) {
    const Subject& s = subjects_[i];
    if (s.cand.heads < 2 || s.bad_items == 0 || s.mean_only) continue;
    const Side& sd = side(s.kv);
    std::vector<int> bad_heads;
    for (int64_t h = 0; h < s.cand.heads; ++h) {
      bool bad = false;
      for (int64_t row = 0; row < s.cand.rows && !bad; ++row) bad = s.item_bad[static_cast<size_t>(row * s.cand.heads + h)];
      if (bad) bad_heads.push_back(static_cast<int>(h));
    }
    std::vector<std::string> moves;
    bool all = true;
    for (int h : bad_heads) {
      int found = -1;
      for (int64_t other = 0; other < s.cand.heads && found < 0; ++other) {
        if (other == h) continue;
        bool ok = true, informative = false;
        for (int64_t row = 0; row < s.cand.rows && ok; ++row) {
          const int64_t g = s.global[static_cast<size_t>(row)];
          if (!sd.valid[static_cast<size_t>(g)]) continue;
          for (int64_t x = 0; x < s.cand.dim && ok; ++x) {
            const double c = s.cand(row, h, x), o = s.golden->view(g, other, x);
            if (s.lse && !std::isfinite(o) && !std::isfinite(c)) continue;
            ok = distance(c, o) <= s.limit;
            informative |= s.lse ? std::isfinite(o) : std::fabs(o) > s.limit;
          }
        }
        if (ok && informative) found = static_cast<int>(other);
      }
      if (found < 0) {
        all = false;
        break;
      }
      moves.push_back("head " + std::to_string(h) + " holds head " + std::to_string(found));
    }
    if (!all || moves.empty()) continue;
    texts[list_text(moves, 6)].push_back(s.name);
    finding.rows[i] = s.row_bad;
  }
  if (finding.rows.empty()) return;
  std::ostringstream e;
  bool first = true;
  for (const auto& [text, names] : texts) {
    e << (first ? "" : "; ") << names_text(names) << ": " << text << "'s golden output";
    first = false;
  }
  e << " (heads exchanged on the way out)";
  finding.evidence = e.str();
  finding.where = where_of(finding.rows);
  add(std::move(finding));
}

// ---------------------------------------------------------------------------------------------------------------
// merge: the candidate's own step partials, mapped to global rows through the Plan and merged the right way
// (LSE-weighted for the forward, summed for the backward). A merge bug: on every failing item the partials merge to
// the golden while the candidate's merged output is something else; named when that something else is a plain sum
// of the partials, the merge without one partial, or (dK/dV) a partial added to another rank's rows.
void Diagnoser::test_merge() {
  struct Partial {
    int rank = 0, step = 0;
    const DiagnosisCandidate* a = nullptr;  // forward o / backward dq, dk or dv
    const DiagnosisCandidate* b = nullptr;  // forward lse
    const sim::Tile* tile = nullptr;
  };
  struct Ref {
    size_t partial;
    int64_t row, head;  // step row and tile head
  };
  auto row_map = [&](const sim::Tile& tile, bool kv) {  // step row -> global row (-1 outside the segments)
    std::vector<int64_t> map(static_cast<size_t>(kv ? tile.call.kv_rows : tile.call.q_rows), -1);
    const PackedSequences& seqs = kv ? fx().layout.kv : fx().layout.q;
    for (size_t b = 0; b < tile.call.sequences.size(); ++b)
      for (const RowSegment& seg : kv ? tile.call.sequences[b].kv : tile.call.sequences[b].q)
        for (int32_t x = 0; x < seg.count; ++x)
          map[static_cast<size_t>(seg.first_row + x)] = seqs.offset(static_cast<int>(b)) + seg.position + x;
    return map;
  };
  auto has_partials = [&](int pass, Quantity a) {
    for (const DiagnosisCandidate& c : in_.candidates)
      if (c.step >= 0 && c.pass == pass && c.quantity == a) return true;
    return false;
  };
  std::map<std::string, std::vector<std::string>> specific_texts, generic_texts;
  Finding specific, generic;
  specific.kind = generic.kind = DiagnosisKind::merge;
  generic.priority = 10;  // "merges to the golden, differs" names no mechanism: after every other kind
  auto record = [&](size_t id, const std::string& text, bool named, const std::vector<uint8_t>& rows) {
    (named ? specific_texts : generic_texts)[text].push_back(subjects_[id].name);
    std::vector<uint8_t>& mine = (named ? specific : generic).rows[id];
    if (mine.empty()) mine = flags(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) mine[r] |= rows[r];
  };

  // Forward: O and LSE.
  if (has_partials(0, Quantity::o) && has_partials(0, Quantity::lse)) {
    std::vector<Partial> partials;
    std::map<std::pair<int64_t, int64_t>, std::vector<Ref>> covering;  // (global row, head)
    for (const sim::Tile& tile : plan().forward.tiles) {
      if (!tile.computed) continue;
      const DiagnosisCandidate* o = candidate(tile.rank, tile.step, 0, Quantity::o);
      const DiagnosisCandidate* l = candidate(tile.rank, tile.step, 0, Quantity::lse);
      if (!o || !l) continue;
      partials.push_back({tile.rank, tile.step, o, l, &tile});
      const std::vector<int64_t> map = row_map(tile, false);
      for (size_t x = 0; x < map.size(); ++x)
        if (map[x] >= 0)
          for (int h = tile.head_begin; h < tile.head_end; ++h)
            covering[{map[x], h}].push_back({partials.size() - 1, static_cast<int64_t>(x), h - tile.head_begin});
    }
    auto o_of = [&](const Ref& r, int64_t x) {
      const Partial& p = partials[r.partial];
      const int64_t heads = p.tile->head_end - p.tile->head_begin;
      return double((*p.a->values)[static_cast<size_t>((r.row * heads + r.head) * dv_ + x)]);
    };
    auto lse_of = [&](const Ref& r) {
      const Partial& p = partials[r.partial];
      const int64_t heads = p.tile->head_end - p.tile->head_begin, rows = p.tile->call.q_rows;
      return double((*p.b->values)[static_cast<size_t>(p.b->lse_row_major ? r.row * heads + r.head : r.head * rows + r.row)]);
    };
    // The merge of the partials of one (row, head), leaving out partial `skip` (SIZE_MAX: none).
    auto merge = [&](const std::vector<Ref>& refs, size_t skip, std::vector<double>& o, double& lse) {
      lse = -kInf;
      for (const Ref& r : refs) {
        const double l = lse_of(r);
        if (r.partial == skip || l == -kInf) continue;
        lse = lse == -kInf ? l : std::max(lse, l) + std::log1p(std::exp(std::min(lse, l) - std::max(lse, l)));
      }
      o.assign(static_cast<size_t>(dv_), 0.0);
      if (lse == -kInf) return;
      for (const Ref& r : refs) {
        const double l = lse_of(r);
        if (r.partial == skip || l == -kInf) continue;
        const double w = std::exp(l - lse);
        for (int x = 0; x < dv_; ++x) o[static_cast<size_t>(x)] += w * o_of(r, x);
      }
    };
    for (size_t id : subjects_of({Quantity::o, Quantity::lse})) {
      const Subject& s = subjects_[id];
      if (s.bad_items == 0 || s.mean_only) continue;
      auto matches = [&](int64_t row, int64_t h, const std::vector<double>& po, double pl) {
        if (s.lse) return distance(s.cand(row, h, 0), pl) <= tol_of(s, pl);
        for (int x = 0; x < dv_; ++x)
          if (distance(s.cand(row, h, x), po[static_cast<size_t>(x)]) > tol_of(s, po[static_cast<size_t>(x)])) return false;
        return true;
      };
      bool merge_bug = true;
      int64_t checked = 0, unweighted = 0, differs = 0;
      std::map<std::pair<int, int>, int64_t> dropped;  // (rank, step) left out -> failing items it explains
      for (int64_t row = 0; row < s.cand.rows && merge_bug; ++row)
        for (int64_t h = 0; h < s.cand.heads && merge_bug; ++h) {
          if (!s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) continue;
          const auto found = covering.find({s.global[static_cast<size_t>(row)], h});
          if (found == covering.end()) {
            merge_bug = false;
            break;
          }
          std::vector<double> o;
          double lse = 0;
          merge(found->second, SIZE_MAX, o, lse);
          std::vector<double> golden_o(static_cast<size_t>(dv_));
          for (int x = 0; x < (s.lse ? 0 : dv_); ++x) golden_o[static_cast<size_t>(x)] = s.gold(row, h, x);
          // The partials merge to the golden, and the candidate holds something else.
          const bool partials_right = s.lse ? distance(lse, s.gold(row, h, 0)) <= tol_of(s, lse) : [&] {
            for (int x = 0; x < dv_; ++x)
              if (distance(o[static_cast<size_t>(x)], golden_o[static_cast<size_t>(x)]) > tol_of(s, o[static_cast<size_t>(x)])) return false;
            return true;
          }();
          merge_bug = partials_right;
          if (!merge_bug) break;
          ++checked;
          differs += !matches(row, h, o, lse);
          if (!s.lse) {
            std::vector<double> sum(static_cast<size_t>(dv_), 0.0);
            for (const Ref& r : found->second)
              for (int x = 0; x < dv_; ++x) sum[static_cast<size_t>(x)] += o_of(r, x);
            if (matches(row, h, sum, 0)) ++unweighted;
          }
          for (const Ref& r : found->second) {
            std::vector<double> po;
            double pl = 0;
            merge(found->second, r.partial, po, pl);
            if (matches(row, h, po, pl)) ++dropped[{partials[r.partial].rank, partials[r.partial].step}];
          }
        }
      if (!merge_bug || checked == 0 || 2 * differs < checked) continue;
      std::string text;
      if (unweighted == checked) text = "the merged O is the plain sum of the step partials (no exp(lse_i - lse) weights)";
      for (const auto& [rs, n] : dropped)
        if (text.empty() && n == checked)
          text = "the merge leaves out the step-" + std::to_string(rs.second) + " partial of rank " + std::to_string(rs.first);
      const bool named = !text.empty();
      if (!named) text = "the step partials merge to the golden but the merged " + std::string(quantity_name(s.quantity)) + " differs";
      record(id, text, named, s.row_bad);
    }
  }

  // Backward: dQ, dK, dV are sums of the step partials.
  for (Quantity q : {Quantity::dq, Quantity::dk, Quantity::dv}) {
    if (!has_partials(1, q)) continue;
    const bool kv = q != Quantity::dq;
    const Side& sd = side(kv);
    const int64_t dim = q == Quantity::dv ? dv_ : dqk_;
    std::vector<Partial> partials;
    std::vector<std::vector<int64_t>> maps;
    std::map<std::pair<int64_t, int64_t>, std::vector<Ref>> covering;
    for (const sim::Tile& tile : plan().backward.tiles) {
      if (!tile.computed) continue;
      const DiagnosisCandidate* c = candidate(tile.rank, tile.step, 1, q);
      if (!c) continue;
      partials.push_back({tile.rank, tile.step, c, nullptr, &tile});
      maps.push_back(row_map(tile, kv));
      const int hb = kv ? tile.kv_head_begin : tile.head_begin, he = kv ? tile.kv_head_end : tile.head_end;
      for (size_t x = 0; x < maps.back().size(); ++x)
        if (maps.back()[x] >= 0)
          for (int h = hb; h < he; ++h) covering[{maps.back()[x], h}].push_back({partials.size() - 1, static_cast<int64_t>(x), h - hb});
    }
    auto heads_of = [&](const Partial& p) {
      return kv ? p.tile->kv_head_end - p.tile->kv_head_begin : p.tile->head_end - p.tile->head_begin;
    };
    auto value = [&](size_t partial, int64_t row, int64_t head, int64_t x) {
      const Partial& p = partials[partial];
      return double((*p.a->values)[static_cast<size_t>((row * heads_of(p) + head) * dim + x)]);
    };
    for (size_t id : subjects_of({q})) {
      const Subject& s = subjects_[id];
      bool pads_only = kv && s.bad_items == 0;  // a partial that landed on another rank's pad rows only
      if (pads_only) pads_only = std::find(s.pad_nonzero.begin(), s.pad_nonzero.end(), 1) != s.pad_nonzero.end();
      if ((s.bad_items == 0 && !pads_only) || s.mean_only) continue;
      bool merge_bug = true;
      int64_t checked = 0, differs = 0;
      std::map<size_t, int64_t> dropped;  // partial left out -> failing items it explains
      for (int64_t row = 0; row < s.cand.rows && merge_bug; ++row)
        for (int64_t h = 0; h < s.cand.heads && merge_bug; ++h) {
          if (!s.item_bad[static_cast<size_t>(row * s.cand.heads + h)]) continue;
          const auto found = covering.find({s.global[static_cast<size_t>(row)], h});
          std::vector<double> sum(static_cast<size_t>(dim), 0.0);
          if (found != covering.end())
            for (const Ref& r : found->second)
              for (int64_t x = 0; x < dim; ++x) sum[static_cast<size_t>(x)] += value(r.partial, r.row, r.head, x);
          bool partials_right = true, candidate_is_sum = true;
          for (int64_t x = 0; x < dim; ++x) {
            const double p = sum[static_cast<size_t>(x)];
            partials_right &= distance(p, s.gold(row, h, x)) <= tol_of(s, p);
            candidate_is_sum &= distance(s.cand(row, h, x), p) <= tol_of(s, p);
          }
          merge_bug = partials_right;
          if (!merge_bug) break;
          ++checked;
          differs += !candidate_is_sum;
          if (found == covering.end()) continue;
          for (const Ref& r : found->second) {
            bool ok = true;
            for (int64_t x = 0; x < dim && ok; ++x) {
              const double p = sum[static_cast<size_t>(x)] - value(r.partial, r.row, r.head, x);
              ok = distance(s.cand(row, h, x), p) <= tol_of(s, p);
            }
            if (ok) ++dropped[r.partial];
          }
        }
      // The partials merge to the golden on every failing item, and the candidate holds something else on most
      // (an item just past the limit can sit within the tolerance of both).
      if (!merge_bug || (checked == 0 && !pads_only) || 2 * differs < checked) continue;
      std::string text;
      std::vector<uint8_t> rows = s.row_bad;
      for (const auto& [index, n] : dropped)
        if (text.empty() && n == checked) {
          const Partial& p = partials[index];
          text = "the step-" + std::to_string(p.step) + " " + std::string(quantity_name(q)) + " partial of rank " +
                 std::to_string(p.rank) + (kv && p.tile->kv_owner >= 0 ? " (KV of rank " + std::to_string(p.tile->kv_owner) + ")" : "") +
                 " is missing from its rows";
        }
      if (text.empty() && kv) {
        // A partial added at the rows that another rank holds at the same local index (a wrong owner): every failing
        // item there is the golden plus the partial, and pad rows hit by it hold exactly the partial.
        for (size_t index = 0; index < partials.size() && text.empty(); ++index) {
          const Partial& p = partials[index];
          if (p.tile->kv_owner < 0) continue;
          for (int other = 0; other < plan().cp_size && text.empty(); ++other) {
            if (other == p.tile->kv_owner) continue;
            int64_t hits = 0, misses = 0;
            std::vector<uint8_t> target_rows = flags(s.failing.size());
            const std::vector<int64_t>& map = maps[index];
            for (size_t x = 0; x < map.size(); ++x) {
              if (map[x] < 0 || sd.owner[static_cast<size_t>(map[x])] != p.tile->kv_owner) continue;  // the owner's rows
              const int64_t local = sd.local[static_cast<size_t>(map[x])];
              if (local < 0) continue;
              const int64_t target = sd.gather[static_cast<size_t>(other)][static_cast<size_t>(local)];
              const int64_t srow = s.rank < 0 ? target : s.rank == other ? local : -1;
              if (srow < 0) continue;
              const bool valid = sd.valid[static_cast<size_t>(target)];
              for (int h = p.tile->kv_head_begin; h < p.tile->kv_head_end; ++h) {
                const bool bad = valid ? s.item_bad[static_cast<size_t>(srow * s.cand.heads + h)] != 0 : s.pad_nonzero[static_cast<size_t>(srow)] != 0;
                if (!bad) continue;
                bool ok = true;
                for (int64_t d = 0; d < dim && ok; ++d) {
                  const double expect = (valid ? double(s.gold(srow, h, d)) : 0.0) +
                                        value(index, static_cast<int64_t>(x), h - p.tile->kv_head_begin, d);
                  ok = distance(s.cand(srow, h, d), expect) <= tol_of(s, expect);
                }
                (ok ? hits : misses) += 1;
                if (ok) target_rows[static_cast<size_t>(srow)] = 1;
              }
            }
            if (hits > 0 && misses == 0) {
              text = "the step-" + std::to_string(p.step) + " " + std::string(quantity_name(q)) + " partial of rank " +
                     std::to_string(p.rank) + " (KV of rank " + std::to_string(p.tile->kv_owner) + ") is added to rank " +
                     std::to_string(other) + "'s rows: a wrong owner";
              for (size_t r = 0; r < rows.size(); ++r) rows[r] |= target_rows[r];
            }
          }
        }
      }
      const bool named = !text.empty();
      if (!named && pads_only) continue;
      if (!named) text = "the step partials sum to the golden but the accumulated " + std::string(quantity_name(q)) + " differs";
      record(id, text, named, rows);
    }
  }
  for (auto* pair : {&specific_texts, &generic_texts}) {
    Finding& f = pair == &specific_texts ? specific : generic;
    if (f.rows.empty()) continue;
    std::ostringstream e;
    bool first = true;
    for (const auto& [text, names] : *pair) {
      e << (first ? "" : "; ") << names_text(names) << ": " << text;
      first = false;
    }
    e << " (the candidate's own step partials, merged through the Plan, give the golden)";
    f.evidence = e.str();
    f.where = where_of(f.rows);
    add(std::move(f));
  }
}

// Replays the case under every modelled mistake (check/diagnosis/replay.hpp) and keeps those whose simulation every compared
// result matches: the results the check failed and those it passed, as the candidate holds them.
void Diagnoser::test_replay() {
  load_inputs();
  std::vector<ReplaySubject> subjects;
  std::vector<size_t> subject_of;  // replay subject -> index in subjects_ (subjects_.size(): a passing result)
  int q_head = -1;
  for (const TensorResult& r : report_.results) {
    if (r.missing || r.step >= 0) continue;
    const std::optional<TensorView<float>> view = result_view(r);
    if (!view) continue;
    const Quantity q = *parse_quantity(r.tensor);
    ReplaySubject rs;
    rs.name = result_name(r);
    rs.quantity = q;
    rs.rank = r.rank;
    rs.cand = *view;
    rs.golden = golden(q).view;
    rs.limit = r.evaluation.limits.max;
    rs.precision = check_precision(q, fx().spec.dtype);
    size_t index = subjects_.size();
    for (size_t i = 0; i < subjects_.size(); ++i)
      if (subjects_[i].result == &r) index = i;
    if (index < subjects_.size()) {
      const Subject& s = subjects_[index];
      rs.failing = s.failing;
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
    for (const auto& [replay_index, rows] : r.rows)
      if (subject_of[replay_index] < subjects_.size()) f.rows[subject_of[replay_index]] = rows;
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
    for (const auto& [index, rows] : f.rows) results.push_back(subjects_[index].name);
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
    replay_findings_.push_back(std::move(f));
  }
  if (replay_findings_.empty() && !outcome.results.empty()) {
    std::vector<std::string> closest;
    for (size_t i = 0; i < outcome.results.size() && i < 3; ++i) {
      const ReplayResult& r = outcome.results[i];
      closest.push_back(r.mistake + " (" + std::to_string(r.failing_rows_matched) + " of " +
                        std::to_string(r.failing_rows) + " failing rows, worst ratio " + num(r.worst_ratio) + ")");
    }
    replay_closest_ = "no replayed mistake matches (" + std::to_string(outcome.results.size()) +
                      " replayed); closest: " + list_text(closest, 3);
  }
  if (!outcome.not_replayed.empty())
    not_tested_.push_back("replay of " + std::to_string(outcome.not_replayed.size()) +
                          " mistakes past the diagnosis budget (" + list_text(outcome.not_replayed, 3) + ")");
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

  test_digest();
  if (!subjects_.empty()) {
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
    if (!all_explained_so_far()) attempt("softmax scale, mask edge, KV heads by recomputation", &Diagnoser::test_variants);
    if (!report_.foreign_inputs() && in_.replay_budget_seconds > 0) attempt("replay of modelled mistakes", &Diagnoser::test_replay);
    const bool digests_agree = !report_.inputs.empty() && !report_.foreign_inputs();
    if (findings_.empty() && replay_findings_.empty() && !digests_agree)
      attempt("inputs by recomputation", &Diagnoser::test_inputs_by_recomputation);
  }

  // Selection, a greedy cover of the failing rows: the finding that explains the most failing rows not yet explained
  // is kept first (ties: the more specific kind), until no finding adds any; a finding whose rows another one
  // explains as well is left out (one mechanism for those rows, the one that also explains the most others). The
  // kept ones are listed most specific first, one line per kind.
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
  std::vector<Diagnosis> out;
  std::map<DiagnosisKind, std::map<size_t, std::vector<uint8_t>>> rows_of_kind;
  // The replayed mistakes first: a cause, listed before the symptoms the other kinds name (which stay listed).
  for (const Finding& f : replay_findings_) {
    for (const auto& [index, rows] : f.rows) {
      std::vector<uint8_t>& mine = rows_of_kind[f.kind][index];
      if (mine.empty()) mine = flags(rows.size());
      for (size_t r = 0; r < rows.size(); ++r) mine[r] |= rows[r];
    }
    out.push_back({f.kind, f.evidence, f.where});
  }
  for (size_t i = 0; i < findings_.size(); ++i) {
    if (!kept[i]) continue;
    const Finding& f = findings_[i];
    for (const auto& [index, rows] : f.rows) {
      std::vector<uint8_t>& mine = rows_of_kind[f.kind][index];
      if (mine.empty()) mine = flags(rows.size());
      for (size_t r = 0; r < rows.size(); ++r) mine[r] |= rows[r];
    }
    bool joined = false;
    for (Diagnosis& d : out)
      if (d.kind == f.kind) {
        d.evidence += "; " + f.evidence;
        joined = true;
        nlohmann::ordered_json w = where_of(rows_of_kind[f.kind]);  // the union's results, ranks, sequences, rows
        for (auto& [key, value] : w.items()) d.where[key] = value;
      }
    if (!joined) out.push_back({f.kind, f.evidence, f.where});
  }
  if (out.empty()) {
    std::vector<std::string> names;
    int64_t rows = 0;
    for (const Subject& s : subjects_) {
      names.push_back(s.name);
      for (uint8_t x : s.failing) rows += x;
    }
    for (const TensorResult& r : report_.results)
      if (!r.ok() && (r.missing || r.step >= 0))
        names.push_back(result_name(r) +
                        (r.step >= 0 ? "/s" + std::to_string(r.step) + (r.pass == "forward" ? "f" : "b") : "") +
                        (r.missing ? " (missing)" : ""));
    Diagnosis d;
    d.kind = DiagnosisKind::unexplained;
    d.evidence = "none of the tested kinds fits the failures of " + names_text(names) +
                 " (tail rows, chunk order, pad rows, non-finite values, softmax scale, mask edge, head mapping, LSE "
                 "convention, merge, inputs): the first divergence above is where to start";
    if (!replay_closest_.empty()) d.evidence += "; " + replay_closest_;
    if (!not_tested_.empty()) d.evidence += "; not tested: " + list_text(not_tested_, 2);
    d.where["results"] = names;
    d.where["rows"] = rows;
    out.push_back(d);
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
