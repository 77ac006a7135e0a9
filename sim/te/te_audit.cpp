#include "sim/te/te_audit.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "sim/te/te_kernel_mask.hpp"

namespace cpgold::sim {

namespace {

// Rows [first_row, first_row + rows) of a tensor hold positions first_position, first_position + 1, ... of `sequence`.
struct RowRun {
  int64_t first_row = 0, rows = 0;
  int sequence = -1;
  int64_t first_position = 0;
};
struct TensorMap {
  std::vector<RowRun> runs;  // sorted by first_row, disjoint; rows outside every run hold no token
  int64_t rows = 0;          // rows of the tensor
  std::vector<std::vector<size_t>> runs_of_sequence;  // [sequence] indices into runs
  // The row holding position `position` of sequence s, -1 if the tensor does not hold it.
  int64_t row_of(int s, int64_t position) const {
    if (s < 0 || static_cast<size_t>(s) >= runs_of_sequence.size()) return -1;
    for (size_t i : runs_of_sequence[static_cast<size_t>(s)]) {
      const RowRun& run = runs[i];
      if (position >= run.first_position && position < run.first_position + run.rows)
        return run.first_row + (position - run.first_position);
    }
    return -1;
  }
  void index_sequences(int batch) {
    runs_of_sequence.assign(static_cast<size_t>(batch), {});
    for (size_t i = 0; i < runs.size(); ++i) runs_of_sequence[static_cast<size_t>(runs[i].sequence)].push_back(i);
  }
};

// A piece of a call's sequence slot: indices [index, index + count) of the slot hold positions first_position... of
// `sequence` (-1: no token; then first_position is the tensor row of the first index).
struct Piece {
  int64_t index = 0, count = 0;
  int sequence = -1;
  int64_t first_position = 0;
};

TensorMap tensor_map(const TeReplay& r, TeTensor tensor, int shard, bool kv_side) {
  TensorMap m;
  if (tensor == TeTensor::sequence_order) {
    const PackedSequences& g = kv_side ? r.global.kv : r.global.q;
    for (int b = 0; b < g.batch(); ++b)
      if (g.padded_length(b) > 0) m.runs.push_back({g.cu_seqlens_padded[b], g.padded_length(b), b, 0});
    m.rows = g.cu_seqlens_padded.back();
    m.index_sequences(g.batch());
    return m;
  }
  const SidePartition& side = kv_side ? r.level.kv : r.level.q;
  const int P = side.cp_size();
  const int first_chunk = shard, second_chunk = 2 * P - 1 - shard;
  for (int b = 0; b < side.batch(); ++b) {
    const int64_t c = side.chunk_size(b);
    if (c == 0) continue;
    if (tensor == TeTensor::rank_local) {
      const int64_t start = side.global().cu_seqlens_padded[b] / P;
      m.runs.push_back({start, c, b, first_chunk * c});
      m.runs.push_back({start + c, c, b, second_chunk * c});
    } else {
      // thd_read_half_tensor: out[x] = in[x + cu_s[s + half]], cu_s = (cuP / P) / 2.
      const int64_t start = side.global().cu_seqlens_padded[b] / (2 * P);
      m.runs.push_back({start, c, b, (tensor == TeTensor::first_half ? first_chunk : second_chunk) * c});
    }
  }
  m.rows = tensor == TeTensor::rank_local ? side.local_rows() : side.local_rows() / 2;
  m.index_sequences(side.batch());
  return m;
}

std::vector<Piece> slice(const TensorMap& m, int64_t first_row, int64_t count) {
  std::vector<Piece> out;
  int64_t row = first_row;
  const int64_t end = first_row + count;
  auto it = std::upper_bound(m.runs.begin(), m.runs.end(), row,
                             [](int64_t x, const RowRun& run) { return x < run.first_row; });
  if (it != m.runs.begin()) --it;
  while (row < end) {
    while (it != m.runs.end() && it->first_row + it->rows <= row) ++it;
    if (it != m.runs.end() && it->first_row <= row) {
      const int64_t n = std::min(end, it->first_row + it->rows) - row;
      out.push_back({row - first_row, n, it->sequence, it->first_position + (row - it->first_row)});
      row += n;
    } else {
      const int64_t next = it != m.runs.end() ? std::min(end, it->first_row) : end;
      out.push_back({row - first_row, next - row, -1, row});
      row = next;
    }
  }
  return out;
}

struct Truth {
  std::vector<int32_t> length_q, length_kv;
  Window window;
  // [first, last] of visible key positions of query `position` (first > last: none).
  std::pair<int64_t, int64_t> keys(int s, int64_t position) const {
    const int64_t lq = length_q[static_cast<size_t>(s)], lk = length_kv[static_cast<size_t>(s)];
    if (position < 0 || position >= lq || lk <= 0) return {0, -1};
    const int64_t diag = position + lk - lq;
    const int64_t lo = window.left >= 0 ? std::max<int64_t>(0, diag - window.left) : 0;
    const int64_t hi = window.right >= 0 ? std::min<int64_t>(lk - 1, diag + window.right) : lk - 1;
    return {lo, hi};
  }
};

Truth make_truth(const CaseSpec& spec) {
  const ThdLayout l = layout(spec);
  Truth t;
  for (int b = 0; b < l.batch(); ++b) {
    t.length_q.push_back(l.q.length(b));
    t.length_kv.push_back(l.kv.length(b));
  }
  t.window = mask_window(spec);
  return t;
}

struct Example {
  bool set = false;
  int query_sequence = -1;
  int64_t query_position = 0;
  int slot = -2;       // the call's sequence slot that computes the query; -2: not looked up yet; -1: none
  int64_t index = 0;   // index within the slot
  int64_t row = -1;    // row in the call's Q tensor
};

struct Accumulator {
  int64_t extra = 0, missing = 0, duplicate = 0;
  std::string argument;
  Example example;
  std::set<std::pair<int, int>> cells;
  void offer(const Example& e) {
    if (!example.set || (e.query_sequence >= 0 && (example.query_sequence < 0 || e.query_position < example.query_position)))
      example = e;
    example.set = true;
  }
};

struct Contribution {
  int group = 0, sequence = 0;
  int64_t position = 0;  // query position
  int64_t first = 0, last = 0;  // key positions
  int call = 0;
};

class PassAudit {
 public:
  PassAudit(const CaseSpec& spec, const TeReplay& r, PassKind pass, const Truth& truth)
      : r_(r), calls_(r.calls(pass)), truth_(truth) {
    const int W = spec.cp_size;
    grid_ = spec.comm == CommType::a2a_p2p ? W / a2a_size(spec) : W;
    for (const TeCall& c : calls_) groups_ = std::max(groups_, c.head_group + 1);
    level_chunks_ = 2 * r.level.cp_size;
    responsible_.assign(static_cast<size_t>(groups_ * level_chunks_ * level_chunks_), -1);
    for (size_t ci = 0; ci < calls_.size(); ++ci) {
      const TeCall& c = calls_[ci];
      for (int cq : scope(c.q_scope))
        for (int ck : scope(c.kv_scope)) {
          int& slot = responsible_[index(c.head_group, cq, ck)];
          if (slot >= 0) throw std::logic_error("te audit: two calls own the same chunk pair");
          slot = static_cast<int>(ci);
        }
    }
  }

