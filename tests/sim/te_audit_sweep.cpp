#include "te_audit_sweep.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "reference/splitmix64.hpp"

namespace cpgold::sim::testing {

namespace {

using json = nlohmann::json;

int32_t round_up(int32_t x, int32_t m) { return (x + m - 1) / m * m; }

struct CommVariant {
  std::string comm;
  int a2a_size = 0;  // a2a+p2p only
};

// The comm types of a W: a2a+p2p with groups of 2 where W is even (W = 2 falls back to a2a in TE).
std::vector<CommVariant> comm_variants(int W) {
  std::vector<CommVariant> v = {{"p2p"}, {"a2a"}, {"all_gather"}};
  if (W % 2 == 0) v.push_back({"a2a+p2p", 2});
  return v;
}

// Mask and window of class k; `pick` chooses among the class's windows.
void set_class(json& o, int k, int pick) {
  static const int lefts[] = {0, 1, 2, 5};
  static const int pairs[][2] = {{0, 0}, {1, 2}, {2, 1}, {0, 3}, {3, 0}};
  switch (k) {
    case 0: break;
    case 1: o["mask"] = "causal"; break;
    case 2:
      o["mask"] = "causal";
      o["window"] = {lefts[pick % 4], 0};
      break;
    case 3: o["window"] = {pairs[pick % 5][0], pairs[pick % 5][1]}; break;
    case 4: o["window"] = {-1, 0}; break;
    case 5:
      o["mask"] = "causal";
      o["window"] = {lefts[pick % 4], 1 + pick % 3};
      break;
  }
}
bool class_needs_self_attention(int k) { return k != 0; }

json base_case(int W, const CommVariant& cv) {
  json o;
  o["cp_size"] = W;
  o["comm"] = cv.comm;
  if (cv.a2a_size) o["a2a_size"] = cv.a2a_size;
  if (cv.comm == "a2a" && 4 % W != 0) o["heads_q"] = 2 * W;  // divisible by W, even for cuDNN's a2a filter
  return o;
}

}  // namespace

const std::vector<SweepClass>& te_sweep_classes() {
  static const std::vector<SweepClass> classes = {
      {"none"},
      {"causal"},
      {"causal, window (wl, 0)"},
      {"none, window (wl, wr), both >= 0"},
      {"none, window (-1, 0)"},
      {"causal, window (wl, wr > 0)"},
  };
  return classes;
}

std::vector<SweepCase> te_sweep_cases(int random_per_cell, uint64_t seed, int max_cp_size) {
  std::vector<SweepCase> out;
  SplitMix64 rng{seed};
  const int classes = static_cast<int>(te_sweep_classes().size());
  for (int W = 2; W <= max_cp_size; ++W)
    for (const CommVariant& cv : comm_variants(W))
      for (int k = 0; k < classes; ++k) {
        const int m = 2 * W;
        int pick = 0;
        // Every one-sequence layout up to 2W + 1 tokens, padded to the next multiple of 2W or one chunk row more,
        // with the key side padded the same or differently (and, without a mask, of another length).
        for (int L = 0; L <= m + 1; ++L)
          for (int extra_q = 0; extra_q < 2; ++extra_q)
            for (int kv = 0; kv < (class_needs_self_attention(k) ? 2 : 3); ++kv) {
              json o = base_case(W, cv);
              const int Lkv = kv == 2 ? (L + 3) % (m + 2) : L;
              o["seqlens_q"] = {L};
              if (Lkv != L) o["seqlens_kv"] = {Lkv};
              o["padded_q"] = {round_up(L, m) + m * extra_q};
              o["padded_kv"] = {round_up(Lkv, m) + m * (kv == 1 ? 1 - extra_q : extra_q)};
              set_class(o, k, pick++);
              out.push_back({o, cv.comm, k});
            }
        for (int n = 0; n < random_per_cell; ++n) {
          json o = base_case(W, cv);
          const int B = rng.between(2, 3);
          std::vector<int32_t> lq, lk, pq, pk;
          const bool cross = !class_needs_self_attention(k) && rng.chance(40);
          const bool other_kv_padding = rng.chance(40);
          for (int b = 0; b < B; ++b) {
            lq.push_back(rng.between(0, 2 * m + 1));
            lk.push_back(cross ? rng.between(0, 2 * m + 1) : lq.back());
            pq.push_back(round_up(lq.back(), m) + m * (rng.chance(30) ? 1 : 0));
            pk.push_back(other_kv_padding ? round_up(lk.back(), m) + m * rng.below(2) : round_up(lk.back(), m) + (pq.back() - round_up(lq.back(), m)));
          }
          o["seqlens_q"] = lq;
          if (lk != lq) o["seqlens_kv"] = lk;
          o["padded_q"] = pq;
          o["padded_kv"] = pk;
          if (cv.comm == "p2p" && rng.chance(20)) {
            int64_t tq = 0, tk = 0;
            for (int32_t x : pq) tq += x;
            for (int32_t x : pk) tk += x;
            o["total_tokens_q"] = tq + W;
            o["total_tokens_kv"] = tk + W * rng.below(2);
          }
          set_class(o, k, rng.below(20));
          out.push_back({o, cv.comm, k});
        }
      }
  return out;
}

namespace {

// The token of every row of a tensor a call reads: (sequence, position) or (-1, row) for a row holding none.
using Token = std::pair<int, int64_t>;

Token global_token(const PackedSequences& g, int64_t row) {
  for (int b = 0; b < g.batch(); ++b)
    if (row >= g.cu_seqlens_padded[b] && row < g.cu_seqlens_padded[b + 1]) return {b, row - g.cu_seqlens_padded[b]};
  return {-1, row};
}

std::vector<Token> tensor_tokens(const TeReplay& r, TeTensor tensor, int shard, bool kv) {
  const PackedSequences& g = kv ? r.global.kv : r.global.q;
  std::vector<Token> out;
  if (tensor == TeTensor::sequence_order) {
    for (int64_t row = 0; row < g.cu_seqlens_padded.back(); ++row) out.push_back(global_token(g, row));
    return out;
  }
  const SidePartition side(g, r.level.cp_size, kv ? "kv" : "q");
  const std::vector<int64_t> gather = side.gather_indices(shard);
  if (tensor == TeTensor::rank_local) {
    for (int64_t row : gather) out.push_back(global_token(g, row));
    return out;
  }
  const std::vector<int64_t> half = side.read_half_rows(tensor == TeTensor::first_half ? 0 : 1);
  for (int64_t local : half) out.push_back(global_token(g, gather[static_cast<size_t>(local)]));
  while (static_cast<int64_t>(out.size()) < side.local_rows() / 2) out.push_back({-1, static_cast<int64_t>(out.size())});
  return out;
}

// The documented mask formulas, pair by pair (te_kernel_mask.hpp states them).
bool computes(const TeCall& c, TeBackend backend, int64_t i, int64_t j, int64_t nq, int64_t nk) {
  if (backend == TeBackend::fused) {
    const bool causal = c.attn_mask_type.find("causal") != std::string::npos;
    const int64_t diagonal = i + (c.bottom_right ? nk - nq : 0);
    const bool right_ok = c.window.right != -1 ? j <= diagonal + c.window.right : (!causal || j <= diagonal);
    const bool left_ok = c.window.left == -1 || j >= diagonal - c.window.left;
    return right_ok && left_ok;
  }
  int64_t left = c.window.left, right = c.window.right;
  bool causal = c.causal;
  if (left >= c.max_seqlen_kv - 1) left = -1;
  if (right >= c.max_seqlen_q - 1) right = -1;
  if (c.max_seqlen_q == 1 && left == -1 && right == -1) causal = false;
  if (causal) right = 0;
  const bool is_causal = left < 0 && right == 0, is_local = (left >= 0 || right >= 0) && !is_causal;
  const int64_t diagonal = i + nk - nq;
  if (is_causal) return j <= diagonal;
  if (!is_local) return true;
  if (left < 0) left = c.max_seqlen_kv - 1;
  if (right < 0) right = c.max_seqlen_q - 1;
  return j >= diagonal - left && j <= diagonal + right;
}

}  // namespace

int64_t brute_force_wrong_pairs(const CaseSpec& spec, const TeReplay& r) {
  const ThdLayout l = layout(spec);
  const Window w = mask_window(spec);
  int64_t wrong = 0;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    std::map<std::tuple<int, Token, Token>, int> computed;  // (head group, query, key) -> times computed
    int groups = 0;
    for (const TeCall& c : r.calls(pass)) {
      groups = std::max(groups, c.head_group + 1);
      const std::vector<Token> qt = tensor_tokens(r, c.q_tensor, c.q_shard, false);
      const std::vector<Token> kt = tensor_tokens(r, c.kv_tensor, c.kv_shard, true);
      auto token = [](const std::vector<Token>& t, int64_t row) {
        return row >= 0 && row < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(row)] : Token{-1, row};
      };
      for (int b = 0; b < l.batch(); ++b) {
        int64_t q0, k0, nq, nk;
        if (r.backend == TeBackend::fused) {
          q0 = c.cu_seqlens_q_padded[b];
          k0 = c.cu_seqlens_kv_padded[b];
          nq = c.cu_seqlens_q[b + 1] - c.cu_seqlens_q[b];
          nk = c.cu_seqlens_kv[b + 1] - c.cu_seqlens_kv[b];
        } else {
          q0 = c.cu_seqlens_q[b];
          k0 = c.cu_seqlens_kv[b];
          nq = c.seqused_q.empty() ? c.cu_seqlens_q[b + 1] - q0 : c.seqused_q[b];
          nk = c.seqused_k.empty() ? c.cu_seqlens_kv[b + 1] - k0 : c.seqused_k[b];
        }
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t j = 0; j < nk; ++j)
            if (computes(c, r.backend, i, j, nq, nk)) ++computed[{c.head_group, token(qt, q0 + i), token(kt, k0 + j)}];
      }
    }
    std::map<std::tuple<int, Token, Token>, int> truth;
    for (int g = 0; g < groups; ++g)
      for (int s = 0; s < l.batch(); ++s)
        for (int64_t qp = 0; qp < l.q.length(s); ++qp)
          for (int64_t kp = 0; kp < l.kv.length(s); ++kp)
            if (visible(w, qp, kp, l.kv.length(s) - l.q.length(s))) truth[{g, Token{s, qp}, Token{s, kp}}] = 1;
    for (const auto& [key, m] : computed) {
      auto it = truth.find(key);
      wrong += std::abs(m - (it == truth.end() ? 0 : 1));
    }
    for (const auto& [key, t] : truth)
      if (!computed.count(key)) wrong += t;
  }
  return wrong;
}

