#pragma once
// The diagnosis's working state, shared by the files of check/diagnosis/: the failing results as subjects with their
// rows mapped to global rows and classified, the findings before selection, and the recomputation of attention under
// a hypothesis (perturbed_attention.cpp). One file per kind of bug holds its test. Internal to the check library:
// docs/diagnosis.md describes the tests.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "check/report.hpp"
#include "check/diagnosis/diagnose.hpp"
#include "sim/plan/partition.hpp"

namespace cpgold::fx::diagnosis_detail {


inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kLog2e = 1.4426950408889634;
inline constexpr double kLn2 = 0.6931471805599453;

inline std::string num(double x) {
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "%.4g", x);
  return buffer;
}

template <class T>
inline std::string list_text(const std::vector<T>& xs, size_t max_items = 8) {
  std::ostringstream out;
  for (size_t i = 0; i < xs.size() && i < max_items; ++i) out << (i ? ", " : "") << xs[i];
  if (xs.size() > max_items) out << ", ... (" << xs.size() << " in all)";
  return out.str();
}

inline std::string names_text(const std::vector<std::string>& names) { return list_text(names, 6); }

// A finding's evidence from its texts (text -> the names of the subjects it describes): clause(text, names) for each,
// in the texts' order, joined by "; ".
template <class Clause>
std::string clauses_text(const std::map<std::string, std::vector<std::string>>& texts, Clause clause) {
  std::string out;
  bool first = true;
  for (const auto& [text, names] : texts) {
    out += (first ? "" : "; ") + clause(text, names);
    first = false;
  }
  return out;
}

// |c - v| where equal infinities are 0 apart and any other non-finite value is infinitely far.
inline double distance(double c, double v) {
  if (std::isfinite(c) && std::isfinite(v)) return std::fabs(c - v);
  if (c == v) return 0;  // the same infinity
  return kInf;
}

// One side (q or kv) of the global layout, per global row.
struct Side {
  const PackedSequences* seqs = nullptr;
  const sim::SidePartition* part = nullptr;
  std::vector<int> sequence;      // -1: tail row past the last sequence
  std::vector<int32_t> position;  // row within the sequence's padded range
  std::vector<uint8_t> valid;
  std::vector<std::vector<int64_t>> gather;  // [W][local row] -> global row
  std::vector<int> owner;                    // per global row: the rank that holds it
  std::vector<int64_t> local;                // its local row there

  void build(const PackedSequences& s, const sim::SidePartition& p) {
    seqs = &s;
    part = &p;
    const size_t rows = static_cast<size_t>(s.total_rows);
    sequence.assign(rows, -1);
    position.assign(rows, 0);
    valid.assign(rows, 0);
    for (int b = 0; b < s.batch(); ++b)
      for (int32_t x = 0; x < s.padded_length(b); ++x) {
        const size_t row = static_cast<size_t>(s.offset(b) + x);
        sequence[row] = b;
        position[row] = x;
        valid[row] = x < s.length(b);
      }
    owner.assign(rows, -1);
    local.assign(rows, -1);
    gather.clear();
    for (int r = 0; r < p.cp_size(); ++r) {
      gather.push_back(p.gather_indices(r));
      for (size_t x = 0; x < gather.back().size(); ++x) {
        const int64_t g = gather.back()[x];
        if (g >= 0 && g < s.total_rows) owner[static_cast<size_t>(g)] = r, local[static_cast<size_t>(g)] = static_cast<int64_t>(x);
      }
    }
  }
};

// A global golden tensor (float32 of the oracle).
struct GoldenTensor {
  std::vector<float> values;
  TensorView<float> view;
};