  // Slot by slot: the query tokens of slot b are normally those of sequence b, so sequence b's pairs are complete once
  // every call's slot b is evaluated and can be compared and dropped. A sequence whose tokens also appear in another
  // slot (offsets or counts past its rows) waits until every slot is done.
  void run(std::map<std::pair<int, int>, Accumulator>& acc) {
    acc_ = &acc;
    const int B = static_cast<int>(truth_.length_q.size());
    std::vector<char> deferred(static_cast<size_t>(B), 0);
    for (size_t ci = 0; ci < calls_.size(); ++ci)
      for (int b = 0; b < B; ++b) {
        const TeSequenceArgs a = te_sequence_args(calls_[ci], r_.backend, b);
        if (a.q_count <= 0 || a.kv_count <= 0) continue;
        for (const Piece& p : slice(q_map(calls_[ci]), a.q_first_row, a.q_count))
          if (p.sequence >= 0 && p.sequence != b) deferred[static_cast<size_t>(p.sequence)] = 1;
      }
    std::vector<std::vector<Contribution>> later(static_cast<size_t>(B));  // per deferred sequence
    for (int b = 0; b < B; ++b) {
      contributions_.clear();
      for (size_t ci = 0; ci < calls_.size(); ++ci) evaluate(static_cast<int>(ci), b);
      if (deferred[static_cast<size_t>(b)]) {
        for (const Contribution& c : contributions_) later[static_cast<size_t>(c.sequence)].push_back(c);
        continue;
      }
      std::vector<Contribution> own;
      for (const Contribution& c : contributions_) (c.sequence == b ? own : later[static_cast<size_t>(c.sequence)]).push_back(c);
      compare_sequence(own, b);
    }
    for (int b = 0; b < B; ++b)
      if (deferred[static_cast<size_t>(b)]) compare_sequence(later[static_cast<size_t>(b)], b);
  }

