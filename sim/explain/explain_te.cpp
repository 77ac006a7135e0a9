#include "sim/explain/explain_te.hpp"

#include <iomanip>
#include <map>
#include <sstream>

#include "reference/bracketed_list.hpp"
#include "sim/te/te_kernel_mask.hpp"

namespace cpgold::sim {

namespace {

using ojson = nlohmann::ordered_json;
using V = std::vector<int32_t>;

std::string list(const V& v) { return bracketed_list(v); }
std::string window_text(Window w) { return "(" + std::to_string(w.left) + "," + std::to_string(w.right) + ")"; }
std::string input_name(TeTensor t) {
  return t == TeTensor::first_half ? "first_half" : (t == TeTensor::second_half ? "second_half" : "full");
}
V prefix_sums(const V& counts) {
  V out{0};
  for (int32_t x : counts) out.push_back(out.back() + x);
  return out;
}

// The arguments of a call in backend-neutral terms, to compare with cpgold's StepMetadata.
struct Neutral {
  std::string q_input, kv_input;
  V cu_q, cu_kv, pad_q, pad_kv;
  int32_t max_q = 0, max_kv = 0;
  std::string mask;
  Window window;
};
Neutral neutral(const TeCall& c, TeBackend backend) {
  Neutral n;
  n.q_input = input_name(c.q_tensor);
  n.kv_input = input_name(c.kv_tensor);
  n.max_q = c.max_seqlen_q;
  n.max_kv = c.max_seqlen_kv;
  if (backend == TeBackend::fused) {
    n.cu_q = c.cu_seqlens_q;
    n.cu_kv = c.cu_seqlens_kv;
    n.pad_q = c.cu_seqlens_q_padded;
    n.pad_kv = c.cu_seqlens_kv_padded;
    n.mask = c.attn_mask_type;
    // cuDNN: a causal mask type puts the right bound at 0 unless window_size gives one.
    n.window = {c.window.left, c.window.right != -1 ? c.window.right : (c.causal ? 0 : -1)};
  } else {
    n.cu_q = c.seqused_q.empty() ? c.cu_seqlens_q : prefix_sums(c.seqused_q);
    n.cu_kv = c.seqused_k.empty() ? c.cu_seqlens_kv : prefix_sums(c.seqused_k);
    n.pad_q = c.cu_seqlens_q;
    n.pad_kv = c.cu_seqlens_kv;
    n.mask = c.causal ? "causal" : "not causal";
    n.window = {c.window.left, c.causal ? 0 : c.window.right};
  }
  return n;
}
Neutral neutral(const Tile& t, TeBackend backend) {
  Neutral n;
  n.q_input = te_half_name(t.q_half);
  n.kv_input = te_half_name(t.kv_half);
  n.cu_q = t.te.cu_seqlens_q;
  n.cu_kv = t.te.cu_seqlens_kv;
  n.pad_q = t.te.cu_seqlens_q_padded;
  n.pad_kv = t.te.cu_seqlens_kv_padded;
  n.max_q = t.te.max_seqlen_q;
  n.max_kv = t.te.max_seqlen_kv;
  n.mask = backend == TeBackend::fused ? t.te.mask
                                       : (t.te.mask.find("causal") != std::string::npos ? "causal" : "not causal");
  n.window = t.te.window;
  return n;
}

void compare_plan(const Plan& plan, TeAuditReport& report) {
  const std::vector<TeReplay>& replays = report.replays[0];
  const TeReplay* replay = nullptr;
  for (const TeReplay& r : replays)
    if (!r.refusal && !replay) replay = &r;
  if (!replay) return;
  report.compared = true;
  report.compared_backend = replay->backend;
  for (PassKind pass : {PassKind::forward, PassKind::backward}) {
    const PassPlan& pp = plan.pass(pass);
    std::map<std::pair<int, int>, const TeCall*> calls;
    for (const TeCall& c : replay->calls(pass)) calls[{c.rank, c.step}] = &c;
    for (const Tile& t : pp.tiles) {
      auto it = calls.find({t.rank, t.step});
      if (it == calls.end()) {
        report.differences.push_back({pass, t.rank, t.step, "call", t.computed ? "computed" : "skipped", "no such call"});
        continue;
      }
      const Neutral a = neutral(t, replay->backend), b = neutral(*it->second, replay->backend);
      auto diff = [&](const std::string& field, const std::string& x, const std::string& y) {
        if (x != y) report.differences.push_back({pass, t.rank, t.step, field, x, y});
      };
      diff("computed", t.computed ? "yes" : "no (skipped)", "yes");
      diff("q_input", a.q_input, b.q_input);
      diff("kv_input", a.kv_input, b.kv_input);
      diff("cu_seqlens_q", list(a.cu_q), list(b.cu_q));
      diff("cu_seqlens_kv", list(a.cu_kv), list(b.cu_kv));
      diff("cu_seqlens_q_padded", list(a.pad_q), list(b.pad_q));
      diff("cu_seqlens_kv_padded", list(a.pad_kv), list(b.pad_kv));
      diff("max_seqlen_q", std::to_string(a.max_q), std::to_string(b.max_q));
      diff("max_seqlen_kv", std::to_string(a.max_kv), std::to_string(b.max_kv));
      diff("mask", a.mask, b.mask);
      diff("window", window_text(a.window), window_text(b.window));
      calls.erase(it);
    }
    for (const auto& [key, c] : calls)
      report.differences.push_back({pass, key.first, key.second, "call", "no such tile", c->section});
  }
}

ojson key_set_json(const TeKeySet& keys) {
  ojson out = ojson::array();
  for (const TeKeyRun& k : keys) out.push_back({{"sequence", k.sequence}, {"first", k.first}, {"last", k.last}});
  return out;
}
ojson note_json(const std::optional<TeNote>& n) {
  if (!n) return nullptr;
  return {{"text", n->text}, {"source", n->source}};
}

ojson call_json(const TeCall& c, TeBackend backend, int64_t wrong) {
  ojson j;
  j["rank"] = c.rank;
  j["step"] = c.step;
  j["section"] = c.section;
  j["kv_owner"] = c.kv_owner;
  j["heads_q"] = ojson::array({c.head_begin, c.head_end});
  j["q_input"] = std::string(te_tensor_name(c.q_tensor));
  j["kv_input"] = std::string(te_tensor_name(c.kv_tensor));
  j["cu_seqlens_q"] = c.cu_seqlens_q;
  j["cu_seqlens_kv"] = c.cu_seqlens_kv;
  if (backend == TeBackend::fused) {
    j["cu_seqlens_q_padded"] = c.cu_seqlens_q_padded;
    j["cu_seqlens_kv_padded"] = c.cu_seqlens_kv_padded;
  } else {
    j["seqused_q"] = c.seqused_q.empty() ? ojson(nullptr) : ojson(c.seqused_q);
    j["seqused_k"] = c.seqused_k.empty() ? ojson(nullptr) : ojson(c.seqused_k);
  }
  j["max_seqlen_q"] = c.max_seqlen_q;
  j["max_seqlen_kv"] = c.max_seqlen_kv;
  if (backend == TeBackend::fused) j["attn_mask_type"] = c.attn_mask_type;
  else j["causal"] = c.causal;
  j["window_size"] = ojson::array({c.window.left, c.window.right});
  j["bottom_right_diagonal"] = c.bottom_right;
  j["kernel_mask"] = te_kernel_mask(c, backend).rule;
  j["source"] = c.source;
  j["wrong_pairs"] = wrong;
  return j;
}

ojson finding_json(const TeFinding& f, const TeReplay& r) {
  const TeCall& c = r.calls(f.pass)[static_cast<size_t>(f.call)];
  ojson j;
  j["pass"] = std::string(pass_name(f.pass));
  j["rank"] = c.rank;
  j["step"] = c.step;
  j["section"] = c.section;
  j["heads_q"] = ojson::array({c.head_begin, c.head_end});
  j["sequence"] = f.sequence;
  j["wrong_pairs"] = f.wrong_pairs();
  j["extra_pairs"] = f.extra_pairs;
  j["missing_pairs"] = f.missing_pairs;
  j["duplicate_pairs"] = f.duplicate_pairs;
  j["argument"] = f.argument.empty() ? ojson(nullptr) : ojson(f.argument);
  const bool pad = f.query_sequence >= 0 && f.query_position >= r.global.q.length(f.query_sequence);
  j["query"] = {{"row", f.query_row}, {"sequence", f.query_sequence}, {"position", f.query_position}, {"pad", pad}};
  j["expected_keys"] = key_set_json(f.expected);
  j["computed_keys"] = key_set_json(f.computed);
  return j;
}

ojson replay_json(const TeReplay& r, const TeAudit& a, bool with_calls) {
  ojson j;
  j["backend"] = std::string(te_backend_name(r.backend));
  j["title"] = std::string(te_backend_title(r.backend));
  j["pad_between_seqs"] = r.pad_between_seqs;
  j["comm"] = std::string(comm_name(r.comm));
  j["attn_mask_type"] = r.attn_mask_type;
  j["window_size"] = r.refusal ? ojson(nullptr) : ojson::array({r.window_size.left, r.window_size.right});
  j["max_seqlen_q"] = r.max_seqlen_q;
  j["max_seqlen_kv"] = r.max_seqlen_kv;
  ojson notes = ojson::array();
  for (const TeNote& n : r.normalisations) notes.push_back({{"text", n.text}, {"source", n.source}});
  j["normalisations"] = std::move(notes);
  j["refusal"] = note_json(r.refusal);
  j["misread"] = note_json(r.misread);
  if (with_calls) {
    ojson calls;
    for (PassKind p : {PassKind::forward, PassKind::backward}) {
      ojson list = ojson::array();
      const auto& cs = r.calls(p);
      for (size_t i = 0; i < cs.size(); ++i) {
        const auto& wrong = a.call_wrong_pairs[p == PassKind::forward ? 0 : 1];
        list.push_back(call_json(cs[i], r.backend, i < wrong.size() ? wrong[i] : 0));
      }
      calls[std::string(pass_name(p))] = std::move(list);
    }
    j["calls"] = std::move(calls);
  }
  j["exact"] = a.exact;
  j["wrong_pairs"] = a.wrong_pairs;
  j["finding_count"] = a.findings.size();
  ojson findings = ojson::array();
  for (size_t i = 0; i < a.findings.size() && i < kTeJsonFindings; ++i) findings.push_back(finding_json(a.findings[i], r));
  j["findings"] = std::move(findings);
  return j;
}

std::string plural(int64_t n, const std::string& word) { return std::to_string(n) + " " + word + (n == 1 ? "" : "s"); }

std::string verdict_line(const TeReplay& r, const TeAudit& a) {
  std::ostringstream os;
  if (a.refused) os << "refused by TE: " << r.refusal->text << " [" << r.refusal->source << "]";
  else if (a.misread) os << "not exact: " << a.misread->text << " [" << a.misread->source << "]";
  else if (a.exact) os << "exact (every visible pair computed once, nothing else)";
  else os << plural(static_cast<int64_t>(a.findings.size()), "finding") << ", " << plural(a.wrong_pairs, "wrong pair");
  return os.str();
}

void findings_text(std::ostream& os, const TeReplay& r, const TeAudit& a, const std::string& indent) {
  size_t shown = 0;
  for (const TeFinding& f : a.findings) {
    if (shown++ == kTeTextFindings) {
      os << indent << "... and " << a.findings.size() - kTeTextFindings << " more findings (--format json lists up to "
         << kTeJsonFindings << ")\n";
      break;
    }
    const TeCall& c = r.calls(f.pass)[static_cast<size_t>(f.call)];
    os << indent << pass_name(f.pass) << " rank " << c.rank << " step " << c.step << " (" << c.section << ", heads ["
       << c.head_begin << "," << c.head_end << ")) sequence " << f.sequence << ": " << plural(f.wrong_pairs(), "wrong pair") << " ("
       << f.extra_pairs << " extra, " << f.missing_pairs << " missing, " << f.duplicate_pairs << " duplicate)";
    if (!f.argument.empty()) os << "; argument: " << f.argument;
    os << "\n";
    if (f.query_sequence >= 0 || f.query_row >= 0) {
      os << indent << "  query ";
      if (f.query_row >= 0) os << "row " << f.query_row << " ";
      else os << "(not read by this call) ";
      if (f.query_sequence >= 0) {
        os << "sequence " << f.query_sequence << " position " << f.query_position;
        if (f.query_position >= r.global.q.length(f.query_sequence)) os << " (pad row)";
      } else {
        os << "holding no token";
      }
      os << ": expected keys " << te_key_set_text(f.expected, r.global, f.query_sequence) << "; computed "
         << te_key_set_text(f.computed, r.global, f.query_sequence) << "\n";
    }
  }
}

void calls_text(std::ostream& os, const TeReplay& r, const TeAudit& a) {
  const bool fused = r.backend == TeBackend::fused;
  for (PassKind p : {PassKind::forward, PassKind::backward}) {
    os << "  " << pass_name(p) << " calls:\n";
    os << "    rank step section        owner q_in        kv_in       "
       << (fused ? "cu_seqlens_q / padded      cu_seqlens_kv / padded     "
                 : "cu_seqlens_q / seqused_q   cu_seqlens_kv / seqused_k  ")
       << "max_q max_kv " << (fused ? "mask                        " : "causal ") << "window  br wrong source\n";
    const auto& cs = r.calls(p);
    const auto& wrong = a.call_wrong_pairs[p == PassKind::forward ? 0 : 1];
    for (size_t i = 0; i < cs.size(); ++i) {
      const TeCall& c = cs[i];
      const std::string q = fused ? list(c.cu_seqlens_q) + " / " + list(c.cu_seqlens_q_padded)
                                  : list(c.cu_seqlens_q) + " / " + (c.seqused_q.empty() ? "-" : list(c.seqused_q));
      const std::string k = fused ? list(c.cu_seqlens_kv) + " / " + list(c.cu_seqlens_kv_padded)
                                  : list(c.cu_seqlens_kv) + " / " + (c.seqused_k.empty() ? "-" : list(c.seqused_k));
      os << "    " << std::setw(4) << c.rank << " " << std::setw(4) << c.step << " " << std::left << std::setw(14)
         << c.section << " " << std::right << std::setw(5) << c.kv_owner << " " << std::left << std::setw(11)
         << te_tensor_name(c.q_tensor) << " " << std::setw(11) << te_tensor_name(c.kv_tensor) << " " << std::setw(26) << q
         << " " << std::setw(26) << k << std::right << " " << std::setw(5) << c.max_seqlen_q << " " << std::setw(6)
         << c.max_seqlen_kv << " " << std::left << std::setw(fused ? 27 : 6)
         << (fused ? c.attn_mask_type : (c.causal ? "true" : "false")) << " " << std::setw(7) << window_text(c.window)
         << " " << std::setw(2) << (c.bottom_right ? "br" : "tl") << std::right << " " << std::setw(5)
         << (i < wrong.size() ? wrong[i] : 0) << " " << c.source << "\n";
    }
  }
}

}  // namespace

bool TeAuditReport::exact() const {
  bool any = false;
  for (const TeAudit& a : audits[0]) {
    if (a.refused) continue;
    any = true;
    if (!a.exact) return false;
  }
  return any;
}

TeAuditReport te_audit_report(const CaseSpec& spec, const Plan& plan, const TeUserArguments& user, bool pad_between_seqs) {
  TeAuditReport report;
  report.user = user;
  report.pad_between_seqs = pad_between_seqs;
  for (int v = 0; v < 2; ++v)
    for (TeBackend b : {TeBackend::fused, TeBackend::flash3}) {
      report.replays[v].push_back(replay_te(spec, user, b, v == 0 ? pad_between_seqs : !pad_between_seqs));
      report.audits[v].push_back(audit_te(spec, report.replays[v].back()));
    }
  compare_plan(plan, report);
  return report;
}

nlohmann::ordered_json te_audit_json(const TeAuditReport& report) {
  ojson j;
  j["te_version"] = std::string(kTeVersion);
  j["environment"] = std::string(kTeEnvironment);
  j["user_arguments"] = {{"attn_mask_type", report.user.attn_mask_type},
                         {"window_size", report.user.window_size
                                             ? ojson::array({report.user.window_size->left, report.user.window_size->right})
                                             : ojson(nullptr)}};
  j["pad_between_seqs"] = report.pad_between_seqs;
  j["exact"] = report.exact();
  ojson replays = ojson::array();
  for (size_t b = 0; b < report.replays[0].size(); ++b)
    replays.push_back(replay_json(report.replays[0][b], report.audits[0][b], true));
  j["replays"] = std::move(replays);
  ojson other = ojson::array();
  for (size_t b = 0; b < report.replays[1].size(); ++b)
    other.push_back(replay_json(report.replays[1][b], report.audits[1][b], false));
  j["other_pad_between_seqs"] = {{"pad_between_seqs", !report.pad_between_seqs}, {"replays", std::move(other)}};
  ojson diffs = ojson::array();
  for (const TePlanDifference& d : report.differences)
    diffs.push_back({{"pass", std::string(pass_name(d.pass))}, {"rank", d.rank}, {"step", d.step}, {"field", d.field},
                     {"cpgold", d.cpgold}, {"te", d.te}});
  j["plan_differences"] = {{"backend", report.compared ? ojson(std::string(te_backend_name(report.compared_backend)))
                                                       : ojson(nullptr)},
                           {"differences", std::move(diffs)}};
  return j;
}

std::string te_audit_text(const TeAuditReport& report) {
  std::ostringstream os;
  const std::string pbs = report.pad_between_seqs ? "True" : "False";
  os << "\nTransformerEngine replay and audit: " << kTeVersion << "\n";
  os << "assumed: " << kTeEnvironment << "\n";
  os << "user call: attn_mask_type " << report.user.attn_mask_type << ", window_size "
     << (report.user.window_size ? window_text(*report.user.window_size) : std::string("not given"))
     << ", pad_between_seqs=" << pbs
     << (report.pad_between_seqs ? " (what DotProductAttention sets when padded offsets are passed)" : "") << "\n";
  for (size_t b = 0; b < report.replays[0].size(); ++b) {
    const TeReplay& r = report.replays[0][b];
    const TeAudit& a = report.audits[0][b];
    os << "\n" << te_backend_name(r.backend) << ": " << te_backend_title(r.backend) << "\n";
    for (const TeNote& n : r.normalisations) os << "  TE normalises: " << n.text << " [" << n.source << "]\n";
    if (r.refusal) {
      os << "  refused: " << r.refusal->text << " [" << r.refusal->source << "]\n";
      continue;
    }
    os << "  TE runs comm " << comm_name(r.comm) << " with attn_mask_type " << r.attn_mask_type << ", window_size "
       << window_text(r.window_size) << ", max_seqlen " << r.max_seqlen_q << " / " << r.max_seqlen_kv << "\n";
    calls_text(os, r, a);
    os << "  audit ("
       << (r.backend == TeBackend::fused ? "cuDNN: top-left diagonal unless a *bottom_right* mask type"
                                         : "FlashAttention-3: bottom-right diagonal with the used lengths")
       << "): " << verdict_line(r, a) << "\n";
    findings_text(os, r, a, "    ");
  }
  os << "\npad_between_seqs=" << (report.pad_between_seqs ? "False" : "True")
     << (report.pad_between_seqs ? " (the cu // W shortcut a stack gets by passing pad_between_seqs=False; TE issue 3331):"
                                 : " (what DotProductAttention sets itself when padded offsets are passed):")
     << "\n";
  for (size_t b = 0; b < report.replays[1].size(); ++b) {
    const TeReplay& r = report.replays[1][b];
    const TeAudit& a = report.audits[1][b];
    os << "  " << te_backend_name(r.backend) << ": " << verdict_line(r, a) << "\n";
    findings_text(os, r, a, "    ");
  }
  os << "\ncpgold's plan vs TE's replay";
  if (!report.compared) {
    os << ": every backend refuses the case; TE makes no call\n";
  } else {
    os << " (" << te_backend_name(report.compared_backend) << ", pad_between_seqs=" << pbs << "): ";
    if (report.differences.empty()) {
      os << "every tile agrees\n";
    } else {
      os << report.differences.size() << " differing fields\n";
      const TePlanDifference* last = nullptr;
      for (const TePlanDifference& d : report.differences) {
        if (!last || last->pass != d.pass || last->rank != d.rank || last->step != d.step)
          os << "  " << pass_name(d.pass) << " rank " << d.rank << " step " << d.step << ":\n";
        os << "    " << std::left << std::setw(21) << d.field << std::right << " cpgold " << d.cpgold << " | TE " << d.te << "\n";
        last = &d;
      }
    }
  }
  os << "\nTE audit verdict (pad_between_seqs=" << pbs << "): "
     << (report.exact() ? "exact: every backend TE runs computes exactly the case's mask"
                        : "not exact: see the findings above (explain --te-audit exits 1)")
     << "\n";
  return os.str();
}

}  // namespace cpgold::sim