// A failing result's tensor with its rows mapped to global rows.
struct Subject {
  const TensorResult* result = nullptr;
  std::string name;  // "o@r1"
  Quantity quantity = Quantity::o;
  int rank = -1;
  bool kv = false;
  bool lse = false;
  TensorView<float> cand;
  const GoldenTensor* golden = nullptr;
  std::vector<int64_t> global;  // per row
  double limit = 0, mean_limit = 0;
  DType precision = DType::fp32;
  // Classification.
  std::vector<uint8_t> item_bad;     // [row * heads + head]: valid row, an element past the limit (or a wrong -inf)
  std::vector<uint8_t> row_bad;      // any head bad
  std::vector<uint8_t> pad_nonzero;  // pad/tail row with a finite non-zero element (not LSE)
  std::vector<uint8_t> nonfinite;    // row with NaN/Inf (LSE: NaN, or +inf where the oracle is finite)
  std::vector<uint8_t> failing;      // row_bad | pad_nonzero | nonfinite: what a finding has to explain
  std::vector<uint8_t> explained;    // set by the findings kept
  int64_t bad_items = 0;
  bool passing = false;              // a result the check passed: evidence against a hypothesis, never to explain
  bool mean_only = false;            // nothing past the max limit: the items with the largest errors stand in
  float gold(int64_t row, int64_t head, int64_t x) const { return golden->view(global[static_cast<size_t>(row)], head, x); }
};

// A supported hypothesis before selection.
struct Finding {
  DiagnosisKind kind = DiagnosisKind::unexplained;
  std::string evidence;
  nlohmann::ordered_json where;
  std::map<size_t, std::vector<uint8_t>> rows;  // subject index -> rows it explains
  bool always = false;                          // kept whatever the rows (the digest)
  bool replayed = false;                        // a replayed mistake's (a cause the simulation confirmed)
  int priority = -1;                            // specificity rank when not the kind's own (a generic merge finding)
};

// Rows of a per-row flag vector.
inline std::vector<uint8_t> flags(size_t n) { return std::vector<uint8_t>(n, 0); }

// Errors of a set of compared elements.
struct Stats {
  double max = 0, sum = 0;
  int64_t n = 0;
  void add(double e) {
    max = std::max(max, e);
    sum += std::isfinite(e) ? e : 0;
    if (!std::isfinite(e)) max = kInf;
    ++n;
  }
  double mean() const { return n ? sum / static_cast<double>(n) : 0; }
};

// The alternative attention a hypothesis predicts: scale, mask, KV head of every query head, LSE form.
struct Variant {
  std::string label;
  double scale = 0;
  Window window;
  bool top_left = false;
  int right_shift = 0, left_shift = 0;
  bool drop_right = false, drop_left = false, pad_keys = false;
  std::vector<int> kv_head_of;  // per query head
  bool lse_mixed_domain = false;  // LSE = log2(e) * m + ln(l), m the natural-domain row max
};

// One sampled (row, head) of a subject.
struct Item {
  size_t subject = 0;
  int64_t row = 0, head = 0;
  bool bad = false;
};

// Forward/backward values of one query row under a variant.
struct QueryRow {
  std::vector<double> o, dq;
  double lse = -kInf, max_score = -kInf;
};

class Diagnoser {
 public:
  Diagnoser(const DiagnosisInput& input, const CheckReport& report) : in_(input), report_(report) {}
  std::vector<Diagnosis> run();

 private:
  const DiagnosisInput& in_;
  const CheckReport& report_;
  const FixtureFile& fx() const { return *in_.fixture; }
  const sim::Plan& plan() const { return fx().plan; }
  Side q_, kv_;
  std::map<Quantity, GoldenTensor> golden_;
  std::vector<Subject> subjects_;
  std::vector<Finding> findings_;
  std::vector<std::string> not_tested_;  // hypotheses skipped because an input could not be read
  bool inputs_loaded_ = false;
  Tensor3<float> iq_, ik_, iv_, idout_;
  int hq_ = 0, hkv_ = 0, group_ = 1, dqk_ = 0, dv_ = 0;
  double scale_ = 0;
  Window window_;