  // What call ci computes for the query at index i of slot b.
  TeKeySet computed_keys(int ci, int b, int64_t i) const {
    const TeCall& c = calls_[static_cast<size_t>(ci)];
    const TeSequenceArgs a = te_sequence_args(c, r_.backend, b);
    const TeKeyRange kr = te_visible_keys(te_kernel_mask(c, r_.backend), i, a.q_count, a.kv_count);
    TeKeySet out;
    if (kr.empty()) return out;
    for (const Piece& p : slice(kv_map(c), a.kv_first_row + kr.first, kr.last - kr.first + 1)) {
      const TeKeyRun run{p.sequence, p.first_position, p.first_position + p.count - 1};
      if (!out.empty() && out.back().sequence == run.sequence && out.back().last + 1 == run.first) out.back().last = run.last;
      else out.push_back(run);
    }
    return out;
  }

  // The visible keys of a query that call ci is the one to compute (its shards hold them).
  TeKeySet expected_keys(int ci, int s, int64_t qp) const {
    TeKeySet out;
    const TeCall& c = calls_[static_cast<size_t>(ci)];
    const auto [lo, hi] = truth_.keys(s, qp);
    for (int64_t k = lo; k <= hi;) {
      const int64_t ck = r_.level.kv.chunk_size(s);
      const int64_t chunk_end = std::min(hi, (k / ck + 1) * ck - 1);
      if (responsible(c.head_group, s, qp, k) == ci) {
        if (!out.empty() && out.back().last + 1 == k) out.back().last = chunk_end;
        else out.push_back({s, k, chunk_end});
      }
      k = chunk_end + 1;
    }
    return out;
  }

  // Where call ci computes query token (s, qp): slot, index and row; slot -1 if it does not.
  Example locate(int ci, int s, int64_t qp) const {
    const TeCall& c = calls_[static_cast<size_t>(ci)];
    Example e;
    e.set = true;
    e.query_sequence = s;
    e.query_position = qp;
    e.slot = -1;
    const int64_t row = q_map(c).row_of(s, qp);
    if (row < 0) return e;
    const int B = static_cast<int>(truth_.length_q.size());
    for (int k = 0; k < B; ++k) {
      const int b = k == 0 ? s : (k <= s ? k - 1 : k);  // the query's own slot first
      const TeSequenceArgs a = te_sequence_args(c, r_.backend, b);
      if (row >= a.q_first_row && row < a.q_first_row + a.q_count && a.kv_count > 0) {
        e.slot = b;
        e.index = row - a.q_first_row;
        e.row = row;
        return e;
      }
    }
    return e;
  }

 private:
  static std::vector<int> scope_all(int n) {
    std::vector<int> v;
    for (int i = 0; i < n; ++i) v.push_back(i);
    return v;
  }
  std::vector<int> scope(const int (&s)[2]) const {
    if (s[0] < 0 && s[1] < 0) return scope_all(level_chunks_);
    std::vector<int> v;
    for (int x : s)
      if (x >= 0) v.push_back(x);
    return v;
  }
  size_t index(int g, int cq, int ck) const {
    return static_cast<size_t>((g * level_chunks_ + cq) * level_chunks_ + ck);
  }
  int responsible(int g, int s, int64_t qp, int64_t kp) const {
    const int cq = static_cast<int>(qp / r_.level.q.chunk_size(s));
    const int ck = static_cast<int>(kp / r_.level.kv.chunk_size(s));
    return responsible_[index(g, cq, ck)];
  }
  const TensorMap& q_map(const TeCall& c) const { return map(c.q_tensor, c.q_shard, false); }
  const TensorMap& kv_map(const TeCall& c) const { return map(c.kv_tensor, c.kv_shard, true); }
  const TensorMap& map(TeTensor t, int shard, bool kv) const {
    const auto key = std::make_tuple(static_cast<int>(t), t == TeTensor::sequence_order ? 0 : shard, kv);
    auto it = maps_.find(key);
    if (it == maps_.end()) it = maps_.emplace(key, tensor_map(r_, t, shard, kv)).first;
    return it->second;
  }

