#include "check/shrink.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "check/report.hpp"
#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"
#include "reference/splitmix64.hpp"

namespace cpgold::fx {

constexpr std::pair<ShrinkStatus, std::string_view> kShrinkStatusNames[] = {
    {ShrinkStatus::fails, "fails"}, {ShrinkStatus::passes, "passes"}, {ShrinkStatus::no_candidate, "no candidate"}};

std::string_view shrink_status_name(ShrinkStatus status) { return name_in(kShrinkStatusNames, status); }

int64_t case_rows_q(const sim::CaseSpec& spec) { return sim::layout(spec).q.total_rows; }
int64_t case_rows_kv(const sim::CaseSpec& spec) { return sim::layout(spec).kv.total_rows; }
int64_t case_tokens_q(const sim::CaseSpec& spec) {
  return std::accumulate(spec.seqlens_q.begin(), spec.seqlens_q.end(), int64_t{0});
}

namespace {

// The case in explicit parts: lengths, padding beyond the CP rounding (a multiple of 2W rows), tail rows.
struct Parts {
  std::vector<int32_t> lq, lkv, xq, xkv;
  int64_t tail_q = 0, tail_kv = 0;
};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

Parts parts_of(const sim::CaseSpec& s) {
  Parts p;
  p.lq = s.seqlens_q;
  p.lkv = sim::seqlens_kv(s);
  const std::vector<int32_t> pq = sim::padded_q(s), pkv = sim::padded_kv(s);
  const int64_t m = 2 * int64_t{s.cp_size};
  int64_t sum_q = 0, sum_kv = 0;
  for (size_t b = 0; b < p.lq.size(); ++b) {
    p.xq.push_back(static_cast<int32_t>(pq[b] - round_up(p.lq[b], m)));
    p.xkv.push_back(static_cast<int32_t>(pkv[b] - round_up(p.lkv[b], m)));
    sum_q += pq[b];
    sum_kv += pkv[b];
  }
  const ThdLayout l = sim::layout(s);
  p.tail_q = l.q.total_rows - sum_q;
  p.tail_kv = l.kv.total_rows - sum_kv;
  return p;
}

// `base` with the parts written back (padded lengths and totals explicit only where they differ from the rule).
sim::CaseSpec with_parts(sim::CaseSpec base, const Parts& p) {
  const int64_t m = 2 * int64_t{base.cp_size};
  base.seqlens_q = p.lq;
  base.seqlens_kv = p.lkv == p.lq ? std::vector<int32_t>{} : p.lkv;
  const bool extra_q = std::any_of(p.xq.begin(), p.xq.end(), [](int32_t x) { return x != 0; });
  const bool extra_kv = std::any_of(p.xkv.begin(), p.xkv.end(), [](int32_t x) { return x != 0; });
  base.padded_q.clear();
  base.padded_kv.clear();
  int64_t sum_q = 0, sum_kv = 0;
  for (size_t b = 0; b < p.lq.size(); ++b) {
    const int64_t pq = round_up(p.lq[b], m) + p.xq[b], pkv = round_up(p.lkv[b], m) + p.xkv[b];
    if (extra_q) base.padded_q.push_back(static_cast<int32_t>(pq));
    if (extra_kv) base.padded_kv.push_back(static_cast<int32_t>(pkv));
    sum_q += pq;
    sum_kv += pkv;
  }
  base.total_tokens_q = p.tail_q ? sum_q + p.tail_q : -1;
  base.total_tokens_kv = p.tail_kv ? sum_kv + p.tail_kv : -1;
  return base;
}

int mask_cost(const sim::CaseSpec& s) {
  const Window w = sim::mask_window(s);
  if (s.causal) return 1 + (w.left >= 0);
  return (w.left >= 0) + (w.right >= 0);
}

int pad_fill_rank(sim::PadFill f) {
  switch (f) {
    case sim::PadFill::zero: return 0;
    case sim::PadFill::random: return 1;
    case sim::PadFill::inf: return 2;
    case sim::PadFill::nan: return 3;
  }
  return 3;
}

// The a2a group size the plan uses (cp_size for a2a, 1 for p2p and all_gather), whatever the spec states.
int64_t group_size(const sim::CaseSpec& s) {
  if (s.comm == sim::CommType::a2a_p2p) return sim::a2a_size(s);
  return s.comm == sim::CommType::a2a ? s.cp_size : 1;
}

// A softmax_scale other than the default 1/sqrt(dim_qk) (a fixture's case states the default explicitly).
bool explicit_scale(const sim::CaseSpec& s) {
  return s.softmax_scale && *s.softmax_scale != 1 / std::sqrt(static_cast<double>(s.dim_qk));
}

constexpr size_t kSeedComponent = 17;
using Size = std::array<int64_t, 18>;

// Every key a step may make smaller; a step is kept only when no component grows and one shrinks.
Size size_of(const sim::CaseSpec& s) {
  const ThdLayout l = sim::layout(s);
  const Window w = sim::mask_window(s);
  const std::vector<int32_t> lkv = sim::seqlens_kv(s);
  int64_t extra = 0;
  const Parts p = parts_of(s);
  for (size_t b = 0; b < p.xq.size(); ++b) extra += p.xq[b] + p.xkv[b];
  return {l.q.total_rows,
          l.kv.total_rows,
          case_tokens_q(s),
          std::accumulate(lkv.begin(), lkv.end(), int64_t{0}),
          static_cast<int64_t>(s.seqlens_q.size()),
          extra + p.tail_q + p.tail_kv,
          s.heads_q,
          sim::heads_kv(s),
          s.dim_qk,
          sim::dim_v(s),
          s.cp_size,
          group_size(s),
          mask_cost(s),
          std::max(w.left, 0),
          std::max(w.right, 0),
          pad_fill_rank(s.pad_fill),
          explicit_scale(s) ? 1 : 0,
          s.seed != 0 ? 1 : 0};
}

// a <= b in every component and < in one; `ignore_seed` leaves the seed out (a step retried with another seed).
bool smaller(const Size& a, const Size& b, bool ignore_seed) {
  bool less = false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (ignore_seed && i == kSeedComponent) continue;
    if (a[i] > b[i]) return false;
    less |= a[i] < b[i];
  }
  return less;
}

// Values below x, from lo up: lo, lo + 1, lo + 2, lo + 4, ... and x - (x - lo) / 2, x - (x - lo) / 4, ..., x - 1,
// ascending; all multiples of `unit` (x and lo are).
std::vector<int64_t> ladder(int64_t x, int64_t lo, int64_t unit = 1) {
  std::set<int64_t> v;
  if (x <= lo) return {};
  const int64_t n = (x - lo) / unit;
  v.insert(lo);
  for (int64_t d = 1; d < n; d *= 2) v.insert(lo + d * unit);
  for (int64_t d = n / 2; d >= 1; d /= 2) v.insert(x - d * unit);
  v.insert(x - unit);
  std::vector<int64_t> out;
  for (int64_t y : v)
    if (y >= lo && y < x) out.push_back(y);
  return out;
}

std::vector<int> divisors_below(int x) {
  std::vector<int> out;
  for (int d = 1; d < x; ++d)
    if (x % d == 0) out.push_back(d);
  return out;
}

struct Candidate {
  std::string change;
  sim::CaseSpec spec;
};

// The candidates of one family of steps from `s`, in the order they are tried.
std::vector<Candidate> family(int which, const sim::CaseSpec& s, const ShrinkOptions& options) {
  std::vector<Candidate> out;
  const Parts p = parts_of(s);
  const int batch = static_cast<int>(p.lq.size());
  auto add = [&](std::string change, const sim::CaseSpec& c) { out.push_back({std::move(change), c}); };
  auto with = [&](const Parts& q) { return with_parts(s, q); };
  switch (which) {
    case 0:  // fewer sequences: one alone, then one left out
      if (batch < 2) break;
      for (int b = 0; b < batch; ++b) {
        Parts q;
        q.lq = {p.lq[b]}, q.lkv = {p.lkv[b]}, q.xq = {p.xq[b]}, q.xkv = {p.xkv[b]};
        q.tail_q = p.tail_q, q.tail_kv = p.tail_kv;
        add("sequence " + std::to_string(b) + " alone (of " + std::to_string(batch) + ")", with(q));
      }
      for (int b = 0; b < batch; ++b) {
        Parts q = p;
        for (auto* v : {&q.lq, &q.lkv, &q.xq, &q.xkv}) v->erase(v->begin() + b);
        add("sequence " + std::to_string(b) + " left out", with(q));
      }
      break;
    case 1: {  // smaller cp_size (a divisor: padding and tail rows stay multiples)
      for (int w : divisors_below(s.cp_size)) {
        sim::CaseSpec c = with_parts(s, p);
        c.cp_size = w;
        if (s.comm == sim::CommType::a2a_p2p) c.a2a_size = std::gcd(sim::a2a_size(s), w);
        add("cp_size " + std::to_string(s.cp_size) + " -> " + std::to_string(w), c);
      }
      if (s.comm == sim::CommType::a2a_p2p)
        for (int a : divisors_below(sim::a2a_size(s))) {
          sim::CaseSpec c = s;
          c.a2a_size = a;
          add("a2a_size " + std::to_string(sim::a2a_size(s)) + " -> " + std::to_string(a), c);
        }
      break;
    }
    case 2:  // shorter sequences (q and kv together where they are equal)
      for (int b = 0; b < batch; ++b) {
        const std::string at = "[" + std::to_string(b) + "] ";
        if (p.lq[b] == p.lkv[b]) {
          for (int64_t v : ladder(p.lq[b], 0)) {
            Parts q = p;
            q.lq[b] = q.lkv[b] = static_cast<int32_t>(v);
            add("seqlens" + at + std::to_string(p.lq[b]) + " -> " + std::to_string(v), with(q));
          }
        } else {
          for (int64_t v : ladder(p.lq[b], 0)) {
            Parts q = p;
            q.lq[b] = static_cast<int32_t>(v);
            add("seqlens_q" + at + std::to_string(p.lq[b]) + " -> " + std::to_string(v), with(q));
          }
          for (int64_t v : ladder(p.lkv[b], 0)) {
            Parts q = p;
            q.lkv[b] = static_cast<int32_t>(v);
            add("seqlens_kv" + at + std::to_string(p.lkv[b]) + " -> " + std::to_string(v), with(q));
          }
        }
      }
      break;
    case 3: {  // less padding between sequences, fewer tail rows
      const int64_t m = 2 * int64_t{s.cp_size}, t = s.cp_size > 1 ? s.cp_size : 1;
      for (int b = 0; b < batch; ++b)
        for (bool kv : {false, true}) {
          const int32_t x = kv ? p.xkv[b] : p.xq[b];
          for (int64_t v : ladder(x, 0, m)) {
            Parts q = p;
            (kv ? q.xkv : q.xq)[b] = static_cast<int32_t>(v);
            add(std::string(kv ? "padding of kv sequence " : "padding of q sequence ") + std::to_string(b) + " " +
                    std::to_string(x) + " -> " + std::to_string(v) + " rows past the CP rounding",
                with(q));
          }
        }
      for (bool kv : {false, true}) {
        const int64_t x = kv ? p.tail_kv : p.tail_q;
        for (int64_t v : ladder(x, 0, x % t == 0 ? t : 1)) {
          Parts q = p;
          (kv ? q.tail_kv : q.tail_q) = v;
          add(std::string(kv ? "tail rows of kv " : "tail rows of q ") + std::to_string(x) + " -> " + std::to_string(v),
              with(q));
        }
      }
      break;
    }
    case 4: {  // fewer heads: the GQA ratio kept, then smaller ratios, then fewer KV heads
      const int hq = s.heads_q, hkv = sim::heads_kv(s), g = hq / hkv;
      auto heads = [&](int q, int kv) {
        sim::CaseSpec c = s;
        c.heads_q = q;
        c.heads_kv = kv == q ? -1 : kv;
        add("heads " + std::to_string(hq) + "/" + std::to_string(hkv) + " -> " + std::to_string(q) + "/" +
                std::to_string(kv),
            c);
      };
      for (int64_t v : ladder(hkv, 1)) heads(static_cast<int>(v) * g, static_cast<int>(v));
      for (int d : divisors_below(g)) heads(hkv * d, hkv);
      for (int d : divisors_below(hkv)) heads(hq, d);
      break;
    }
    case 5: {  // smaller head dims (from options.dims where given)
      auto values = [&](int x) {
        std::vector<int64_t> v;
        if (options.dims.empty()) return ladder(x, 1);
        for (int d : options.dims)
          if (d < x) v.push_back(d);
        std::sort(v.begin(), v.end());
        return v;
      };
      const int dqk = s.dim_qk, dv = sim::dim_v(s);
      if (dqk == dv)
        for (int64_t v : values(dqk)) {
          sim::CaseSpec c = s;
          c.dim_qk = static_cast<int>(v);
          c.dim_v = -1;
          add("head dims " + std::to_string(dqk) + " -> " + std::to_string(v), c);
        }
      for (int64_t v : values(dqk)) {
        sim::CaseSpec c = s;
        c.dim_qk = static_cast<int>(v);
        c.dim_v = dv;
        add("dim_qk " + std::to_string(dqk) + " -> " + std::to_string(v), c);
      }
      for (int64_t v : values(dv)) {
        sim::CaseSpec c = s;
        c.dim_v = static_cast<int>(v) == dqk ? -1 : static_cast<int>(v);
        add("dim_v " + std::to_string(dv) + " -> " + std::to_string(v), c);
      }
      break;
    }
    case 6: {  // a simpler mask and window
      const Window w = sim::mask_window(s);
      auto mask = [&](bool causal, int32_t wl, int32_t wr, std::string change) {
        sim::CaseSpec c = s;
        c.causal = causal;
        c.window = {wl, causal ? 0 : wr};
        add(std::move(change), c);
      };
      const std::string now = std::string(s.causal ? "causal" : "mask none") + " window [" + std::to_string(w.left) +
                              "," + std::to_string(w.right) + "]";
      if (mask_cost(s) > 0) mask(false, -1, -1, now + " -> no mask");
      if (s.causal && w.left >= 0) mask(true, -1, 0, now + " -> causal");
      if (!s.causal && w.left >= 0 && w.right >= 0) {
        mask(false, w.left, -1, now + " -> window [" + std::to_string(w.left) + ",-1]");
        mask(false, -1, w.right, now + " -> window [-1," + std::to_string(w.right) + "]");
      }
      if (s.causal && w.left >= 0) mask(false, w.left, -1, now + " -> window [" + std::to_string(w.left) + ",-1]");
      if (!s.causal && w.right > 0) mask(true, w.left, 0, now + " -> causal, left " + std::to_string(w.left));
      for (int64_t v : ladder(w.left, 0)) mask(s.causal, static_cast<int32_t>(v), w.right, "window left " + std::to_string(w.left) + " -> " + std::to_string(v));
      if (!s.causal)
        for (int64_t v : ladder(w.right, 0)) mask(false, w.left, static_cast<int32_t>(v), "window right " + std::to_string(w.right) + " -> " + std::to_string(v));
      break;
    }
    case 7: {  // pad fill zero, default scale, seed 0
      for (sim::PadFill f : {sim::PadFill::zero, sim::PadFill::random})
        if (pad_fill_rank(f) < pad_fill_rank(s.pad_fill)) {
          sim::CaseSpec c = s;
          c.pad_fill = f;
          add("pad_fill " + std::string(sim::pad_fill_name(s.pad_fill)) + " -> " + std::string(sim::pad_fill_name(f)), c);
        }
      if (explicit_scale(s)) {
        sim::CaseSpec c = s;
        c.softmax_scale.reset();
        add("softmax_scale " + std::to_string(*s.softmax_scale) + " -> default", c);
      }
      if (s.seed != 0) {
        sim::CaseSpec c = s;
        c.seed = 0;
        add("seed " + std::to_string(s.seed) + " -> 0", c);
      }
      break;
    }
    default: break;
  }
  return out;
}
constexpr int kFamilies = 8;

}  // namespace