  const Side& side(bool kv) const { return kv ? kv_ : q_; }
  const GoldenTensor& golden(Quantity q);
  const DiagnosisCandidate* candidate(int rank, int step, int pass, Quantity q) const;
  // A global or per-rank result's name ("o@r1") and the candidate's values for it (nullopt: none in the candidate).
  static std::string result_name(const TensorResult& r);
  std::optional<TensorView<float>> result_view(const TensorResult& r) const;
  // The results a diagnosis compares, in the report's order: the global and per-rank ones (no step partials) the
  // candidate holds values of.
  struct HeldResult {
    const TensorResult* result;
    Quantity quantity;
    TensorView<float> view;
  };
  std::vector<HeldResult> held_results() const;
  void load_inputs();
  void build_subjects();
  void classify(Subject& s);
  std::vector<size_t> subjects_of(std::initializer_list<Quantity> qs) const;
  double tol_of(const Subject& s, double magnitude) const;

  // Hypotheses.
  void test_digest();
  void test_nonfinite_and_pad();
  void test_tail_rows();
  void test_chunk_order();
  void test_output_heads();
  void test_variants();
  void test_gradient_factor();
  void test_lse_forms();
  void test_merge();
  void test_replay();
  std::vector<Finding> replay_findings_;  // matched mistakes, listed first (cause first)
  std::string replay_closest_;            // when none matched: the closest ones, for an unexplained line
  nlohmann::ordered_json replay_closest_json_ = nlohmann::ordered_json::array();
  // What the findings say when they do not account for every failing row: one unexplained line with the symptoms,
  // the partial fits and the closest replayed mistakes.
  Diagnosis unexplained_line(const std::vector<const Finding*>& partial, int64_t failing, int64_t explained,
                             const std::string& headline = {}) const;
  // A symptom the unexplained line names: every failing row is a dK or dV row of a key that some backward step holds
  // with none of its sequence's queries (empty when that is not so).
  std::string queryless_keys(nlohmann::ordered_json& where) const;

  // Recomputation.
  std::vector<Item> sample(const std::vector<size_t>& subject_ids, int bad_per_subject, int good_per_subject,
                           bool per_head = false) const;
  bool visible(const Variant& v, int b, int64_t i, int64_t j) const;
  QueryRow query_row(const Variant& v, int64_t global_row, int64_t head, bool with_dq) const;
  // dK and dV of sampled key rows under a variant: (global kv row, kv head) -> {dk, dv}. Needs every query row of the
  // key's sequence; sequences are taken shortest first while the work stays under a cap, items past it left out.
  std::map<std::pair<int64_t, int64_t>, std::pair<std::vector<double>, std::vector<double>>> key_rows(
      const Variant& v, const std::vector<Item>& items) const;
  struct Verdict {
    bool match = false;         // every sampled item matches and at least one failing item is explained
    bool contradicted = false;  // a sampled item far off the variant, or more than 1 in 8 off by a few tolerances
    int64_t far = 0, near = 0;  // sampled items off the variant by more than 4 tolerances, by 1 to 4
    int64_t explained = 0;      // failing items where the variant differs from the golden and matches the candidate
    int64_t items = 0;          // sampled items of the result
  };
  std::map<size_t, Verdict> judge(const Variant& v, const std::vector<Item>& items) const;
  Variant base_variant() const;
  std::vector<std::pair<std::string, double>> scale_alternatives() const;
  std::vector<Variant> mask_alternatives() const;

  bool all_explained_so_far() const;
  void add(Finding f) { findings_.push_back(std::move(f)); }
  // Adds `f` with `evidence` and the places of its rows.
  void add(Finding f, std::string evidence) {
    f.evidence = std::move(evidence);
    f.where = where_of(f.rows);
    add(std::move(f));
  }
  nlohmann::ordered_json where_of(const std::map<size_t, std::vector<uint8_t>>& rows) const;
};

// A candidate tensor seen as [rows, heads, dim] (LSE [rows, heads, 1]) in the golden's dims.
TensorView<float> candidate_view(const DiagnosisCandidate& c, const std::vector<int64_t>& golden_dims, Quantity q);

}  // namespace cpgold::fx::diagnosis_detail