  Accumulator& at(int ci, int s) { return (*acc_)[{ci, s}]; }

  void add_cells(Accumulator& a, int s, int64_t qp, int64_t k_first, int64_t k_last) const {
    const int64_t cq = r_.global.q.padded_length(s) / (2 * grid_), ck = r_.global.kv.padded_length(s) / (2 * grid_);
    if (cq <= 0 || ck <= 0) return;
    for (int64_t c = k_first / ck; c <= k_last / ck; ++c) a.cells.insert({static_cast<int>(qp / cq), static_cast<int>(c)});
  }

  // Compares the contributions of sequence s (every group, every valid query) with the truth. A stable counting sort
  // by (group, query position) keeps each query's contributions in the order the calls made them.
  void compare_sequence(const std::vector<Contribution>& contributions, int s) {
    const int64_t lq = truth_.length_q[static_cast<size_t>(s)];
    std::vector<size_t>& start = bucket_start_;
    start.assign(static_cast<size_t>(groups_ * lq + 1), 0);
    for (const Contribution& c : contributions) ++start[static_cast<size_t>(c.group * lq + c.position) + 1];
    for (size_t i = 1; i < start.size(); ++i) start[i] += start[i - 1];
    std::vector<Contribution>& sorted = sorted_;
    sorted.resize(contributions.size());
    std::vector<size_t> next(start.begin(), start.end() - 1);
    for (const Contribution& c : contributions) sorted[next[static_cast<size_t>(c.group * lq + c.position)]++] = c;
    for (int g = 0; g < groups_; ++g)
      for (int64_t qp = 0; qp < lq; ++qp) {
        const size_t i = static_cast<size_t>(g * lq + qp);
        compare(sorted, g, s, qp, start[i], start[i + 1]);
      }
  }

  void evaluate(int ci, int b) {
    const TeCall& c = calls_[static_cast<size_t>(ci)];
    const TeKernelMask mask = te_kernel_mask(c, r_.backend);
    const TensorMap& qm = q_map(c);
    const TensorMap& km = kv_map(c);
    {
      const TeSequenceArgs a = te_sequence_args(c, r_.backend, b);
      if (a.q_count > c.max_seqlen_q || a.kv_count > c.max_seqlen_kv || a.q_count < 0 || a.kv_count < 0)
        at(ci, b).argument = "sequence " + std::to_string(b) + " has " + std::to_string(a.q_count) + " query and " +
                             std::to_string(a.kv_count) + " key rows but max_seqlen_q " + std::to_string(c.max_seqlen_q) +
                             " and max_seqlen_kv " + std::to_string(c.max_seqlen_kv);
      if (a.q_count <= 0 || a.kv_count <= 0) return;
      const std::vector<Piece> kpieces = slice(km, a.kv_first_row, a.kv_count);
      for (const Piece& qp : slice(qm, a.q_first_row, a.q_count))
        for (int64_t i = qp.index; i < qp.index + qp.count; ++i) {
          const TeKeyRange kr = te_visible_keys(mask, i, a.q_count, a.kv_count);
          if (kr.empty()) continue;
          const int qs = qp.sequence;
          const int64_t qpos = qp.first_position + (i - qp.index);
          for (const Piece& kp : kpieces) {
            const int64_t j0 = std::max(kr.first, kp.index), j1 = std::min(kr.last, kp.index + kp.count - 1);
            if (j0 > j1) continue;
            const int64_t k0 = kp.first_position + (j0 - kp.index), k1 = kp.first_position + (j1 - kp.index);
            emit(ci, b, i, a.q_first_row + i, qs, qpos, kp.sequence, k0, k1);
          }
        }
    }
  }