std::vector<std::string> failing_tensors(const CheckReport& report) {
  static constexpr std::array<std::string_view, 5> kOrder = {"o", "lse", "dq", "dk", "dv"};
  std::vector<std::string> out;
  for (std::string_view name : kOrder)
    for (const TensorResult& t : report.results)
      if (t.tensor == name && !t.ok()) {
        out.emplace_back(name);
        break;
      }
  return out;
}

std::string compact_case_json(const sim::CaseSpec& s) {
  nlohmann::ordered_json j;
  j["seqlens_q"] = s.seqlens_q;
  if (!s.seqlens_kv.empty() && s.seqlens_kv != s.seqlens_q) j["seqlens_kv"] = s.seqlens_kv;
  const std::vector<int32_t> rule_q = sim::pad_lengths_for_cp(s.seqlens_q, s.cp_size);
  const std::vector<int32_t> rule_kv = sim::pad_lengths_for_cp(sim::seqlens_kv(s), s.cp_size);
  const std::vector<int32_t> pq = sim::padded_q(s), pkv = sim::padded_kv(s);
  if (pq != rule_q) j["padded_q"] = pq;
  if (pkv != rule_kv) j["padded_kv"] = pkv;
  const ThdLayout l = sim::layout(s);
  if (l.q.total_rows != std::accumulate(pq.begin(), pq.end(), int64_t{0})) j["total_tokens_q"] = l.q.total_rows;
  if (l.kv.total_rows != std::accumulate(pkv.begin(), pkv.end(), int64_t{0})) j["total_tokens_kv"] = l.kv.total_rows;
  j["heads_q"] = s.heads_q;
  if (sim::heads_kv(s) != s.heads_q) j["heads_kv"] = sim::heads_kv(s);
  j["dim_qk"] = s.dim_qk;
  if (sim::dim_v(s) != s.dim_qk) j["dim_v"] = sim::dim_v(s);
  j["dtype"] = std::string(dtype_name(s.dtype));
  if (s.causal) j["mask"] = "causal";
  const Window w = sim::mask_window(s);
  if (w.left >= 0 || (!s.causal && w.right >= 0)) j["window"] = {w.left, w.right};
  j["cp_size"] = s.cp_size;
  j["comm"] = std::string(sim::comm_name(s.comm));
  if (s.comm == sim::CommType::a2a_p2p) j["a2a_size"] = sim::a2a_size(s);
  if (s.seed != 0) j["seed"] = s.seed;
  j["pad_fill"] = std::string(sim::pad_fill_name(s.pad_fill));
  if (explicit_scale(s)) j["softmax_scale"] = *s.softmax_scale;
  return j.dump();
}

