#include "sim/plan/coverage.hpp"

#include <sstream>
#include <vector>

namespace cpgold::sim {

CoverageReport check_coverage(const Plan& plan, PassKind kind) {
  const PassPlan& pass = plan.pass(kind);
  const PackedSequences& gq = plan.partition.q.global();
  const PackedSequences& gk = plan.partition.kv.global();
  const int B = gq.batch();
  const int H = plan.heads_q;
  // counts[b][(i * L_kv + j) * H + h]: how often (q position i, k position j, q head h) was covered.
  std::vector<std::vector<uint8_t>> counts(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b)
    counts[static_cast<size_t>(b)].assign(static_cast<size_t>(gq.length(b)) * gk.length(b) * H, 0);
  CoverageReport report;
  auto note = [&](const std::string& what) {
    if (report.first_problem.empty()) report.first_problem = what;
  };
  const std::string_view pass_text = pass_name(kind);
  for (const Tile& t : pass.tiles) {
    if (!t.computed) continue;
    for (size_t b = 0; b < t.call.sequences.size(); ++b) {
      const SequenceTile& s = t.call.sequences[b];
      const int64_t delta = s.delta();
      for (const RowSegment& qseg : s.q)
        for (int32_t qi = 0; qi < qseg.count; ++qi)
          for (const RowSegment& kseg : s.kv)
            for (int32_t kj = 0; kj < kseg.count; ++kj) {
              const int64_t qp = qseg.position + qi, kp = kseg.position + kj;
              if (!visible(t.call.window, qp, kp, delta)) continue;
              const bool inside = static_cast<int>(b) < B && qp < gq.length(static_cast<int>(b)) &&
                                  kp < gk.length(static_cast<int>(b)) && s.length_q == gq.length(static_cast<int>(b)) &&
                                  s.length_kv == gk.length(static_cast<int>(b));
              const bool allowed = inside && visible(plan.window, qp, kp, gk.length(static_cast<int>(b)) - gq.length(static_cast<int>(b)));
              if (!allowed) {
                report.extra += t.head_end - t.head_begin;
                std::ostringstream os;
                os << pass_text << " rank " << t.rank << " step " << t.step << " sequence " << b << ": pair (q " << qp
                   << ", k " << kp << ") is not allowed by the global mask";
                note(os.str());
                continue;
              }
              auto& c = counts[b];
              for (int h = t.head_begin; h < t.head_end; ++h) {
                uint8_t& n = c[(static_cast<size_t>(qp) * gk.length(static_cast<int>(b)) + kp) * H + h];
                if (n < 255) ++n;
                if (n == 2) {
                  std::ostringstream os;
                  os << pass_text << " rank " << t.rank << " step " << t.step << " sequence " << b << ": pair (q " << qp
                     << ", k " << kp << ") head " << h << " covered twice";
                  note(os.str());
                }
              }
            }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t lq = gq.length(b), lk = gk.length(b);
    const int64_t delta = lk - lq;
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) {
        if (!visible(plan.window, i, j, delta)) continue;
        for (int h = 0; h < H; ++h) {
          const uint8_t n = counts[static_cast<size_t>(b)][(static_cast<size_t>(i) * lk + j) * H + h];
          ++report.allowed_pairs;
          if (n == 1) ++report.covered_once;
          else if (n == 0) {
            ++report.missing;
            std::ostringstream os;
            os << pass_text << " sequence " << b << ": allowed pair (q " << i << ", k " << j << ") head " << h
               << " never covered";
            note(os.str());
          } else {
            ++report.duplicated;
          }
        }
      }
  }
  return report;
}

}  // namespace cpgold::sim
