#include "sim/explain/explain_summary.hpp"

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "sim/plan/partition.hpp"

namespace cpgold::sim {

namespace {

using ojson = nlohmann::ordered_json;

// Keys visible to the query at `position` of a sequence (window normalised; delta = L_kv - L_q).
int64_t visible_keys(int64_t position, int64_t length_kv, int64_t delta, Window w) {
  const int64_t lo = w.left >= 0 ? std::max<int64_t>(0, position + delta - w.left) : 0;
  const int64_t hi = w.right >= 0 ? std::min<int64_t>(length_kv - 1, position + delta + w.right) : length_kv - 1;
  return hi >= lo ? hi - lo + 1 : 0;
}

// Visible pairs of the valid query rows of chunk `chunk` of sequence b (one head).
int64_t chunk_pairs(const SidePartition& q, const PackedSequences& kv, int b, int chunk, Window w) {
  const int64_t first = static_cast<int64_t>(chunk) * q.chunk_size(b), valid = q.valid_in_chunk(b, chunk);
  const int64_t length_kv = kv.length(b), delta = length_kv - q.global().length(b);
  int64_t pairs = 0;
  for (int64_t p = first; p < first + valid; ++p) pairs += visible_keys(p, length_kv, delta, w);
  return pairs;
}

double imbalance_of(const std::vector<int64_t>& work) {
  const int64_t sum = std::accumulate(work.begin(), work.end(), int64_t{0});
  const int64_t most = work.empty() ? 0 : *std::max_element(work.begin(), work.end());
  return sum > 0 ? static_cast<double>(most) * static_cast<double>(work.size()) / static_cast<double>(sum) : 1.0;
}

std::string work_list(const std::vector<int64_t>& work) {
  std::ostringstream os;
  for (size_t r = 0; r < work.size(); ++r) os << (r ? " " : "") << "r" << r << "=" << work[r];
  return os.str();
}

ojson split_json(const SequenceSplit& s) {
  return {{"sequence", s.sequence}, {"length_q", s.length_q}, {"length_kv", s.length_kv},
          {"padded_q", s.padded_q}, {"work_per_rank", s.work},     {"imbalance", s.imbalance}};
}

std::string case_line(const CaseSpec& spec, const LayoutSummary& s) {
  std::ostringstream os;
  const Window w = mask_window(spec);
  os << s.batch << " sequences, " << s.tokens_q << " q tokens (" << s.rows_q << " rows), " << s.tokens_kv
     << " kv tokens (" << s.rows_kv << " rows), heads " << spec.heads_q << "/" << heads_kv(spec) << ", dims "
     << spec.dim_qk << "/" << dim_v(spec) << ", " << dtype_name(spec.dtype) << ", mask "
     << (spec.causal ? "causal" : "none") << ", window (" << w.left << "," << w.right << "), comm "
     << comm_name(spec.comm) << ", cp_size " << spec.cp_size;
  return os.str();
}

}  // namespace

int64_t plan_units(const CaseSpec& spec) {
  return static_cast<int64_t>(spec.cp_size) * spec.cp_size * static_cast<int64_t>(spec.seqlens_q.size());
}

double full_explain_bytes(const CaseSpec& spec) { return 380.0 * static_cast<double>(plan_units(spec)); }

LayoutSummary summarize_layout(const CaseSpec& spec, int shown) {
  const ThdLayout l = layout(spec);
  const Window w = mask_window(spec);
  const int W = spec.cp_size;
  const bool masked = spec.causal || is_causal(w) || has_window(w);
  const Partition partition = make_partition(l, W, masked);
  // Who computes which rows (docs/cp-plan.md): p2p and all_gather, each rank its own q chunks with every head; a2a,
  // every rank all rows with heads_q / W heads; a2a+p2p, the ring index r / a2a_size of the P-way partition with
  // heads_q / a2a_size heads.
  const int a = spec.comm == CommType::a2a ? W : (spec.comm == CommType::a2a_p2p ? a2a_size(spec) : 1);
  const int ring = W / a;
  const Partition ring_partition = spec.comm == CommType::a2a_p2p ? make_partition(l, ring, masked) : partition;
  const int64_t heads = spec.heads_q / a;

  LayoutSummary s;
  s.cp_size = W;
  s.batch = l.batch();
  s.rows_q = l.q.total_rows;
  s.rows_kv = l.kv.total_rows;
  s.plan_units = plan_units(spec);
  s.ranks.assign(static_cast<size_t>(W), RankTotals{});
  for (int r = 0; r < W; ++r) {
    RankTotals& t = s.ranks[static_cast<size_t>(r)];
    t.q_rows = partition.q.local_rows();
    t.kv_rows = partition.kv.local_rows();
    for (int b = 0; b < l.batch(); ++b)
      for (int c : {r, 2 * W - 1 - r}) {
        t.q_valid += partition.q.valid_in_chunk(b, c);
        t.kv_valid += partition.kv.valid_in_chunk(b, c);
      }
  }
  std::vector<SequenceSplit> splits;
  splits.reserve(static_cast<size_t>(l.batch()));
  for (int b = 0; b < l.batch(); ++b) {
    SequenceSplit split;
    split.sequence = b;
    split.length_q = l.q.length(b);
    split.length_kv = l.kv.length(b);
    split.padded_q = l.q.padded_length(b);
    s.tokens_q += split.length_q;
    s.tokens_kv += split.length_kv;
    split.work.assign(static_cast<size_t>(W), 0);
    if (spec.comm == CommType::a2a) {
      int64_t pairs = 0;
      for (int c = 0; c < 2 * W; ++c) pairs += chunk_pairs(partition.q, l.kv, b, c, w);
      for (int r = 0; r < W; ++r) split.work[static_cast<size_t>(r)] = pairs * heads;
    } else {
      std::vector<int64_t> per_ring(static_cast<size_t>(ring), 0);
      for (int g = 0; g < ring; ++g)
        for (int c : {g, 2 * ring - 1 - g}) per_ring[static_cast<size_t>(g)] += chunk_pairs(ring_partition.q, l.kv, b, c, w);
      for (int r = 0; r < W; ++r) split.work[static_cast<size_t>(r)] = per_ring[static_cast<size_t>(r / a)] * heads;
    }
    for (int r = 0; r < W; ++r) s.ranks[static_cast<size_t>(r)].work += split.work[static_cast<size_t>(r)];
    split.imbalance = imbalance_of(split.work);
    splits.push_back(std::move(split));
  }
  std::vector<int64_t> totals;
  for (const RankTotals& t : s.ranks) totals.push_back(t.work);
  s.imbalance = imbalance_of(totals);
  const size_t n = std::min<size_t>(static_cast<size_t>(std::max(shown, 0)), splits.size());
  s.first.assign(splits.begin(), splits.begin() + static_cast<std::ptrdiff_t>(n));
  std::vector<size_t> order(splits.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    if (splits[x].imbalance != splits[y].imbalance) return splits[x].imbalance > splits[y].imbalance;
    return splits[x].length_q > splits[y].length_q;
  });
  for (size_t i = 0; i < n; ++i) s.worst.push_back(splits[order[i]]);
  return s;
}