double shrink_work(const sim::CaseSpec& spec, bool trace) {
  const sim::CaseCost cost = sim::case_cost(spec, trace, 1);
  return 1 + cost.pairs * (spec.dim_qk + sim::dim_v(spec)) + cost.tensor_bytes + (trace ? cost.trace_bytes : 0);
}

bool shrink_same_way(const ShrinkResult& r, const ShrinkVerdict& v) {
  if (v.status != ShrinkStatus::fails) return false;
  for (const std::string& k : r.kinds)
    if (std::find(v.kinds.begin(), v.kinds.end(), k) == v.kinds.end()) return false;
  // The kinds keep their meaning: a smaller case whose diagnosis names a cause the original's does not (a dropped
  // last token that one token reads as chunk_order, a wrong scale read as an LSE offset) is another failure, not a
  // smaller one. Symptoms (pad_rows_not_zero, nonfinite_leak) may come and go with the padding and the pad fill.
  if (!r.kinds.empty())
    for (const std::string& k : v.kinds) {
      if (k == "pad_rows_not_zero" || k == "nonfinite_leak") continue;
      if (std::find(r.original_verdict.kinds.begin(), r.original_verdict.kinds.end(), k) == r.original_verdict.kinds.end())
        return false;
    }
  return !r.same_tensors || v.tensors == r.original_verdict.tensors;
}