std::string case_flags(const json& o) {
  std::ostringstream os;
  auto list = [](const json& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(v[i].get<int64_t>());
    }
    return s;
  };
  for (const char* key : {"seqlens_q", "seqlens_kv", "padded_q", "padded_kv", "total_tokens_q", "total_tokens_kv",
                          "heads_q", "mask", "window", "cp_size", "comm", "a2a_size"}) {
    if (!o.contains(key)) continue;
    std::string flag = std::string("--") + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    const json& v = o[key];
    os << (os.tellp() > 0 ? " " : "") << flag << " "
       << (v.is_array() ? list(v) : (v.is_string() ? v.get<std::string>() : std::to_string(v.get<int64_t>())));
  }
  return os.str();
}

SweepTable run_te_sweep(const std::vector<SweepCase>& cases) {
  SweepTable t;
  t.comms = {"p2p", "a2a", "all_gather", "a2a+p2p"};
  t.cells.assign(t.comms.size(), std::vector<SweepCell>(te_sweep_classes().size()));
  for (const SweepCase& c : cases) {
    const size_t ci = static_cast<size_t>(std::find(t.comms.begin(), t.comms.end(), c.comm) - t.comms.begin());
    SweepCell& cell = t.cells[ci][static_cast<size_t>(c.klass)];
    ++cell.cases;
    ++t.cases;
    const CaseSpec spec = parse_case(c.object);
    const TeUserArguments user = te_user_arguments(c.object);
    int64_t rows = 0;
    for (const char* side : {"padded_q", "padded_kv"})
      for (const auto& x : c.object[side]) rows += x.get<int64_t>();
    for (int pbs = 0; pbs < 2; ++pbs)
      for (int be = 0; be < 2; ++be) {
        const TeReplay r = replay_te(spec, user, be == 0 ? TeBackend::fused : TeBackend::flash3, pbs == 1);
        const TeAudit a = audit_te(spec, r);
        ++t.replays;
        if (a.refused) {
          ++cell.refused[pbs][be];
          ++cell.refusal[pbs][be][r.refusal->source];
          continue;
        }
        const bool findings = !a.exact;
        if (!a.misread) {
          const int64_t brute = brute_force_wrong_pairs(spec, r);
          if ((brute == 0) != a.exact || brute != a.wrong_pairs) {
            if (t.mismatches++ == 0)
              t.first_mismatch = case_flags(c.object) + " backend " + std::string(te_backend_name(r.backend)) +
                                 " pad_between_seqs " + std::to_string(pbs) + ": audit " + std::to_string(a.wrong_pairs) +
                                 " wrong pairs (exact " + std::to_string(a.exact) + "), brute force " + std::to_string(brute);
          }
        }
        if (findings) {
          ++cell.with_findings[pbs][be];
          const std::string flags = case_flags(c.object);
          int64_t& best = cell.smallest_rows[pbs][be];
          if (best < 0 || rows < best || (rows == best && flags.size() < cell.smallest[pbs][be].size()) ||
              (rows == best && flags.size() == cell.smallest[pbs][be].size() && flags < cell.smallest[pbs][be])) {
            best = rows;
            cell.smallest[pbs][be] = flags;
          }
        }
      }
  }
  return t;
}

