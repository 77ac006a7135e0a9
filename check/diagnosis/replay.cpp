#include "check/diagnosis/replay.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <set>

#include "sim/program/executor.hpp"
#include "sim/plan/plan.hpp"

namespace cpgold::fx {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool is_kv(Quantity q) { return q == Quantity::dk || q == Quantity::dv; }
bool is_forward(Quantity q) { return q == Quantity::o || q == Quantity::lse; }

// The sub-case the replay runs: the sequences chosen, each preceded by a filler sequence (never compared) that keeps
// its offset's residues modulo 2W on both sides, so that count shortcuts (cu // W, cu // 2W) give it the counts they
// give it in the whole case; attention never crosses sequences, so every mistake of the catalogue acts on a chosen
// sequence as in the whole case.
struct SubCase {
  sim::CaseSpec spec;
  sim::CaseInputs inputs;
  std::vector<int> chosen;                     // sequences of the whole case
  std::vector<int64_t> q_row_of, kv_row_of;    // whole-case global row -> sub-case global row (-1: not replayed)
};

SubCase make_sub_case(const sim::CaseSpec& spec, const ThdLayout& layout, const sim::CaseInputs& in,
                      const std::vector<int>& chosen, int h0, int h1, int k0, int k1) {
  SubCase sub;
  sub.chosen = chosen;
  sub.spec = spec;
  sub.spec.heads_q = h1 - h0;
  sub.spec.heads_kv = k1 - k0;
  sub.spec.seqlens_q.clear(), sub.spec.seqlens_kv.clear(), sub.spec.padded_q.clear(), sub.spec.padded_kv.clear();
  sub.spec.total_tokens_q = sub.spec.total_tokens_kv = -1;
  const int32_t step = 2 * spec.cp_size;
  struct Piece {
    int b;       // -1: filler
    int32_t lq, lkv, pq, pkv;
  };
  std::vector<Piece> pieces;
  int64_t cu_q = 0, cu_kv = 0;  // actual cumulative lengths of the sub-case so far
  for (int b : chosen) {
    const int32_t fq = static_cast<int32_t>(((layout.q.cu_seqlens[b] - cu_q) % step + step) % step);
    const int32_t fkv = static_cast<int32_t>(((layout.kv.cu_seqlens[b] - cu_kv) % step + step) % step);
    if (fq > 0 || fkv > 0) {
      const int32_t pad = std::max(fq, fkv) == 0 ? 0 : step;  // fillers shorter than 2W: one chunk row each
      pieces.push_back({-1, fq, fkv, pad, pad});
      cu_q += fq, cu_kv += fkv;
    }
    pieces.push_back({b, layout.q.length(b), layout.kv.length(b), layout.q.padded_length(b), layout.kv.padded_length(b)});
    cu_q += layout.q.length(b), cu_kv += layout.kv.length(b);
  }
  for (const Piece& p : pieces) {
    sub.spec.seqlens_q.push_back(p.lq);
    sub.spec.seqlens_kv.push_back(p.lkv);
    sub.spec.padded_q.push_back(p.pq);
    sub.spec.padded_kv.push_back(p.pkv);
  }
  const ThdLayout sub_layout = sim::layout(sub.spec);
  sub.q_row_of.assign(static_cast<size_t>(layout.q.total_rows), -1);
  sub.kv_row_of.assign(static_cast<size_t>(layout.kv.total_rows), -1);
  auto rows = [](const Tensor3<float>& x, int64_t n, int h0_, int h1_) { return Tensor3<float>(n, h1_ - h0_, x.dim); };
  sub.inputs.q = rows(in.q, sub_layout.q.total_rows, h0, h1);
  sub.inputs.dout = rows(in.dout, sub_layout.q.total_rows, h0, h1);
  sub.inputs.k = rows(in.k, sub_layout.kv.total_rows, k0, k1);
  sub.inputs.v = rows(in.v, sub_layout.kv.total_rows, k0, k1);
  auto copy_row = [](const Tensor3<float>& from, int64_t from_row, int h0_, Tensor3<float>& to, int64_t to_row) {
    for (int64_t h = 0; h < to.heads; ++h) std::copy_n(from.at(from_row, h0_ + h), to.dim, to.at(to_row, h));
  };
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].b < 0) continue;
    const int b = pieces[i].b, sb = static_cast<int>(i);
    for (int32_t x = 0; x < layout.q.padded_length(b); ++x) {
      const int64_t from = layout.q.offset(b) + x, to = sub_layout.q.offset(sb) + x;
      sub.q_row_of[static_cast<size_t>(from)] = to;
      copy_row(in.q, from, h0, sub.inputs.q, to);
      copy_row(in.dout, from, h0, sub.inputs.dout, to);
    }
    for (int32_t x = 0; x < layout.kv.padded_length(b); ++x) {
      const int64_t from = layout.kv.offset(b) + x, to = sub_layout.kv.offset(sb) + x;
      sub.kv_row_of[static_cast<size_t>(from)] = to;
      copy_row(in.k, from, k0, sub.inputs.k, to);
      copy_row(in.v, from, k0, sub.inputs.v, to);
    }
  }
  return sub;
}

}  // namespace