  void emit(int ci, int slot, int64_t index, int64_t row, int qs, int64_t qpos, int ks, int64_t k0, int64_t k1) {
    const Example here{true, qs, qpos, slot, index, row};
    auto extra = [&](int64_t n, int64_t kf, int64_t kl) {
      Accumulator& a = at(ci, qs >= 0 ? qs : slot);
      a.extra += n;
      a.offer(here);
      if (qs >= 0 && qs == ks) add_cells(a, qs, qpos, kf, kl);
    };
    if (qs < 0 || ks < 0 || qs != ks || qpos >= truth_.length_q[static_cast<size_t>(qs)]) {
      extra(k1 - k0 + 1, k0, k1);
      return;
    }
    const int64_t lk = truth_.length_kv[static_cast<size_t>(qs)];
    if (k1 >= lk) {
      const int64_t pad_first = std::max(k0, lk);
      extra(k1 - pad_first + 1, pad_first, k1);
      k1 = lk - 1;
    }
    if (k0 <= k1) contributions_.push_back({calls_[static_cast<size_t>(ci)].head_group, qs, qpos, k0, k1, ci});
  }

  void compare(const std::vector<Contribution>& contributions, int g, int s, int64_t qp, size_t begin, size_t end) {
    const auto [tlo, thi] = truth_.keys(s, qp);
    if (begin == end && tlo > thi) return;
    if (tlo <= thi && begin < end) {
      // Fast path: contributions inside the visible range whose lengths add up to it and that do not overlap cover it
      // exactly once.
      int64_t total = 0;
      bool inside = true;
      for (size_t k = begin; k < end; ++k) {
        total += contributions[k].last - contributions[k].first + 1;
        inside = inside && contributions[k].first >= tlo && contributions[k].last <= thi;
      }
      if (inside && total == thi - tlo + 1) {
        if (end - begin == 1) return;
        spans_.clear();
        for (size_t k = begin; k < end; ++k) spans_.push_back({contributions[k].first, contributions[k].last});
        std::sort(spans_.begin(), spans_.end());
        bool disjoint = true;
        for (size_t k = 1; k < spans_.size(); ++k) disjoint = disjoint && spans_[k].first > spans_[k - 1].second;
        if (disjoint) return;
      }
    }
    std::vector<int64_t>& cuts = cuts_;
    cuts.clear();
    if (tlo <= thi) {
      cuts.push_back(tlo);
      cuts.push_back(thi + 1);
    }
    for (size_t k = begin; k < end; ++k) {
      cuts.push_back(contributions[k].first);
      cuts.push_back(contributions[k].last + 1);
    }
    const int64_t lo = *std::min_element(cuts.begin(), cuts.end()), hi = *std::max_element(cuts.begin(), cuts.end());
    const int64_t ck = r_.level.kv.chunk_size(s);
    if (ck > 0)
      for (int64_t x = (lo / ck + 1) * ck; x < hi; x += ck) cuts.push_back(x);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<int>& covering = covering_;
    for (size_t u = 0; u + 1 < cuts.size(); ++u) {
      const int64_t x = cuts[u], y = cuts[u + 1];
      const bool visible = tlo <= thi && x >= tlo && y - 1 <= thi;
      covering.clear();
      for (size_t k = begin; k < end; ++k)
        if (contributions[k].first <= x && contributions[k].last >= y - 1) covering.push_back(contributions[k].call);
      const int64_t n = y - x;
      const size_t m = covering.size();
      if (visible ? m == 1 : m == 0) continue;
      Example e;
      e.set = true;
      e.query_sequence = s;
      e.query_position = qp;
      if (!visible) {
        for (int ci : covering) record(ci, s, e, n, 0, 0, x, y - 1);
      } else if (m == 0) {
        const int ci = responsible(g, s, qp, x);
        if (ci < 0) throw std::logic_error("te audit: a visible pair no call owns");
        record(ci, s, e, 0, n, 0, x, y - 1);
      } else {
        const int owner = responsible(g, s, qp, x);
        const bool owner_covers = std::find(covering.begin(), covering.end(), owner) != covering.end();
        bool kept = false;
        for (int ci : covering) {
          if (!kept && (owner_covers ? ci == owner : true)) {
            kept = true;
            continue;
          }
          record(ci, s, e, 0, 0, n, x, y - 1);
        }
      }
    }
  }