std::string summary_text(const CaseSpec& spec, const LayoutSummary& s) {
  std::ostringstream os;
  os << "summary of the layout: a full plan has W x W x sequences = " << s.plan_units
     << " units of tile metadata (about " << std::fixed << std::setprecision(1) << full_explain_bytes(spec) / 1e9
     << " GB); pass --full for every tile\n";
  os << "case: " << case_line(spec, s) << "\n\n";
  os << "per rank:   rank     q rows    q valid    kv rows   kv valid   forward work (visible pairs x heads)\n";
  for (int r = 0; r < s.cp_size; ++r) {
    const RankTotals& t = s.ranks[static_cast<size_t>(r)];
    os << "  " << std::setw(10) << r << " " << std::setw(10) << t.q_rows << " " << std::setw(10) << t.q_valid << " "
       << std::setw(10) << t.kv_rows << " " << std::setw(10) << t.kv_valid << "   " << t.work << "\n";
  }
  os << "forward work imbalance (max/mean) " << std::setprecision(3) << s.imbalance << "\n";
  auto show = [&](const char* title, const std::vector<SequenceSplit>& list) {
    os << "\n" << title << ":\n";
    for (const SequenceSplit& q : list)
      os << "  s" << q.sequence << ": length " << q.length_q << " (kv " << q.length_kv << "), padded " << q.padded_q
         << ", imbalance " << std::setprecision(3) << q.imbalance << ", work " << work_list(q.work) << "\n";
  };
  show("first sequences", s.first);
  show("most unevenly split sequences", s.worst);
  return os.str();
}