std::string shrink_name_note(const ShrinkResult& r) {
  const std::vector<std::string>& before = r.original_verdict.kinds;
  const std::vector<std::string>& after = r.smallest_verdict.kinds;
  if (r.smallest_verdict.status != ShrinkStatus::fails) return {};
  auto has = [](const std::vector<std::string>& list, const std::string& k) {
    return std::find(list.begin(), list.end(), k) != list.end();
  };
  auto text = [](const std::vector<std::string>& list) {
    std::string s;
    for (const std::string& k : list) s += (s.empty() ? "" : ", ") + k;
    return s.empty() ? std::string("no diagnosis") : s;
  };
  auto symptom = [](const std::string& k) { return k == "pad_rows_not_zero" || k == "nonfinite_leak"; };
  std::vector<std::string> symptoms, not_required, other;
  for (const std::string& k : before)
    if (!has(after, k)) (symptom(k) ? symptoms : has(r.kinds, k) ? other : not_required).push_back(k);
  for (const std::string& k : after)
    if (!has(before, k)) (symptom(k) ? symptoms : other).push_back(k);
  if (symptoms.empty() && not_required.empty() && other.empty()) return {};
  std::vector<std::string> why;
  if (r.kinds.empty()) {
    why.push_back("any failure was kept, whatever its diagnosis (any failure)");
  } else {
    if (!symptoms.empty())
      why.push_back(text(symptoms) + (symptoms.size() > 1 ? " are symptoms, which come" : " is a symptom, which comes") +
                    " and go" + (symptoms.size() > 1 ? "" : "es") + " with the padding and the pad fill");
    if (!not_required.empty())
      why.push_back(text(not_required) + (not_required.size() > 1 ? " were" : " was") +
                    " not required (a kept failure names " + text(r.kinds) + ")");
    if (!other.empty()) why.push_back("the kinds " + text(other) + " changed");
  }
  std::string s = "the smallest case's diagnosis (" + text(after) + ") is not the original's (" + text(before) + "): ";
  for (size_t i = 0; i < why.size(); ++i) s += (i ? "; " : "") + why[i];
  return s;
}