  void record(int ci, int s, const Example& e, int64_t extra, int64_t missing, int64_t duplicate, int64_t kf, int64_t kl) {
    Accumulator& a = at(ci, s);
    a.extra += extra;
    a.missing += missing;
    a.duplicate += duplicate;
    a.offer(e);
    add_cells(a, s, e.query_position, kf, kl);
  }

  const TeReplay& r_;
  const std::vector<TeCall>& calls_;
  const Truth& truth_;
  int grid_ = 1;
  int groups_ = 0;
  int level_chunks_ = 2;
  std::vector<int> responsible_;
  std::vector<Contribution> contributions_;
  std::vector<int64_t> cuts_;   // buffers kept between queries and sequences
  std::vector<size_t> bucket_start_;
  std::vector<Contribution> sorted_;
  std::vector<int> covering_;
  std::vector<std::pair<int64_t, int64_t>> spans_;
  std::map<std::pair<int, int>, Accumulator>* acc_ = nullptr;
  mutable std::map<std::tuple<int, int, bool>, TensorMap> maps_;
};

}  // namespace

TeKeySet te_true_keys(const CaseSpec& spec, int sequence, int64_t position) {
  const Truth t = make_truth(spec);
  const auto [lo, hi] = t.keys(sequence, position);
  if (lo > hi) return {};
  return {{sequence, lo, hi}};
}

TeAudit audit_te(const CaseSpec& spec, const TeReplay& r) {
  TeAudit audit;
  audit.backend = r.backend;
  audit.pad_between_seqs = r.pad_between_seqs;
  if (r.refusal) {
    audit.refused = true;
    return audit;
  }
  if (r.misread) {
    audit.misread = r.misread;
    return audit;
  }
  const Truth truth = make_truth(spec);
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    const int pi = pass == PassKind::forward ? 0 : 1;
    std::map<std::pair<int, int>, Accumulator> acc;
    PassAudit pa(spec, r, pass, truth);
    pa.run(acc);
    audit.call_wrong_pairs[pi].assign(r.calls(pass).size(), 0);
    for (auto& [key, a] : acc) {
      const int64_t wrong = a.extra + a.missing + a.duplicate;
      if (wrong == 0 && a.argument.empty()) continue;
      TeFinding f;
      f.pass = pass;
      f.call = key.first;
      f.sequence = key.second;
      f.extra_pairs = a.extra;
      f.missing_pairs = a.missing;
      f.duplicate_pairs = a.duplicate;
      f.argument = a.argument;
      f.cells = a.cells;
      Example e = a.example;
      if (e.set) {
        if (e.slot == -2 && e.query_sequence >= 0) e = pa.locate(key.first, e.query_sequence, e.query_position);
        f.query_row = e.slot >= 0 ? e.row : -1;
        f.query_sequence = e.query_sequence;
        f.query_position = e.query_position;
        if (e.slot >= 0) f.computed = pa.computed_keys(key.first, e.slot, e.index);
        if (e.query_sequence >= 0) f.expected = pa.expected_keys(key.first, e.query_sequence, e.query_position);
      }
      audit.call_wrong_pairs[pi][static_cast<size_t>(key.first)] += wrong;
      audit.wrong_pairs += wrong;
      audit.findings.push_back(std::move(f));
    }
  }
  audit.exact = audit.findings.empty();
  return audit;
}

std::string te_key_set_text(const TeKeySet& keys, const ThdLayout& l, int query_sequence) {
  if (keys.empty()) return "{}";
  std::ostringstream os;
  for (size_t i = 0; i < keys.size(); ++i) {
    const TeKeyRun& k = keys[i];
    if (i) os << ", ";
    if (k.sequence < 0) {
      os << "rows " << k.first << ".." << k.last << " (no token)";
      continue;
    }
    if (k.sequence != query_sequence) os << "s" << k.sequence << ":";
    const int64_t len = l.kv.length(k.sequence);
    auto range = [&](int64_t a, int64_t b) {
      os << a;
      if (b > a) os << ".." << b;
    };
    if (k.first < len) range(k.first, std::min(k.last, len - 1));
    if (k.last >= len) {
      if (k.first < len) os << ", ";
      range(std::max(k.first, len), k.last);
      os << " (pad)";
    }
  }
  return os.str();
}

}  // namespace cpgold::sim