ojson summary_json(const CaseSpec& spec, const LayoutSummary& s) {
  ojson j;
  j["summary"] = true;
  j["plan_units"] = s.plan_units;
  j["case"] = {{"batch", s.batch},           {"tokens_q", s.tokens_q},
               {"tokens_kv", s.tokens_kv},   {"rows_q", s.rows_q},
               {"rows_kv", s.rows_kv},       {"heads_q", spec.heads_q},
               {"heads_kv", heads_kv(spec)}, {"dim_qk", spec.dim_qk},
               {"dim_v", dim_v(spec)},       {"dtype", std::string(dtype_name(spec.dtype))},
               {"mask", spec.causal ? "causal" : "none"},
               {"window", ojson::array({mask_window(spec).left, mask_window(spec).right})},
               {"comm", std::string(comm_name(spec.comm))},
               {"cp_size", spec.cp_size}};
  ojson ranks = ojson::array();
  for (int r = 0; r < s.cp_size; ++r) {
    const RankTotals& t = s.ranks[static_cast<size_t>(r)];
    ranks.push_back({{"rank", r}, {"q_rows", t.q_rows}, {"q_valid", t.q_valid}, {"kv_rows", t.kv_rows},
                     {"kv_valid", t.kv_valid}, {"work", t.work}});
  }
  j["per_rank"] = std::move(ranks);
  j["imbalance"] = s.imbalance;
  ojson first = ojson::array(), worst = ojson::array();
  for (const SequenceSplit& q : s.first) first.push_back(split_json(q));
  for (const SequenceSplit& q : s.worst) worst.push_back(split_json(q));
  j["first_sequences"] = std::move(first);
  j["worst_sequences"] = std::move(worst);
  return j;
}

std::string summary_svg(const CaseSpec& spec, const LayoutSummary& s) {
  // One bar per rank: valid q rows (solid) and pad rows (light); forward work as a second bar. Then the first and the
  // worst sequences as rows of W cells shaded by their work on each rank.
  const double width = 900, label = 70, bar = width - label - 20, row = 14;
  int64_t most_rows = 1, most_work = 1;
  for (const RankTotals& t : s.ranks) most_rows = std::max(most_rows, t.q_rows), most_work = std::max(most_work, t.work);
  const size_t sequences = s.first.size() + s.worst.size();
  const double height = 60 + 2 * row * s.cp_size + 40 + (row + 4) * static_cast<double>(sequences) + 30;
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"monospace\" font-size=\"11\">\n";
  os << "<text x=\"10\" y=\"16\">cpgold explain (summary): " << case_line(spec, s) << "</text>\n";
  os << "<text x=\"10\" y=\"34\">per rank: q rows (solid valid, light pad) and forward work (dark), imbalance "
     << s.imbalance << "</text>\n";
  for (int r = 0; r < s.cp_size; ++r) {
    const RankTotals& t = s.ranks[static_cast<size_t>(r)];
    const double y = 44 + 2 * row * r;
    os << "<text x=\"10\" y=\"" << y + 11 << "\">rank " << r << "</text>\n";
    os << "<rect x=\"" << label << "\" y=\"" << y << "\" width=\"" << bar * t.q_valid / most_rows
       << "\" height=\"" << row - 2 << "\" fill=\"#4e79a7\"><title>rank " << r << ": " << t.q_valid
       << " valid q rows</title></rect>\n";
    os << "<rect x=\"" << label + bar * t.q_valid / most_rows << "\" y=\"" << y << "\" width=\""
       << bar * (t.q_rows - t.q_valid) / most_rows << "\" height=\"" << row - 2
       << "\" fill=\"#4e79a7\" fill-opacity=\"0.25\"><title>rank " << r << ": " << t.q_rows - t.q_valid
       << " pad rows</title></rect>\n";
    os << "<rect x=\"" << label << "\" y=\"" << y + row << "\" width=\"" << bar * t.work / most_work
       << "\" height=\"" << row - 4 << "\" fill=\"#e15759\"><title>rank " << r << ": forward work " << t.work
       << "</title></rect>\n";
  }
  double y = 44 + 2 * row * s.cp_size + 20;
  os << "<text x=\"10\" y=\"" << y << "\">first and most unevenly split sequences: work per rank (darker = more)</text>\n";
  y += 8;
  auto draw = [&](const SequenceSplit& q) {
    const int64_t most = std::max<int64_t>(1, *std::max_element(q.work.begin(), q.work.end()));
    os << "<text x=\"10\" y=\"" << y + 11 << "\">s" << q.sequence << "</text>\n";
    const double cell = bar / s.cp_size;
    for (int r = 0; r < s.cp_size; ++r)
      os << "<rect x=\"" << label + cell * r << "\" y=\"" << y << "\" width=\"" << cell << "\" height=\"" << row
         << "\" fill=\"#59a14f\" fill-opacity=\"" << 0.1 + 0.9 * q.work[static_cast<size_t>(r)] / most
         << "\"><title>sequence " << q.sequence << " rank " << r << ": work " << q.work[static_cast<size_t>(r)]
         << "</title></rect>\n";
    y += row + 4;
  };
  for (const SequenceSplit& q : s.first) draw(q);
  for (const SequenceSplit& q : s.worst) draw(q);
  os << "</svg>\n";
  return os.str();
}

}  // namespace cpgold::sim
