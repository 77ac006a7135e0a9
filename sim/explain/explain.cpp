#include "sim/explain/explain.hpp"

#include <algorithm>
#include <iomanip>
#include <map>
#include <sstream>
#include <tuple>

#include "reference/bracketed_list.hpp"
#include "sim/explain/explain_te.hpp"

namespace cpgold::sim {

namespace {

using ojson = nlohmann::ordered_json;

std::string list(const std::vector<int32_t>& v) { return bracketed_list(v); }
std::string window_text(Window w) {
  std::ostringstream os;
  os << "(" << w.left << "," << w.right << ")";
  return os.str();
}

ojson window_json(Window w) { return ojson::array({w.left, w.right}); }

// Per side: for each rank, the runs of global rows it holds (sequence, chunk, first global row, rows, valid).
ojson chunk_map_json(const SidePartition& side) {
  ojson ranks = ojson::array();
  const int W = side.cp_size();
  for (int r = 0; r < W; ++r) {
    ojson runs = ojson::array();
    for (int b = 0; b < side.batch(); ++b)
      for (int c : {r, 2 * W - 1 - r}) {
        const int32_t size = side.chunk_size(b);
        runs.push_back({{"sequence", b},
                        {"chunk", c},
                        {"global_first_row", side.global().cu_seqlens_padded[b] + static_cast<int64_t>(c) * size},
                        {"rows", size},
                        {"valid", side.valid_in_chunk(b, c)}});
      }
    ranks.push_back({{"rank", r},
                     {"local_rows", side.local_rows()},
                     {"tail_rows", side.local_tail_rows()},
                     {"chunks", std::move(runs)}});
  }
  return ranks;
}

ojson message_json(const Message& m) {
  return {{"after_step", m.after_step}, {"from_rank", m.from_rank},   {"to_rank", m.to_rank},
          {"payload", std::string(payload_name(m.payload))},          {"shard_owner", m.shard_owner},
          {"heads", ojson::array({m.head_begin, m.head_end})},         {"rows", m.rows}};
}

ojson tile_json(const Tile& t, const PassPlan& pass) {
  ojson sends = ojson::array(), receives = ojson::array();
  for (const Message& m : pass.messages) {
    if (m.after_step != t.step) continue;
    if (m.from_rank == t.rank) sends.push_back({{"to_rank", m.to_rank}, {"payload", std::string(payload_name(m.payload))}, {"shard_owner", m.shard_owner}, {"rows", m.rows}});
    if (m.to_rank == t.rank) receives.push_back({{"from_rank", m.from_rank}, {"payload", std::string(payload_name(m.payload))}, {"shard_owner", m.shard_owner}, {"rows", m.rows}});
  }
  ojson q_chunks = ojson::array(), kv_chunks = ojson::array();
  for (int c : t.q_chunks)
    if (c >= 0) q_chunks.push_back(c);
  for (int c : t.kv_chunks)
    if (c >= 0) kv_chunks.push_back(c);
  return {{"rank", t.rank},
          {"step", t.step},
          {"section", std::string(section_name(t.section))},
          {"kv_owner", t.kv_owner},
          {"computed", t.computed},
          {"q_space", std::string(space_name(t.q_space))},
          {"kv_space", std::string(space_name(t.kv_space))},
          {"q_input", std::string(te_half_name(t.q_half))},
          {"kv_input", std::string(te_half_name(t.kv_half))},
          {"q_chunks", std::move(q_chunks)},
          {"kv_chunks", std::move(kv_chunks)},
          {"heads_q", ojson::array({t.head_begin, t.head_end})},
          {"heads_kv", ojson::array({t.kv_head_begin, t.kv_head_end})},
          {"cu_seqlens_q", t.te.cu_seqlens_q},
          {"cu_seqlens_kv", t.te.cu_seqlens_kv},
          {"cu_seqlens_q_padded", t.te.cu_seqlens_q_padded},
          {"cu_seqlens_kv_padded", t.te.cu_seqlens_kv_padded},
          {"max_seqlen_q", t.te.max_seqlen_q},
          {"max_seqlen_kv", t.te.max_seqlen_kv},
          {"max_seqlen_q_exact", t.te.max_seqlen_q_exact},
          {"max_seqlen_kv_exact", t.te.max_seqlen_kv_exact},
          {"te_mask", t.te.mask},
          {"te_window", window_json(t.te.window)},
          {"window", window_json(t.call.window)},
          {"work", tile_work(t)},
          {"sends", std::move(sends)},
          {"receives", std::move(receives)}};
}

struct WorkTable {
  std::vector<std::vector<int64_t>> per_rank_step;  // [rank][step]
  std::vector<int64_t> per_rank;
  double imbalance = 1.0;  // max / mean of per_rank
};
WorkTable work_table(const Plan& plan, const PassPlan& pass) {
  WorkTable w;
  w.per_rank_step.assign(static_cast<size_t>(plan.cp_size), std::vector<int64_t>(static_cast<size_t>(pass.steps), 0));
  w.per_rank.assign(static_cast<size_t>(plan.cp_size), 0);
  for (const Tile& t : pass.tiles) {
    const int64_t x = tile_work(t);
    w.per_rank_step[static_cast<size_t>(t.rank)][static_cast<size_t>(t.step)] = x;
    w.per_rank[static_cast<size_t>(t.rank)] += x;
  }
  int64_t sum = 0, mx = 0;
  for (int64_t x : w.per_rank) {
    sum += x;
    mx = std::max(mx, x);
  }
  w.imbalance = sum > 0 ? static_cast<double>(mx) * plan.cp_size / static_cast<double>(sum) : 1.0;
  return w;
}

}  // namespace

int64_t tile_work(const Tile& t) {
  if (!t.computed) return 0;
  int64_t pairs = 0;
  const Window w = t.call.window;
  for (const SequenceTile& s : t.call.sequences)
    for (const RowSegment& q : s.q)
      for (int32_t i = 0; i < q.count; ++i) {
        const int64_t diag = static_cast<int64_t>(q.position) + i + s.delta();
        const int64_t lo = w.left >= 0 ? diag - w.left : INT64_MIN / 2, hi = w.right >= 0 ? diag + w.right : INT64_MAX / 2;
        for (const RowSegment& k : s.kv) {
          const int64_t a = std::max<int64_t>(lo, k.position), b = std::min<int64_t>(hi, static_cast<int64_t>(k.position) + k.count - 1);
          if (b >= a) pairs += b - a + 1;
        }
      }
  return pairs * (t.head_end - t.head_begin);
}

std::vector<std::string> shortcut_count_warnings(const Plan& plan) {
  std::vector<std::string> out;
  auto check = [&](const SidePartition& side, const char* name, const char* level) {
    const int W = side.cp_size();
    for (int r = 0; r < W; ++r)
      for (int mode = 0; mode < 3; ++mode) {
        const bool first = mode != 2, second = mode != 1;
        const auto exact = side.cu_seqlens_on_rank(r, first, second);
        const auto shortcut = side.cu_seqlens_shortcut(first, second);
        if (exact == shortcut) continue;
        std::ostringstream os;
        os << name << " rank " << r << " (" << level << ", " << (mode == 0 ? "both chunks" : (mode == 1 ? "chunk r" : "chunk 2W-1-r"))
           << "): cu_seqlens // " << (mode == 0 ? "W" : "(2W)") << " gives " << list(shortcut) << " but the exact counts are "
           << list(exact) << " (TransformerEngine issue 3331: a stack must pass pad_between_seqs=True here)";
        out.push_back(os.str());
      }
  };
  const bool ring = plan.comm == CommType::a2a_p2p;
  const Partition& p = ring ? plan.group_partition : plan.partition;
  if (p.cp_size > 1) {
    check(p.q, "q", ring ? "p2p level" : "W-way");
    check(p.kv, "kv", ring ? "p2p level" : "W-way");
  }
  return out;
}

ojson explain_json(const CaseSpec& spec, const Plan& plan) {
  ojson j;
  j["case"] = case_to_json(spec);
  j["comm"] = std::string(comm_name(plan.comm));
  j["cp_size"] = plan.cp_size;
  j["a2a_size"] = plan.a2a_size;
  j["p2p_size"] = plan.p2p_size;
  j["window"] = window_json(plan.window);
  j["chunk_map"] = {{"q", chunk_map_json(plan.partition.q)}, {"kv", chunk_map_json(plan.partition.kv)}};
  ojson passes;
  for (PassKind kind : {PassKind::forward, PassKind::backward}) {
    const PassPlan& pass = plan.pass(kind);
    ojson tiles = ojson::array(), messages = ojson::array();
    for (const Tile& t : pass.tiles) tiles.push_back(tile_json(t, pass));
    for (const Message& m : pass.messages) messages.push_back(message_json(m));
    passes[kind == PassKind::forward ? "forward" : "backward"] = {{"steps", pass.steps}, {"tiles", std::move(tiles)}, {"messages", std::move(messages)}};
  }
  j["passes"] = std::move(passes);
  const WorkTable w = work_table(plan, plan.forward);
  j["work"] = {{"per_rank_step", w.per_rank_step}, {"per_rank", w.per_rank}, {"imbalance", w.imbalance}};
  j["warnings"] = shortcut_count_warnings(plan);
  return j;
}

std::string explain_text(const CaseSpec& spec, const Plan& plan, bool te) {
  std::ostringstream os;
  os << "case: " << normalized_json(spec) << "\n";
  os << "comm " << comm_name(plan.comm) << ", cp_size " << plan.cp_size;
  if (plan.comm == CommType::a2a_p2p) os << " (a2a groups of " << plan.a2a_size << ", ring of " << plan.p2p_size << ")";
  os << ", window " << window_text(plan.window) << (plan.causal ? " causal" : "") << "\n\n";
  for (int side = 0; side < 2; ++side) {
    const SidePartition& s = side == 0 ? plan.partition.q : plan.partition.kv;
    os << "chunk map (" << (side == 0 ? "q" : "kv") << "): rank: sequence/chunk global rows [first, end) valid\n";
    const int W = s.cp_size();
    for (int r = 0; r < W; ++r) {
      os << "  rank " << r << ":";
      for (int b = 0; b < s.batch(); ++b)
        for (int c : {r, 2 * W - 1 - r}) {
          const int64_t first = s.global().cu_seqlens_padded[b] + static_cast<int64_t>(c) * s.chunk_size(b);
          os << "  s" << b << "/c" << c << " [" << first << "," << first + s.chunk_size(b) << ") " << s.valid_in_chunk(b, c)
             << "v";
        }
      if (s.local_tail_rows() > 0) os << "  tail " << s.local_tail_rows();
      os << "\n";
    }
  }
  for (PassKind kind : {PassKind::forward, PassKind::backward}) {
    const PassPlan& pass = plan.pass(kind);
    os << "\n" << (kind == PassKind::forward ? "forward" : "backward") << " steps:\n";
    os << "  rank step section   owner q_in        kv_in       cu_seqlens_q / padded      cu_seqlens_kv / padded     "
          "max_q(exact) max_kv(exact) mask window work\n";
    for (int i = 0; i < pass.steps; ++i)
      for (int r = 0; r < plan.cp_size; ++r) {
        const Tile& t = pass.tile(r, i);
        os << "  " << std::setw(4) << r << " " << std::setw(4) << i << " " << std::left << std::setw(9)
           << section_name(t.section) << " " << std::right << std::setw(5) << t.kv_owner << " " << std::left << std::setw(11)
           << te_half_name(t.q_half) << " " << std::setw(11) << te_half_name(t.kv_half) << " " << std::setw(26)
           << (list(t.te.cu_seqlens_q) + " / " + list(t.te.cu_seqlens_q_padded)) << " " << std::setw(26)
           << (list(t.te.cu_seqlens_kv) + " / " + list(t.te.cu_seqlens_kv_padded)) << std::right << " " << std::setw(5)
           << t.te.max_seqlen_q << "(" << t.te.max_seqlen_q_exact << ")" << " " << std::setw(5) << t.te.max_seqlen_kv << "("
           << t.te.max_seqlen_kv_exact << ") " << t.te.mask << " " << window_text(t.call.window) << " "
           << (t.computed ? std::to_string(tile_work(t)) : std::string("skipped")) << "\n";
        for (const Message& m : pass.messages)
          if (m.after_step == i && m.from_rank == r)
            os << "        send " << payload_name(m.payload) << " of rank " << m.shard_owner << " heads [" << m.head_begin << ","
               << m.head_end << ") " << m.rows << " rows -> rank " << m.to_rank << "\n";
      }
    int before = 0;
    for (const Message& m : pass.messages) before += m.after_step == -1;
    if (before > 0) os << "  (" << before << " messages before step 0: a2a / all-gather of the inputs)\n";
  }
  const WorkTable w = work_table(plan, plan.forward);
  os << "\nforward work (visible pairs x heads) per rank:";
  for (size_t r = 0; r < w.per_rank.size(); ++r) os << " r" << r << "=" << w.per_rank[r];
  os << "  imbalance (max/mean) " << std::fixed << std::setprecision(3) << w.imbalance << "\n";
  const auto warnings = shortcut_count_warnings(plan);
  if (!te) {
    // TransformerEngine's cu // W shortcut concerns TE's own CP code only: counted here, listed with --te.
    if (!warnings.empty())
      os << "TransformerEngine only: " << warnings.size()
         << " per-rank counts of TE's pad_between_seqs=False shortcut (cu_seqlens // W) differ from the exact ones "
            "(explain --te lists them)\n";
    return os.str();
  }
  for (const std::string& s : warnings) os << "warning: " << s << "\n";
  if (warnings.empty()) os << "no cu_seqlens // W warnings: the shortcut counts equal the exact counts\n";
  return os.str();
}

std::string explain_svg(const CaseSpec& spec, const Plan& plan, const TeAuditReport* te) {
  static const char* colours[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"};
  auto colour = [](int r) { return std::string(colours[r % 8]); };
  const SidePartition& q = plan.partition.q;
  const int64_t T = q.global().cu_seqlens_padded.back();
  const double width = 900, cell_w = T > 0 ? std::min(24.0, (width - 120) / static_cast<double>(T)) : 1;
  const Partition& tp = plan.comm == CommType::a2a_p2p ? plan.group_partition : plan.partition;
  const int C = 2 * tp.cp_size;  // chunks per sequence in the tile grid
  const double g = 14;            // grid cell size
  const int steps = plan.forward.steps;
  const double grid = g * C + 30;
  // TE audit findings of the forward calls: per step and (q chunk, k chunk) cell, the backends and wrong pairs.
  std::map<std::tuple<int, int, int>, std::string> te_cells;
  size_t te_backward_findings = 0, te_forward_findings = 0;
  if (te)
    for (size_t b = 0; b < te->audits[0].size(); ++b) {
      const TeReplay& r = te->replays[0][b];
      for (const TeFinding& f : te->audits[0][b].findings) {
        if (f.pass != PassKind::forward) {
          ++te_backward_findings;
          continue;
        }
        ++te_forward_findings;
        const TeCall& c = r.forward[static_cast<size_t>(f.call)];
        for (const auto& [qc, kc] : f.cells) {
          std::string& title = te_cells[{c.step, qc, kc}];
          title += std::string(title.empty() ? "" : "; ") + std::string(te_backend_name(r.backend)) + " rank " +
                   std::to_string(c.rank) + " sequence " + std::to_string(f.sequence) + ": " +
                   std::to_string(f.wrong_pairs()) + " wrong pairs";
        }
      }
    }
  const double height = 60 + 22.0 * plan.cp_size + 40 + grid + 40 + (te ? 20 : 0);
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << std::max(width, 40 + grid * steps) << "\" height=\"" << height
     << "\" font-family=\"monospace\" font-size=\"11\">\n";
  os << "<text x=\"10\" y=\"16\">cpgold explain: comm " << comm_name(plan.comm) << ", cp_size " << plan.cp_size
     << ", window " << window_text(plan.window) << "</text>\n";
  os << "<text x=\"10\" y=\"34\">chunk map (q): global rows held by each rank; solid = valid, light = pad</text>\n";
  for (int r = 0; r < plan.cp_size; ++r) {
    const double y = 44 + 22.0 * r;
    os << "<text x=\"10\" y=\"" << y + 12 << "\">rank " << r << "</text>\n";
    // Each chunk the rank holds: its valid rows solid, its pad rows light.
    for (int b = 0; b < q.batch(); ++b)
      for (int c : {r, 2 * plan.cp_size - 1 - r}) {
        const int64_t first = q.global().cu_seqlens_padded[b] + static_cast<int64_t>(c) * q.chunk_size(b);
        const int64_t valid = q.valid_in_chunk(b, c), size = q.chunk_size(b);
        if (valid > 0)
          os << "<rect x=\"" << 70 + cell_w * static_cast<double>(first) << "\" y=\"" << y << "\" width=\"" << cell_w * valid
             << "\" height=\"16\" fill=\"" << colour(r) << "\"><title>rank " << r << " sequence " << b << " chunk " << c
             << ": " << valid << " valid rows</title></rect>\n";
        if (size > valid)
          os << "<rect x=\"" << 70 + cell_w * static_cast<double>(first + valid) << "\" y=\"" << y << "\" width=\""
             << cell_w * (size - valid) << "\" height=\"16\" fill=\"" << colour(r) << "\" fill-opacity=\"0.25\"><title>rank " << r
             << " sequence " << b << " chunk " << c << ": " << size - valid << " pad rows</title></rect>\n";
      }
  }
  for (int b = 0; b <= q.batch(); ++b) {
    const double x = 70 + cell_w * q.global().cu_seqlens_padded[b];
    os << "<line x1=\"" << x << "\" y1=\"40\" x2=\"" << x << "\" y2=\"" << 46 + 22.0 * plan.cp_size << "\" stroke=\"black\"/>\n";
  }
  const double gy = 60 + 22.0 * plan.cp_size + 20;
  os << "<text x=\"10\" y=\"" << gy - 6 << "\">forward steps: (q chunk row, k chunk column) tiles, colour = computing rank"
     << (plan.comm == CommType::a2a ? " (a2a: every rank computes every tile for its head group)" : "") << "</text>\n";
  for (int s = 0; s < steps; ++s) {
    const double x0 = 20 + grid * s;
    os << "<text x=\"" << x0 << "\" y=\"" << gy + 10 << "\">step " << s << "</text>\n";
    for (int qc = 0; qc < C; ++qc)
      for (int kc = 0; kc < C; ++kc)
        os << "<rect x=\"" << x0 + g * kc << "\" y=\"" << gy + 16 + g * qc << "\" width=\"" << g << "\" height=\"" << g
           << "\" fill=\"white\" stroke=\"#ccc\"/>\n";
    for (int r = 0; r < plan.cp_size; ++r) {
      const Tile& t = plan.forward.tile(r, s);
      if (!t.computed) continue;
      std::vector<int> qcs, kcs;
      for (int c : t.q_chunks)
        if (c >= 0) qcs.push_back(c);
      for (int c : t.kv_chunks)
        if (c >= 0) kcs.push_back(c);
      if (qcs.empty())
        for (int c = 0; c < C; ++c) qcs.push_back(c);
      if (kcs.empty())
        for (int c = 0; c < C; ++c) kcs.push_back(c);
      for (int qc : qcs)
        for (int kc : kcs) {
          // Draw only chunk pairs with some visible pair in some sequence.
          bool any = false;
          for (int b = 0; b < q.batch() && !any; ++b) {
            const int64_t cq = tp.q.chunk_size(b), ck = tp.kv.chunk_size(b);
            const int64_t nq = tp.q.valid_in_chunk(b, qc), nk = tp.kv.valid_in_chunk(b, kc);
            const int64_t delta = static_cast<int64_t>(tp.kv.global().length(b)) - tp.q.global().length(b);
            if (nq == 0 || nk == 0) continue;
            // Some i in [q0, q0 + nq), j in [k0, k0 + nk) with j - i inside the window's [delta - wl, delta + wr].
            const int64_t q0 = qc * cq, k0 = kc * ck;
            const int64_t lo = k0 - (q0 + nq - 1), hi = (k0 + nk - 1) - q0;
            const int64_t wlo = plan.window.left >= 0 ? delta - plan.window.left : lo;
            const int64_t whi = plan.window.right >= 0 ? delta + plan.window.right : hi;
            any = std::max(lo, wlo) <= std::min(hi, whi);
          }
          if (!any) continue;
          os << "<rect x=\"" << x0 + g * kc + 1 << "\" y=\"" << gy + 17 + g * qc << "\" width=\"" << g - 2 << "\" height=\"" << g - 2
             << "\" fill=\"" << colour(r) << "\"><title>rank " << r << " step " << s << " q chunk " << qc << " k chunk " << kc
             << "</title></rect>\n";
        }
    }
    for (const auto& [key, title] : te_cells) {
      const auto [step, qc, kc] = key;
      if (step != s || qc >= C || kc >= C) continue;
      os << "<rect x=\"" << x0 + g * kc << "\" y=\"" << gy + 16 + g * qc << "\" width=\"" << g << "\" height=\"" << g
         << "\" fill=\"none\" stroke=\"#d00\" stroke-width=\"2\"><title>TE audit, step " << s << ", q chunk " << qc
         << ", k chunk " << kc << ": " << title << "</title></rect>\n";
    }
  }
  if (te)
    os << "<text x=\"10\" y=\"" << height - 8 << "\">TE audit (" << kTeVersion << ", pad_between_seqs="
       << (te->pad_between_seqs ? "True" : "False") << "): "
       << (te->exact() ? std::string("exact")
                       : std::to_string(te_forward_findings) + " forward findings outlined in red" +
                             (te_backward_findings ? ", " + std::to_string(te_backward_findings) + " in the backward" : std::string()))
       << "</text>\n";
  (void)spec;
  os << "</svg>\n";
  return os.str();
}

}  // namespace cpgold::sim