std::string te_sweep_markdown(const SweepTable& t) {
  std::ostringstream os;
  const auto& classes = te_sweep_classes();
  auto verdict = [](const SweepCell& c, int pbs, int be) {
    // The sources of the refusals, the most frequent first.
    std::vector<std::pair<int, std::string>> sources;
    for (const auto& [source, n] : c.refusal[pbs][be]) sources.push_back({-n, source});
    std::sort(sources.begin(), sources.end());
    std::string why;
    for (const auto& [n, source] : sources)
      why += (why.empty() ? "" : ", ") + source + (sources.size() > 1 ? " in " + std::to_string(-n) : std::string());
    if (c.refused[pbs][be] == c.cases) return "refused (" + why + ")";
    std::string s = c.with_findings[pbs][be] == 0 ? "exact" : "findings in " + std::to_string(c.with_findings[pbs][be]);
    s += " of " + std::to_string(c.cases - c.refused[pbs][be]);
    if (c.refused[pbs][be] > 0) s += "; refused in " + std::to_string(c.refused[pbs][be]) + " (" + why + ")";
    return s;
  };
  for (int pbs = 1; pbs >= 0; --pbs) {
    os << "pad_between_seqs=" << (pbs ? "True" : "False") << "\n\n";
    os << "| comm | mask, window | layouts | fused | flash3 | smallest layout with findings |\n";
    os << "|---|---|---|---|---|---|\n";
    for (size_t ci = 0; ci < t.comms.size(); ++ci)
      for (size_t k = 0; k < classes.size(); ++k) {
        const SweepCell& c = t.cells[ci][k];
        std::string smallest;
        const std::string& f = c.smallest[pbs][0];
        const std::string& a = c.smallest[pbs][1];
        if (!f.empty() && f == a) smallest = "both: `" + f + "`";
        else {
          if (!f.empty()) smallest += "fused: `" + f + "`";
          if (!a.empty()) smallest += std::string(smallest.empty() ? "" : "<br>") + "flash3: `" + a + "`";
        }
        os << "| " << t.comms[ci] << " | " << classes[k].name << " | " << c.cases << " | " << verdict(c, pbs, 0) << " | "
           << verdict(c, pbs, 1) << " | " << (smallest.empty() ? "-" : smallest) << " |\n";
      }
    if (pbs) os << "\n";
  }
  return os.str();
}

}  // namespace cpgold::sim::testing