ReplayOutcome replay_mistakes(const FixtureFile& fixture, const sim::CaseInputs& inputs,
                              const std::vector<ReplaySubject>& subjects, const ReplayOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  ReplayOutcome outcome;
  const sim::CaseSpec& spec = fixture.spec;
  const ThdLayout& layout = fixture.layout;
  const sim::Plan& whole = fixture.plan;
  const int hq = spec.heads_q, hkv = sim::heads_kv(spec), group = std::max(1, hq / std::max(1, hkv));

  // One KV head and its group of query heads (dK, dV gather every query head of the group) where every mistake of
  // the catalogue treats heads alike (p2p, all_gather; a2a splits heads over ranks, so there every head is replayed).
  int h0 = 0, h1 = hq, k0 = 0, k1 = hkv;
  if (whole.comm == sim::CommType::p2p || whole.comm == sim::CommType::all_gather) {
    k0 = std::clamp(options.q_head, 0, hq - 1) / group, k1 = k0 + 1;
    h0 = k0 * group, h1 = h0 + group;
  }
  for (int h = h0; h < h1; ++h) outcome.heads.push_back(h);

  // Per whole-case global row: sequence, padded position, valid token.
  struct RowInfo {
    std::vector<int> sequence;
    std::vector<int32_t> position;
    std::vector<uint8_t> valid;
  };
  auto row_info = [](const PackedSequences& p) {
    RowInfo r;
    r.sequence.assign(static_cast<size_t>(p.total_rows), -1);
    r.position.assign(static_cast<size_t>(p.total_rows), 0);
    r.valid.assign(static_cast<size_t>(p.total_rows), 0);
    for (int b = 0; b < p.batch(); ++b)
      for (int32_t x = 0; x < p.padded_length(b); ++x) {
        const size_t g = static_cast<size_t>(p.offset(b) + x);
        r.sequence[g] = b, r.position[g] = x, r.valid[g] = x < p.length(b);
      }
    return r;
  };
  const RowInfo info_q = row_info(layout.q), info_kv = row_info(layout.kv);
  std::vector<std::vector<int64_t>> right_q, right_kv;  // the correct layout's rows (what the check compared)
  for (int r = 0; r < whole.cp_size; ++r) {
    right_q.push_back(whole.partition.q.gather_indices(r));
    right_kv.push_back(whole.partition.kv.gather_indices(r));
  }

  // The sequences replayed: those with failing rows, fewest (query, key) pairs first, while the pairs stay under a
  // cap (at least one sequence).
  std::set<int> failing_sequences;
  for (const ReplaySubject& s : subjects) {
    const bool kv = is_kv(s.quantity);
    for (size_t row = 0; row < s.failing.size(); ++row) {
      if (!s.failing[row]) continue;
      const int64_t g = s.rank >= 0 ? (kv ? right_kv : right_q)[static_cast<size_t>(s.rank)][row] : static_cast<int64_t>(row);
      const RowInfo& info = kv ? info_kv : info_q;
      if (g >= 0 && g < static_cast<int64_t>(info.sequence.size()) && info.sequence[static_cast<size_t>(g)] >= 0)
        failing_sequences.insert(info.sequence[static_cast<size_t>(g)]);
    }
  }
  std::vector<int> order(failing_sequences.begin(), failing_sequences.end());
  if (order.empty())
    for (int b = 0; b < layout.batch(); ++b) order.push_back(b);
  auto pairs = [&](int b) { return static_cast<double>(layout.q.padded_length(b)) * layout.kv.padded_length(b); };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return pairs(a) < pairs(b); });
  std::vector<int> chosen;
  double total_pairs = 0;
  for (int b : order) {
    if (!chosen.empty() && total_pairs + pairs(b) > options.max_pairs) break;
    chosen.push_back(b);
    total_pairs += pairs(b);
  }
  std::sort(chosen.begin(), chosen.end());
  outcome.sequences = chosen;

  SubCase sub = make_sub_case(spec, layout, inputs, chosen, h0, h1, k0, k1);
  // Non-finite input values (pad_fill nan or inf): the replay runs twice, once with those values 0 and once with
  // other finite values (distinct per element). An element the two runs give alike does not depend on them under the
  // mistake; one they give differently does (the mistake reads a pad value into it): what the candidate holds there
  // is what the implementation makes of a non-finite value (NaN, or a finite value where it drops a NaN partial), and
  // any value is the mistake's. Elsewhere a non-finite candidate element is left out of the comparison: which
  // elements a pad value turns non-finite beyond those depends on an implementation's tiling (0 x NaN inside a block
  // of keys), not on the mistake, and nonfinite_leak names them. A mistake is then confirmed only by a failing row it
  // reproduces with finite values where it reads no pad value.
  bool nonfinite_inputs = false;
  for (const Tensor3<float>* t : {&inputs.q, &inputs.k, &inputs.v, &inputs.dout})
    nonfinite_inputs |= std::any_of(t->values.begin(), t->values.end(), [](float x) { return !std::isfinite(x); });
  sim::CaseInputs other_pads = sub.inputs;
  {
    Tensor3<float>* zeroed[4] = {&sub.inputs.q, &sub.inputs.k, &sub.inputs.v, &sub.inputs.dout};
    Tensor3<float>* other[4] = {&other_pads.q, &other_pads.k, &other_pads.v, &other_pads.dout};
    for (int t = 0; t < 4; ++t)
      for (size_t i = 0; i < zeroed[t]->values.size(); ++i)
        if (!std::isfinite(zeroed[t]->values[i])) {
          zeroed[t]->values[i] = 0.f;
          // in [0.375, 0.625), a different value for each element (no two read pad values cancel)
          const uint32_t hash = static_cast<uint32_t>((i + 1u + 0x3C6EF372u * static_cast<uint32_t>(t)) * 2654435761u);
          other[t]->values[i] = 0.375f + 0.25f * static_cast<float>(hash >> 8) / 16777216.f;
        }
  }
  const sim::Plan plan = sim::make_plan(sub.spec);

  bool any_backward = false;
  for (const ReplaySubject& s : subjects) any_backward |= !is_forward(s.quantity);

  // What one simulator run of the sub-case takes: measured on the runs made (every mistake runs the same sub-case),
  // and before the first, when the sub-case is past max_pairs (one long sequence), timed on a sub-case of one
  // sequence of at most 512 rows and scaled by the (query x key) pairs. A mistake whose run is expected to take
  // longer than what is left of the budget is not started: the budget bounds the replay, not only its start.
  auto padded_pairs = [](const sim::CaseSpec& c) {
    const ThdLayout l = sim::layout(c);
    double p = 0;
    for (int b = 0; b < l.batch(); ++b) p += static_cast<double>(l.q.padded_length(b)) * l.kv.padded_length(b);
    return p;
  };
  double forward_seconds = 0, backward_seconds = 0;  // the last runs measured (0: none yet)
  if (padded_pairs(sub.spec) > options.max_pairs && options.budget_seconds > 0) {
    try {
      sim::CaseSpec small = sub.spec;
      const int32_t rows = static_cast<int32_t>(std::min<int64_t>(512, sim::layout(sub.spec).q.total_rows));
      small.seqlens_q = {rows}, small.seqlens_kv = {rows};
      small.padded_q.clear(), small.padded_kv.clear();
      small.total_tokens_q = small.total_tokens_kv = -1;
      const sim::CaseInputs small_inputs = sim::make_case_inputs(small);
      sim::ExecutorOptions run_options;
      run_options.record_trace = false;
      run_options.backward = false;
      const auto t0 = std::chrono::steady_clock::now();
      (void)sim::run_cp_oracle(sim::make_plan(small), small_inputs, run_options);
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      forward_seconds = t * padded_pairs(sub.spec) / std::max(1.0, padded_pairs(small)) * (nonfinite_inputs ? 2 : 1);
    } catch (const std::exception&) {
      forward_seconds = 0;  // no estimate: the budget bounds the start of each mistake only
    }
  }
  auto seconds_text = [](double s) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.2g s", s);
    return std::string(buffer);
  };

  for (const std::string& name : sim::mistake_catalogue(plan, spec.dtype)) {
    std::optional<sim::Mistake> mistake = sim::make_mistake(plan, name, spec.dtype);
    if (!mistake) continue;  // changes nothing for this case
    if (elapsed() > options.budget_seconds) {
      outcome.not_replayed.push_back(name);
      continue;
    }
    if (forward_seconds > options.budget_seconds - elapsed()) {
      outcome.not_replayed.push_back(name + " (about " + seconds_text(forward_seconds) + ")");
      continue;
    }
    ReplayResult result;
    result.mistake = name;
    result.family = mistake->family;
    result.description = mistake->description;
    for (const sim::TileRef& t : mistake->changed_tiles)
      if (t.pass == sim::PassKind::forward) result.tiles.push_back(t);
    // The rows each rank of the whole case holds under the mistake (a layout mistake's, or the partition's).
    // held_o: the rows a rank's O and LSE hold (the same, or another order for an output reorder).
    std::vector<std::vector<int64_t>> held_q = right_q, held_kv = right_kv, held_o = right_q;
    if (!mistake->variation.q_rows.empty() || !mistake->output_q_rows.empty()) {
      std::optional<sim::Mistake> whole_mistake = sim::make_mistake(whole, name, spec.dtype);
      if (!whole_mistake) continue;
      if (!mistake->variation.q_rows.empty()) {
        if (whole_mistake->variation.q_rows.empty()) continue;
        held_q = held_o = whole_mistake->variation.q_rows;
        held_kv = whole_mistake->variation.kv_rows;
      }
      if (!mistake->output_q_rows.empty()) {
        if (whole_mistake->output_q_rows.empty()) continue;
        held_o = whole_mistake->output_q_rows;
      }
    }
    // A global O or LSE row under an output reorder holds the row its rank's reorder put in its place.
    std::vector<int64_t> o_source;
    if (!mistake->output_q_rows.empty()) {
      o_source.resize(info_q.sequence.size());
      for (size_t g = 0; g < o_source.size(); ++g) o_source[g] = static_cast<int64_t>(g);
      for (int r = 0; r < whole.cp_size; ++r)
        for (size_t x = 0; x < right_q[static_cast<size_t>(r)].size(); ++x) {
          const int64_t g = right_q[static_cast<size_t>(r)][x];
          if (g >= 0 && g < static_cast<int64_t>(o_source.size())) o_source[static_cast<size_t>(g)] = held_o[static_cast<size_t>(r)][x];
        }
    }
    // The whole-case row a candidate row holds under the mistake.
    auto source_row = [&](const ReplaySubject& s, const std::vector<int64_t>* held, size_t row) -> int64_t {
      if (held) return (*held)[row];
      if (!o_source.empty() && is_forward(s.quantity) && row < o_source.size()) return o_source[row];
      return static_cast<int64_t>(row);
    };
    std::vector<int> owner_q(info_q.sequence.size(), -1), owner_kv(info_kv.sequence.size(), -1);
    for (int r = 0; r < whole.cp_size; ++r) {
      for (int64_t g : held_o[static_cast<size_t>(r)])
        if (g >= 0 && g < static_cast<int64_t>(owner_q.size())) owner_q[static_cast<size_t>(g)] = r;
      for (int64_t g : held_kv[static_cast<size_t>(r)])
        if (g >= 0 && g < static_cast<int64_t>(owner_kv.size())) owner_kv[static_cast<size_t>(g)] = r;
    }
    std::set<int> ranks;
    double worst = 0;

    // The mistake's simulation of the chosen sequences, gathered to the sub-case's global rows: a candidate row
    // holding whole-case global row G (per rank: the row the mistake puts there) is compared with sub row of G.
    // other: the run with other finite values where the inputs are non-finite (nullptr: the inputs are finite).
    auto compare = [&](const sim::CpRun<double>& run, const sim::CpRun<double>* other, bool forward) {
      const sim::GlobalOutputs<double> global = sim::gather_outputs(plan, run.ranks, mistake->variation);
      sim::GlobalOutputs<double> global_other;
      if (other) global_other = sim::gather_outputs(plan, other->ranks, mistake->variation);
      for (size_t i = 0; i < subjects.size(); ++i) {
        const ReplaySubject& s = subjects[i];
        if (is_forward(s.quantity) != forward) continue;
        const bool kv = is_kv(s.quantity), lse = s.quantity == Quantity::lse;
        auto pick = [&](const sim::GlobalOutputs<double>& g) {
          switch (s.quantity) {
            case Quantity::o: return view_of(g.o);
            case Quantity::lse: return view_of(g.lse);
            case Quantity::dq: return view_of(g.dq);
            case Quantity::dk: return view_of(g.dk);
            case Quantity::dv: return view_of(g.dv);
          }
          return view_of(g.o);
        };
        const TensorView<double> sim = pick(global);
        TensorView<double> sim_other;
        if (other) sim_other = pick(global_other);
        const RowInfo& info = kv ? info_kv : info_q;
        const std::vector<int64_t>& sub_row = kv ? sub.kv_row_of : sub.q_row_of;
        const std::vector<int>& owner = kv ? owner_kv : owner_q;
        const std::vector<int64_t>* held =
            s.rank >= 0 ? &(kv ? held_kv : is_forward(s.quantity) ? held_o : held_q)[static_cast<size_t>(s.rank)] : nullptr;
        const std::vector<int64_t>* expected = s.rank >= 0 ? &(kv ? right_kv : right_q)[static_cast<size_t>(s.rank)] : nullptr;
        const int c0 = kv ? k0 : h0, c1 = kv ? k1 : h1;
        std::vector<uint8_t> matched(static_cast<size_t>(s.cand.rows), 0), closer(static_cast<size_t>(s.cand.rows), 0),
            finite(static_cast<size_t>(s.cand.rows), 0);
        for (int64_t row = 0; row < s.cand.rows; ++row) {
          const int64_t g = source_row(s, held, static_cast<size_t>(row));
          if (g < 0 || g >= static_cast<int64_t>(sub_row.size())) continue;
          const int64_t sg = sub_row[static_cast<size_t>(g)];
          if (sg < 0) continue;  // a sequence not replayed, or a tail row
          const int64_t ge = expected ? (*expected)[static_cast<size_t>(row)] : row;
          // Pad rows as the check sees them: the row it compared (a rank holding other rows under a layout mistake
          // still has its LSE of a row it believes valid compared).
          const int64_t checked = ge >= 0 && ge < static_cast<int64_t>(info.valid.size()) ? ge : g;
          const bool is_valid = info.valid[static_cast<size_t>(checked)];
          if (!is_valid && (lse || options.pad_rows == PadRows::unwritten)) continue;
          bool ok = true, moved = false, half_moved = false;  // moved: the mistake's value is not the golden's
          double to_sim = 0, to_golden = 0;                   // the row's largest distances of the candidate
          bool finite_moved = false;  // an element where candidate and simulation are finite and the mistake moved it
          int64_t compared = 0;
          for (int h = c0; h < c1; ++h)
            for (int64_t x = 0; x < s.cand.dim; ++x) {
              double c = s.cand(row, h, x);
              const double p = sim(sg, h - c0, x);
              if (lse && options.empty_row_lse == EmptyRowLse::pos_inf && c == kInf && p == -kInf) c = -kInf;
              // A valid row no call of the mistake reads: an unwritten LSE (0 of a zeroed buffer, or an infinity).
              if (lse && p == -kInf && (c == 0 || std::isinf(c))) c = -kInf;
              // Where the inputs hold non-finite values: an element the mistake makes depend on them (the two runs
              // differ) holds whatever the implementation makes of a non-finite value (NaN, an infinity, or a finite
              // value where it drops a NaN partial from its merge): any candidate value is the mistake's there. Any
              // other non-finite candidate element is left out (above).
              const bool c_bad = std::isnan(c) || (std::isinf(c) && !(lse && c == -kInf));
              bool reads_pads = false;
              if (other) {
                const double po = sim_other(sg, h - c0, x);
                reads_pads = !(p == po) && !(std::isnan(p) && std::isnan(po));
              }
              if (nonfinite_inputs && c_bad && !reads_pads) continue;
              double d;
              if (reads_pads) d = 0;
              else if (std::isnan(c) && std::isnan(p)) d = 0;
              else if (std::isfinite(c) && std::isfinite(p)) d = std::fabs(c - p);
              else d = c == p ? 0 : kInf;
              const double floor = floor_ulps(s.precision) * ulp_in(s.precision, 0.3 + (std::isfinite(p) ? std::fabs(p) : 0));
              const double tol = 1.25 * std::max(s.limit, floor);
              const double ratio = d / tol;
              ++result.elements;
              ++compared;
              if (ratio > 1) ok = false;
              else ++result.elements_within;
              worst = std::max(worst, ratio);
              if (reads_pads) {
                // the golden never reads a pad value: the mistake moved the element
                moved = half_moved = true;
                to_golden = kInf;
                continue;
              }
              if (ge >= 0 && ge < s.golden.rows) {
                const double o = s.golden(ge, h, x);
                const double dg = std::isfinite(o) && std::isfinite(p) ? std::fabs(o - p) : (o == p ? 0 : kInf);
                moved |= dg > tol;
                const double explain = s.explain_limit > 0 ? s.explain_limit : s.limit;
                half_moved |= dg > 0.5 * explain;
                finite_moved |= std::isfinite(c) && std::isfinite(p) && std::isfinite(o) && dg > 0.5 * explain;
                const double co = std::isfinite(o) && std::isfinite(c) ? std::fabs(o - c) : (o == c ? 0 : kInf);
                to_golden = std::max(to_golden, co);
                to_sim = std::max(to_sim, d);
              }
            }
          // A row whose every element was left out (non-finite in the candidate) is no evidence for the mistake. The
          // mistake explains the row where its simulation is not the golden: moved past the tolerance, or (a row the
          // check failed by little) moved by half the limit with the candidate nearer the simulation than the golden.
          matched[static_cast<size_t>(row)] = ok && compared > 0 && (moved || (half_moved && to_sim < to_golden));
          closer[static_cast<size_t>(row)] = compared > 0 && half_moved && to_sim < to_golden;
          finite[static_cast<size_t>(row)] = finite_moved;
        }
        if (s.failing.empty()) continue;
        std::vector<uint8_t>& explained = result.rows[i];
        explained.assign(s.failing.size(), 0);
        for (size_t row = 0; row < s.failing.size(); ++row) {
          if (!s.failing[row]) continue;
          const int64_t g = source_row(s, held, row);
          if (g < 0 || g >= static_cast<int64_t>(sub_row.size()) || sub_row[static_cast<size_t>(g)] < 0) continue;
          result.failing_rows_closer += closer[row];
          if (!matched[row]) continue;
          explained[row] = 1;
          ++result.failing_rows_matched;
          result.failing_rows_finite += finite[row];
          if (s.rank >= 0) ranks.insert(s.rank);
          else if (g >= 0 && g < static_cast<int64_t>(owner.size()) && owner[static_cast<size_t>(g)] >= 0)
            ranks.insert(owner[static_cast<size_t>(g)]);
        }
      }
    };

    // The failing rows of the sequences replayed, every result's (those of a pass the replay does not reach count too).
    for (const ReplaySubject& s : subjects) {
      const bool kv = is_kv(s.quantity);
      const std::vector<int64_t>& sub_row = kv ? sub.kv_row_of : sub.q_row_of;
      const std::vector<int64_t>* held =
          s.rank >= 0 ? &(kv ? held_kv : is_forward(s.quantity) ? held_o : held_q)[static_cast<size_t>(s.rank)] : nullptr;
      for (size_t row = 0; row < s.failing.size(); ++row) {
        if (!s.failing[row]) continue;
        const int64_t g = source_row(s, held, row);
        if (g >= 0 && g < static_cast<int64_t>(sub_row.size()) && sub_row[static_cast<size_t>(g)] >= 0) ++result.failing_rows;
      }
    }
    // Every run ends by the budget's deadline (checked before each tile's call): a mistake whose run passes it is
    // named as not replayed, with the time it had run, never left out silently.
    sim::ExecutorOptions run_options;
    run_options.record_trace = false;
    run_options.backward = false;
    run_options.deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(options.budget_seconds));
    const auto run_started = std::chrono::steady_clock::now();
    auto run = [&](bool backward) {
      run_options.backward = backward;
      ++outcome.runs;
      const auto t0 = std::chrono::steady_clock::now();
      const sim::CpRun<double> zeroed = sim::run_mistake(*mistake, sub.inputs, run_options);
      if (nonfinite_inputs) {
        ++outcome.runs;
        const sim::CpRun<double> other = sim::run_mistake(*mistake, other_pads, run_options);
        compare(zeroed, &other, !backward);
      } else {
        compare(zeroed, nullptr, !backward);
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    try {
      forward_seconds = run(false);
      // A backward costs about two forwards more (dQ, dK and dV) until one is measured.
      const double backward_estimate = backward_seconds > 0 ? backward_seconds : 3 * forward_seconds;
      if (any_backward && worst <= 1 && elapsed() + backward_estimate > options.budget_seconds) {
        // The forward matches and the budget leaves no time for the backward: not replayed, not a mismatch.
        outcome.not_replayed.push_back(name + " (its backward, about " + seconds_text(backward_estimate) + ")");
        continue;
      }
      if (any_backward && worst <= 1) {
        result.backward_run = true;
        backward_seconds = run(true);
      }
    } catch (const sim::RunStopped&) {
      const double ran = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_started).count();
      outcome.not_replayed.push_back(name + " (stopped at the budget after " + seconds_text(ran) + ")");
      continue;
    } catch (const std::exception&) {
      continue;  // a mistake the simulator cannot run for this case (a call its checks refuse): not a candidate
    }
    result.worst_ratio = worst;
    result.ranks.assign(ranks.begin(), ranks.end());
    // With non-finite pads, the candidate's non-finite rows are no evidence: the mistake is confirmed by a failing
    // row it reproduces with finite values.
    result.matches = worst <= 1 && result.failing_rows_matched > 0 && (!any_backward || result.backward_run) &&
                     (!nonfinite_inputs || result.failing_rows_finite > 0);
    outcome.results.push_back(std::move(result));
  }
  std::stable_sort(outcome.results.begin(), outcome.results.end(), [](const ReplayResult& a, const ReplayResult& b) {
    if (a.matches != b.matches) return a.matches;
    const double fa = a.failing_rows ? double(a.failing_rows_matched) / a.failing_rows : 0;
    const double fb = b.failing_rows ? double(b.failing_rows_matched) / b.failing_rows : 0;
    if (fa != fb) return fa > fb;
    if (a.failing_rows_closer != b.failing_rows_closer) return a.failing_rows_closer > b.failing_rows_closer;
    const double ea = a.elements ? double(a.elements_within) / a.elements : 0;
    const double eb = b.elements ? double(b.elements_within) / b.elements : 0;
    if (ea != eb) return ea > eb;
    return a.worst_ratio < b.worst_ratio;
  });
  outcome.seconds = elapsed();
  return outcome;
}

}  // namespace cpgold::fx