namespace {

std::string seconds_text(double s) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1) << s << " s";
  return o.str();
}

}  // namespace

ShrinkResult shrink(const sim::CaseSpec& original, const ShrinkRunner& runner, const ShrinkOptions& options) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  ShrinkResult r;
  r.original = r.smallest = original;
  // A scale equal to the default is the default (fixtures state it): smaller head dims then keep the default.
  if (!explicit_scale(original)) r.original.softmax_scale.reset(), r.smallest.softmax_scale.reset();
  std::map<std::string, ShrinkVerdict> seen;  // normalised case -> its verdict (a case is run once)

  // The time model without options.estimate_seconds: the runs made so far, the longest run of the largest case
  // scaled by work, never below the shortest run made.
  struct Timing {
    double work, seconds;
  };
  std::vector<Timing> timings;
  auto estimate = [&](const sim::CaseSpec& spec) {
    if (options.estimate_seconds) return options.estimate_seconds(spec);
    if (timings.empty()) return 0.0;
    const Timing* largest = &timings.front();
    double shortest = timings.front().seconds;
    for (const Timing& t : timings) {
      if (t.work > largest->work || (t.work == largest->work && t.seconds > largest->seconds)) largest = &t;
      shortest = std::min(shortest, t.seconds);
    }
    return std::max(shortest, largest->seconds * shrink_work(spec) / largest->work);
  };

  auto same_way = [&](const ShrinkVerdict& v) { return shrink_same_way(r, v); };
  // One run of the search; false when the runner stopped the search instead (r.stopped set).
  auto run = [&](const std::string& change, const sim::CaseSpec& spec, bool keep_if_same, ShrinkVerdict& out) {
    ++r.runs;
    const double before = elapsed();
    ShrinkVerdict v = runner(spec, r.runs);
    if (!v.stop.empty()) {
      --r.runs;
      r.stopped = v.stop;
      r.stop_detail = v.detail;
      return false;
    }
    if (!options.estimate_seconds) timings.push_back({shrink_work(spec), elapsed() - before});
    const bool kept = keep_if_same && same_way(v);
    if (v.status == ShrinkStatus::passes) ++r.passed;
    else if (v.status == ShrinkStatus::no_candidate) ++r.no_candidate;
    else if (!kept && r.runs > 1) ++r.failed_otherwise;
    if (kept) r.smallest = spec, r.smallest_verdict = v;
    if (options.progress) options.progress({r.runs, elapsed(), change, spec, v, kept, r.smallest});
    out = seen[sim::normalized_json(spec)] = std::move(v);
    return true;
  };

  r.same_tensors = options.same_tensors;
  if (!run("the original", r.original, false, r.original_verdict)) {
    r.seconds = elapsed();
    return r;  // original_fails false: the caller names the stop
  }
  r.original_fails = r.original_verdict.status == ShrinkStatus::fails;
  r.smallest_verdict = r.original_verdict;
  if (!r.original_fails) {
    r.stopped = "original does not fail";
    r.seconds = elapsed();
    return r;
  }
  if (!options.any_failure) {
    r.kinds = options.kinds.empty() ? r.original_verdict.kinds : options.kinds;
    for (const std::string& k : r.kinds)
      if (std::find(r.original_verdict.kinds.begin(), r.original_verdict.kinds.end(), k) == r.original_verdict.kinds.end())
        fail_input("--kind", "the original's failure is not diagnosed \"", k, "\" (its diagnosis: ",
                   r.original_verdict.kinds.empty() ? std::string("none") : [&] {
                     std::string s;
                     for (const std::string& x : r.original_verdict.kinds) s += (s.empty() ? "" : ", ") + x;
                     return s;
                   }(), ")");
  }

  // Before each run of the search: the bounds, and whether the run's estimated time fits the budget left.
  auto out_of_bounds = [&](const sim::CaseSpec& next) {
    if (options.max_runs > 0 && r.runs >= options.max_runs) {
      r.stopped = "max_runs";
      r.stop_detail = "the " + std::to_string(options.max_runs) + " runs of --max-runs were made";
      return true;
    }
    if (options.budget_seconds > 0) {
      const double left = options.budget_seconds - elapsed();
      const double need = left > 0 ? estimate(next) : 0;
      if (left <= 0 || need > left) {
        r.stopped = "budget";
        r.stop_detail = "the budget of " + seconds_text(options.budget_seconds) +
                        (left <= 0 ? std::string(" was spent")
                                   : " had " + seconds_text(left) + " left, and the next run (generation, run and " +
                                         "check) needs about " + seconds_text(need));
        return true;
      }
    }
    return false;
  };
  auto keep = [&](const std::string& change, const sim::CaseSpec& spec, const ShrinkVerdict& v) {
    r.smallest = spec;
    r.smallest_verdict = v;
    r.steps.push_back(change);
    r.kept.push_back(spec);
    r.kept_verdicts.push_back(v);
  };
  // Tries one candidate (and, when it passes, its reseeded twins); true when one is kept.
  auto attempt = [&](const Candidate& c) {
    sim::CaseSpec spec;
    try {
      spec = sim::parse_case_text(compact_case_json(c.spec));  // validated and normalised
    } catch (const InputError&) {
      return false;  // not a valid case: never run
    }
    const Size now = size_of(r.smallest);
    if (!smaller(size_of(spec), now, false)) return false;
    const std::string key = sim::normalized_json(spec);
    const auto known = seen.find(key);
    if (known != seen.end()) {
      if (!same_way(known->second)) return false;
      keep(c.change, spec, known->second);  // a case run before (as a reseeded twin) that failed the same way
      return true;
    }
    if (out_of_bounds(spec)) return false;
    ShrinkVerdict v;
    if (!run(c.change, spec, true, v)) return false;
    if (same_way(v)) {
      keep(c.change, spec, v);
      return true;
    }
    if (v.status == ShrinkStatus::no_candidate || options.reseed <= 0) return false;
    for (int i = 1; i <= options.reseed; ++i) {
      sim::CaseSpec other = spec;
      other.seed = splitmix64(options.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i)) >> 1;
      if (other.seed == spec.seed || seen.count(sim::normalized_json(other))) continue;
      if (!smaller(size_of(other), now, true)) continue;
      if (out_of_bounds(other)) return false;
      ShrinkVerdict w;
      if (!run(c.change + ", seed " + std::to_string(other.seed), other, true, w)) return false;
      if (same_way(w)) {
        keep(c.change + ", seed " + std::to_string(spec.seed) + " -> " + std::to_string(other.seed), other, w);
        return true;
      }
    }
    return false;
  };

  bool progress = true;
  while (progress && r.stopped.empty()) {
    progress = false;
    for (int f = 0; f < kFamilies && r.stopped.empty(); ++f) {
      bool kept = true;
      while (kept && r.stopped.empty()) {
        kept = false;
        for (const Candidate& c : family(f, r.smallest, options)) {
          if (attempt(c)) {
            kept = progress = true;
            break;
          }
          if (!r.stopped.empty()) break;
        }
      }
    }
  }
  if (r.stopped.empty()) r.stopped = "minimal";
  r.search_smallest = r.smallest;
  r.seconds = elapsed();
  if (options.confirm > 0 && r.stopped != "interrupted") {
    confirm_smallest(r, runner, options.confirm, options);
    r.seconds = elapsed();
  }
  return r;
}

