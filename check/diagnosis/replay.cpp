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
  // Non-finite pad values (pad_fill nan or inf): which valid rows a pad value read as a token turns non-finite depends
  // on a kernel's tiling (0 x NaN inside a block of keys), not on the mistake. The replay runs on inputs with those
  // values 0 and leaves the candidate's non-finite elements out of the comparison (nonfinite_leak names them).
  bool nonfinite_inputs = false;
  for (const Tensor3<float>* t : {&inputs.q, &inputs.k, &inputs.v, &inputs.dout})
    nonfinite_inputs |= std::any_of(t->values.begin(), t->values.end(), [](float x) { return !std::isfinite(x); });
  for (Tensor3<float>* t : {&sub.inputs.q, &sub.inputs.k, &sub.inputs.v, &sub.inputs.dout})
    for (float& x : t->values)
      if (!std::isfinite(x)) x = 0.f;
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
      forward_seconds = t * padded_pairs(sub.spec) / std::max(1.0, padded_pairs(small));
    } catch (const std::exception&) {
      forward_seconds = 0;  // no estimate: the budget bounds the start of each mistake only
    }
  }
  auto seconds_text = [](double s) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.2g s", s);
    return std::string(buffer);
  };

  for (const std::string& name : sim::mistake_catalogue(plan)) {
    std::optional<sim::Mistake> mistake = sim::make_mistake(plan, name);
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
    std::vector<std::vector<int64_t>> held_q = right_q, held_kv = right_kv;
    if (!mistake->variation.q_rows.empty()) {
      std::optional<sim::Mistake> whole_mistake = sim::make_mistake(whole, name);
      if (!whole_mistake || whole_mistake->variation.q_rows.empty()) continue;
      held_q = whole_mistake->variation.q_rows;
      held_kv = whole_mistake->variation.kv_rows;
    }
    std::vector<int> owner_q(info_q.sequence.size(), -1), owner_kv(info_kv.sequence.size(), -1);
    for (int r = 0; r < whole.cp_size; ++r) {
      for (int64_t g : held_q[static_cast<size_t>(r)])
        if (g >= 0 && g < static_cast<int64_t>(owner_q.size())) owner_q[static_cast<size_t>(g)] = r;
      for (int64_t g : held_kv[static_cast<size_t>(r)])
        if (g >= 0 && g < static_cast<int64_t>(owner_kv.size())) owner_kv[static_cast<size_t>(g)] = r;
    }
    std::set<int> ranks;
    double worst = 0;

    // The mistake's simulation of the chosen sequences, gathered to the sub-case's global rows: a candidate row
    // holding whole-case global row G (per rank: the row the mistake puts there) is compared with sub row of G.
    auto compare = [&](const sim::CpRun<double>& run, bool forward) {
      const sim::GlobalOutputs<double> global = sim::gather_outputs(plan, run.ranks, mistake->variation);
      for (size_t i = 0; i < subjects.size(); ++i) {
        const ReplaySubject& s = subjects[i];
        if (is_forward(s.quantity) != forward) continue;
        const bool kv = is_kv(s.quantity), lse = s.quantity == Quantity::lse;
        // A gradient that holds non-finite values where the inputs do: how NaN spreads through the backward's sums
        // (dV over queries, dQ over keys) depends on how an implementation masks, so it is no evidence either way.
        if (nonfinite_inputs && !forward &&
            std::any_of(s.cand.data, s.cand.data + s.cand.size(), [](float v) { return !std::isfinite(v); }))
          continue;
        TensorView<double> sim;
        switch (s.quantity) {
          case Quantity::o: sim = view_of(global.o); break;
          case Quantity::lse: sim = view_of(global.lse); break;
          case Quantity::dq: sim = view_of(global.dq); break;
          case Quantity::dk: sim = view_of(global.dk); break;
          case Quantity::dv: sim = view_of(global.dv); break;
        }
        const RowInfo& info = kv ? info_kv : info_q;
        const std::vector<int64_t>& sub_row = kv ? sub.kv_row_of : sub.q_row_of;
        const std::vector<int>& owner = kv ? owner_kv : owner_q;
        const std::vector<int64_t>* held = s.rank >= 0 ? &(kv ? held_kv : held_q)[static_cast<size_t>(s.rank)] : nullptr;
        const std::vector<int64_t>* expected = s.rank >= 0 ? &(kv ? right_kv : right_q)[static_cast<size_t>(s.rank)] : nullptr;
        const int c0 = kv ? k0 : h0, c1 = kv ? k1 : h1;
        std::vector<uint8_t> matched(static_cast<size_t>(s.cand.rows), 0);
        for (int64_t row = 0; row < s.cand.rows; ++row) {
          const int64_t g = held ? (*held)[static_cast<size_t>(row)] : row;
          if (g < 0 || g >= static_cast<int64_t>(sub_row.size())) continue;
          const int64_t sg = sub_row[static_cast<size_t>(g)];
          if (sg < 0) continue;  // a sequence not replayed, or a tail row
          const bool is_valid = info.valid[static_cast<size_t>(g)];
          if (!is_valid && (lse || options.pad_rows == PadRows::unwritten)) continue;
          const int64_t ge = expected ? (*expected)[static_cast<size_t>(row)] : row;
          bool ok = true, moved = false;  // moved: the mistake's value is not the golden's (it explains the row)
          int64_t compared = 0;
          for (int h = c0; h < c1; ++h)
            for (int64_t x = 0; x < s.cand.dim; ++x) {
              double c = s.cand(row, h, x);
              const double p = sim(sg, h - c0, x);
              if (lse && options.empty_row_lse == EmptyRowLse::pos_inf && c == kInf && p == -kInf) c = -kInf;
              // A valid row no call of the mistake reads: an unwritten LSE (0 of a zeroed buffer, or an infinity).
              if (lse && p == -kInf && (c == 0 || std::isinf(c))) c = -kInf;
              if (nonfinite_inputs && !std::isfinite(c) && !(lse && std::isinf(c))) continue;
              double d;
              if (std::isnan(c) && std::isnan(p)) d = 0;
              else if (std::isfinite(c) && std::isfinite(p)) d = std::fabs(c - p);
              else d = c == p ? 0 : kInf;
              const double floor = floor_ulps(s.precision) * ulp_in(s.precision, 0.3 + (std::isfinite(p) ? std::fabs(p) : 0));
              const double tol = 1.25 * std::max(s.limit, floor);
              const double ratio = d / tol;
              ++result.elements;
              ++compared;
              if (ratio > 1) ok = false;
              worst = std::max(worst, ratio);
              if (!moved && ge >= 0 && ge < s.golden.rows) {
                const double o = s.golden(ge, h, x);
                const double dg = std::isfinite(o) && std::isfinite(p) ? std::fabs(o - p) : (o == p ? 0 : kInf);
                moved = dg > tol;
              }
            }
          // A row whose every element was left out (non-finite in the candidate) is no evidence for the mistake.
          matched[static_cast<size_t>(row)] = ok && compared > 0 && moved;
        }
        if (s.failing.empty()) continue;
        std::vector<uint8_t>& explained = result.rows[i];
        explained.assign(s.failing.size(), 0);
        for (size_t row = 0; row < s.failing.size(); ++row) {
          if (!s.failing[row]) continue;
          const int64_t g = held ? (*held)[row] : static_cast<int64_t>(row);
          if (g < 0 || g >= static_cast<int64_t>(sub_row.size()) || sub_row[static_cast<size_t>(g)] < 0) continue;
          ++result.failing_rows;  // of the sequences replayed
          if (!matched[row]) continue;
          explained[row] = 1;
          ++result.failing_rows_matched;
          if (s.rank >= 0) ranks.insert(s.rank);
          else if (g >= 0 && g < static_cast<int64_t>(owner.size()) && owner[static_cast<size_t>(g)] >= 0)
            ranks.insert(owner[static_cast<size_t>(g)]);
        }
      }
    };

    try {
      sim::ExecutorOptions run_options;
      run_options.variation = &mistake->variation;
      run_options.record_trace = false;
      run_options.backward = false;
      ++outcome.runs;
      auto t0 = std::chrono::steady_clock::now();
      compare(sim::run_cp_oracle(mistake->plan, sub.inputs, run_options), true);
      forward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // A backward costs about two forwards more (dQ, dK and dV) until one is measured.
      const double backward_estimate = backward_seconds > 0 ? backward_seconds : 3 * forward_seconds;
      if (any_backward && worst <= 1 && elapsed() + backward_estimate > options.budget_seconds) {
        // The forward matches and the budget leaves no time for the backward: not replayed, not a mismatch.
        outcome.not_replayed.push_back(name + " (its backward, about " + seconds_text(backward_estimate) + ")");
        continue;
      }
      if (any_backward && worst <= 1) {
        run_options.backward = true;
        ++outcome.runs;
        result.backward_run = true;
        t0 = std::chrono::steady_clock::now();
        compare(sim::run_cp_oracle(mistake->plan, sub.inputs, run_options), false);
        backward_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    } catch (const std::exception&) {
      continue;  // a mistake the simulator cannot run for this case (a call its checks refuse): not a candidate
    }
    result.worst_ratio = worst;
    result.ranks.assign(ranks.begin(), ranks.end());
    result.matches = worst <= 1 && result.failing_rows_matched > 0 && (!any_backward || result.backward_run);
    outcome.results.push_back(std::move(result));
  }
  std::stable_sort(outcome.results.begin(), outcome.results.end(), [](const ReplayResult& a, const ReplayResult& b) {
    if (a.matches != b.matches) return a.matches;
    const double fa = a.failing_rows ? double(a.failing_rows_matched) / a.failing_rows : 0;
    const double fb = b.failing_rows ? double(b.failing_rows_matched) / b.failing_rows : 0;
    if (fa != fb) return fa > fb;
    return a.worst_ratio < b.worst_ratio;
  });
  outcome.seconds = elapsed();
  return outcome;
}

}  // namespace cpgold::fx