void confirm_smallest(ShrinkResult& r, const ShrinkRunner& runner, int reruns, const ShrinkOptions& options) {
  r.confirm = std::max(reruns, 0);
  r.search_smallest = r.smallest;
  if (r.confirm == 0 || !r.original_fails) return;
  const auto start = std::chrono::steady_clock::now();
  // From the search's answer back to the original: the first case every rerun of which fails the same way.
  for (int64_t i = static_cast<int64_t>(r.kept.size()) - 1; i >= -1; --i) {
    const bool original = i < 0;
    const sim::CaseSpec& spec = original ? r.original : r.kept[static_cast<size_t>(i)];
    ShrinkConfirmation c;
    c.spec = spec;
    c.original = original;
    c.step = i + 1;
    for (int k = 1; k <= r.confirm; ++k) {
      ++r.confirmation_runs;
      const int64_t number = r.runs + r.confirmation_runs;
      const ShrinkVerdict v = runner(spec, number);
      if (!v.stop.empty()) {
        --r.confirmation_runs;
        r.confirmation_stopped = v.stop;
        r.stop_detail = v.detail;
        if (c.reruns > 0) r.confirmations.push_back(c);
        return;  // not confirmed: the answer stays the search's, said unconfirmed
      }
      ++c.reruns;
      const bool same = shrink_same_way(r, v);
      c.failed_same_way += same;
      if (options.progress) {
        const std::string which = original                                        ? "the original"
                                  : i + 1 == static_cast<int64_t>(r.kept.size()) ? "the search's smallest"
                                                                                  : "step " + std::to_string(i + 1);
        const double since = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        options.progress({number, r.seconds + since,
                          "confirmation " + std::to_string(k) + " of " + std::to_string(r.confirm) + " of " + which,
                          spec, v, same, r.smallest});
      }
    }
    r.confirmations.push_back(c);
    if (c.failed_same_way == c.reruns) {
      r.confirmed = true;
      r.smallest = spec;
      r.smallest_verdict = original ? r.original_verdict : r.kept_verdicts[static_cast<size_t>(i)];
      r.steps.resize(static_cast<size_t>(i + 1));
      r.kept.resize(static_cast<size_t>(i + 1));
      r.kept_verdicts.resize(static_cast<size_t>(i + 1));
      return;
    }
    r.flaky = true;
  }
  // Nothing reproduced, the original included: no case is the answer.
  r.smallest = r.original;
  r.smallest_verdict = r.original_verdict;
  r.steps.clear();
  r.kept.clear();
  r.kept_verdicts.clear();
}

}  // namespace cpgold::fx
