// `cpgold demo`: the main job. Runs what the build has on built-in cases and prints one verdict per check.
#include <omp.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <filesystem>
#include <unistd.h>

#include "apps/command_registry.hpp"
#include "check/engine.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "fixtures/golden/suites.hpp"
#include "reference/attention.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_inputs.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/program/executor.hpp"

#if CPGOLD_HAVE_CUDA
#include "gpu/verify/fixture_verify.hpp"
#endif

namespace cpgold::app {
namespace {

// Built-in cases: padding between sequences, zero-length and length-1 sequences, tail rows, NaN in every pad row,
// GQA, MLA, windows that cross tile edges, L_q != L_kv.
const char* const kDemoCases[] = {
    R"({"seqlens_q":[5,0,113,1,64],"padded_q":[8,4,128,8,64],"total_tokens_q":220,"heads_q":8,"heads_kv":2,)"
    R"("dim_qk":128,"mask":"causal","dtype":"bf16","pad_fill":"nan","seed":1})",
    R"({"seqlens_q":[203,17,65],"padded_q":[208,24,72],"heads_q":4,"heads_kv":4,"dim_qk":192,"dim_v":128,)"
    R"("mask":"causal","window":[37,0],"dtype":"fp16","pad_fill":"inf","seed":2})",
    R"({"seqlens_q":[40,0,9],"seqlens_kv":[70,3,0],"padded_q":[48,2,16],"padded_kv":[72,8,4],"heads_q":4,)"
    R"("heads_kv":1,"dim_qk":64,"mask":"none","window":[12,5],"dtype":"bf16","pad_fill":"nan","seed":3})",
};

struct Row {
  std::string check;
  std::string value;
  bool pass;
};

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

Tensor3<double> widen(const Tensor3<float>& x) { return tensor_cast<double>(x); }

template <class T>
bool pad_rows_zero(const Tensor3<T>& x, const PackedSequences& seqs) {
  for (int64_t r = 0; r < x.rows; ++r) {
    if (seqs.is_valid_row(r)) continue;
    for (int64_t i = 0; i < x.row_stride(); ++i)
      if (x.values[r * x.row_stride() + i] != T(0)) return false;
  }
  return true;
}

template <class T>
bool all_finite(const std::vector<T>& v) {
  for (T x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// max|x - oracle| / max|oracle| over finite oracle entries; where the oracle is infinite (LSE of a row with no
// visible key) x must be equal, else the error is +inf.
template <class T>
double relative_error(const std::vector<T>& x, const std::vector<double>& oracle) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < oracle.size(); ++i) {
    if (!std::isfinite(oracle[i])) {
      if (static_cast<double>(x[i]) != oracle[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    err = std::max(err, std::fabs(x[i] - oracle[i]));
    scale = std::max(scale, std::fabs(oracle[i]));
  }
  return scale == 0 ? err : err / scale;
}

std::string fmt(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.3g", x);
  return buffer;
}

struct Oracle {
  ForwardResult<double> fwd;
  BackwardResult<double> bwd;
};

Oracle run_oracle(const AttentionCall& call, const sim::CaseInputs& in) {
  Oracle r;
  const Tensor3<double> q = widen(in.q), k = widen(in.k), v = widen(in.v);
  r.fwd = attention_forward(call, q, k, v);
  r.bwd = attention_backward(call, q, k, v, r.fwd.o, r.fwd.lse, widen(in.dout));
  return r;
}

std::vector<Row> reference_checks(const sim::CaseSpec& spec) {
  std::vector<Row> rows;
  const ThdLayout layout = sim::layout(spec);
  const AttentionCall call = non_cp_call(layout, sim::mask_window(spec), sim::softmax_scale(spec));
  const sim::CaseInputs inputs = sim::make_case_inputs(spec);
  const Oracle oracle = run_oracle(call, inputs);

  const bool pads = pad_rows_zero(oracle.fwd.o, layout.q) && pad_rows_zero(oracle.bwd.dq, layout.q) &&
                    pad_rows_zero(oracle.bwd.dk, layout.kv) && pad_rows_zero(oracle.bwd.dv, layout.kv);
  rows.push_back({"oracle pad rows of O, dQ, dK, dV exactly 0", pads ? "yes" : "no", pads});
  const bool finite = all_finite(oracle.fwd.o.values) && all_finite(oracle.bwd.dq.values) &&
                      all_finite(oracle.bwd.dk.values) && all_finite(oracle.bwd.dv.values);
  rows.push_back({"oracle O, dQ, dK, dV finite everywhere", finite ? "yes" : "no", finite});

  sim::CaseSpec clean_spec = spec;
  clean_spec.pad_fill = sim::PadFill::zero;
  const Oracle clean = run_oracle(call, sim::make_case_inputs(clean_spec));
  const bool poison = bitwise_equal(clean.fwd.o.values, oracle.fwd.o.values) &&
                      bitwise_equal(clean.fwd.lse.values, oracle.fwd.lse.values) &&
                      bitwise_equal(clean.bwd.dq.values, oracle.bwd.dq.values) &&
                      bitwise_equal(clean.bwd.dk.values, oracle.bwd.dk.values) &&
                      bitwise_equal(clean.bwd.dv.values, oracle.bwd.dv.values);
  rows.push_back({std::string("pad fill '") + std::string(sim::pad_fill_name(spec.pad_fill)) +
                      "' vs zero pads: outputs bitwise equal",
                  poison ? "yes" : "no", poison});

  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Oracle single = run_oracle(call, inputs);
  omp_set_num_threads(threads);
  const bool deterministic = bitwise_equal(single.fwd.o.values, oracle.fwd.o.values) &&
                             bitwise_equal(single.bwd.dq.values, oracle.bwd.dq.values) &&
                             bitwise_equal(single.bwd.dk.values, oracle.bwd.dk.values);
  rows.push_back({"1 thread vs " + std::to_string(threads) + " threads bitwise equal", deterministic ? "yes" : "no",
                  deterministic});

  const auto peer_fwd = attention_forward(call, inputs.q, inputs.k, inputs.v, spec.dtype);
  const auto peer_bwd = attention_backward(call, inputs.q, inputs.k, inputs.v, peer_fwd.o, peer_fwd.lse,
                                           inputs.dout, spec.dtype);
  // The peer's error is rounding only: of the order of the dtype's unit roundoff, never zero for bf16/fp16.
  const double unit = spec.dtype == DType::bf16 ? 0x1p-8 : spec.dtype == DType::fp16 ? 0x1p-11 : 0x1p-24;
  const double o_err = relative_error(peer_fwd.o.values, oracle.fwd.o.values);
  const double grad_err = std::max({relative_error(peer_bwd.dq.values, oracle.bwd.dq.values),
                                    relative_error(peer_bwd.dk.values, oracle.bwd.dk.values),
                                    relative_error(peer_bwd.dv.values, oracle.bwd.dv.values)});
  rows.push_back({"peer vs oracle: O relative max error (unit roundoff " + fmt(unit) + ")", fmt(o_err),
                  o_err > 0 && o_err < 8 * unit});
  rows.push_back({"peer vs oracle: dQ/dK/dV relative max error", fmt(grad_err), grad_err > 0 && grad_err < 32 * unit});
  double lse_err = 0;
  bool lse_empty_rows_match = true;
  for (size_t i = 0; i < oracle.fwd.lse.values.size(); ++i) {
    const double o = oracle.fwd.lse.values[i];
    const float p = peer_fwd.lse.values[i];
    if (std::isfinite(o))
      lse_err = std::max(lse_err, std::fabs(p - o));
    else if (p != -std::numeric_limits<float>::infinity())
      lse_empty_rows_match = false;
  }
  rows.push_back({"peer vs oracle: LSE max abs error (float32)", fmt(lse_err), lse_err < 1e-4});
  rows.push_back({"rows with no visible key: LSE -inf in both", lse_empty_rows_match ? "yes" : "no",
                  lse_empty_rows_match});
  return rows;
}

// Largest relative error of the float64 CP simulation (gathered) against the non-CP float64 oracle, over the five
// outputs; LSE rows at -inf must agree exactly (else +inf is returned).
double cp_oracle_error(const fx::GoldenRun& run, const sim::CaseInputs& inputs) {
  const sim::CpRun<double> cp = sim::run_cp_oracle(run.plan, inputs, sim::ExecutorOptions{.backward = true, .record_trace = false});
  const sim::GlobalOutputs<double> global = sim::gather_outputs(run.plan, cp.ranks);
  return std::max({relative_error(global.o.values, run.o.oracle), relative_error(global.lse.values, run.lse.oracle),
                   relative_error(global.dq.values, run.dq.oracle), relative_error(global.dk.values, run.dk.oracle),
                   relative_error(global.dv.values, run.dv.oracle)});
}

struct SuiteRow {
  std::string name;
  std::string path;  // the fixture
  std::string comm;
  bool cp_ok;
  double cp_error;
  bool self_ok;
  double worst_ratio;       // max over tensors and ranks of error / deciding limit (max or mean)
  std::string worst_where;  // which tensor/rank decided it
};

// Generates the quick suite into `folder`, checks the float64 CP simulation of every case against the oracle and
// runs `check --self` on every fixture.
std::vector<SuiteRow> suite_checks(const std::filesystem::path& folder) {
  std::vector<SuiteRow> rows;
  const auto cases = fx::suite_cases("quick");
  int index = 0;
  for (const fx::SuiteCase& c : cases) {
    std::fprintf(stderr, "  [%d/%zu] %s\n", ++index, cases.size(), c.name.c_str());
    const fx::GoldenRun run = fx::generate(c.spec);
    const std::string path = (folder / (c.name + ".h5")).string();
    fx::write_fixture(run, path, fx::WriteOptions{true, -1});
    SuiteRow row;
    row.name = c.name;
    row.path = path;
    row.comm = std::string(sim::comm_name(c.spec.comm)) + " W=" + std::to_string(c.spec.cp_size);
    row.cp_error = cp_oracle_error(run, sim::make_case_inputs(c.spec));
    row.cp_ok = row.cp_error <= 1e-12;
    const fx::CheckReport report = fx::self_check(path);
    row.self_ok = report.pass();
    row.worst_ratio = 0;
    for (const fx::TensorResult& r : report.results) {
      const double ratio = std::max(r.evaluation.max_ratio, r.evaluation.mean_ratio);
      if (ratio >= row.worst_ratio) {
        row.worst_ratio = ratio;
        row.worst_where = r.tensor + (r.rank >= 0 ? " rank " + std::to_string(r.rank) : " global");
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// Section 3: cpgold's CUDA kernels on the quick suite's fixtures, both backward modes, when the build and the machine
// have them. Unsupported fixtures (outside the GPU capability table) are listed, never counted as passed.
void gpu_checks(const std::vector<SuiteRow>& rows, const std::filesystem::path& folder, int& total, int& failures,
                int& unsupported) {
#if CPGOLD_HAVE_CUDA
  if (gpu::cuda_device_count() == 0) {
    std::printf("\n3. cpgold's CUDA kernels on the quick suite: SKIPPED: no CUDA device\n");
    return;
  }
  std::printf("\n3. cpgold's CUDA kernels (non-CP path) on the quick suite, checked like `cpgold verify`\n\n");
  std::printf("| case | backward | worst ratio (where) | verdict |\n|---|---|---|---|\n");
  for (const SuiteRow& row : rows) {
    for (const gpu::BackwardMode mode : {gpu::BackwardMode::atomic, gpu::BackwardMode::deterministic}) {
      const char* mode_name = mode == gpu::BackwardMode::atomic ? "atomic" : "deterministic";
      const gpu::FixtureVerification v = gpu::verify_fixture(row.path, mode, (folder / (row.name + ".gpu.h5")).string());
      if (v.verdict == gpu::FixtureVerdict::unsupported) {
        std::printf("| %s | %s | %s | UNSUPPORTED |\n", row.name.c_str(), mode_name, v.unsupported_reason.c_str());
        ++unsupported;
        continue;
      }
      double worst = 0;
      std::string where;
      for (const fx::TensorResult& r : v.report->results) {
        const double ratio = std::max(r.evaluation.max_ratio, r.evaluation.mean_ratio);
        if (ratio >= worst) worst = ratio, where = r.tensor;
      }
      const bool pass = v.verdict == gpu::FixtureVerdict::pass;
      std::printf("| %s | %s | %.3f (%s) | %s |\n", row.name.c_str(), mode_name, worst, where.c_str(),
                  pass ? "PASS" : "FAIL");
      ++total;
      failures += pass ? 0 : 1;
    }
  }
#else
  (void)rows, (void)folder, (void)total, (void)failures, (void)unsupported;
  std::printf("\n3. cpgold's CUDA kernels: not in this build (no nvcc, or no GPU found, at configure time; -DCPGOLD_ENABLE_CUDA=ON builds them in)\n");
#endif
}

int run_demo(const std::string& keep_folder) {
  const auto start = std::chrono::steady_clock::now();
  int failures = 0, total = 0;
  std::printf("cpgold %s demo\n\n1. Exact CPU reference on %zu built-in THD cases\n", CPGOLD_VERSION,
              sizeof kDemoCases / sizeof kDemoCases[0]);
  int index = 0;
  for (const char* text : kDemoCases) {
    const sim::CaseSpec spec = sim::parse_case_text(text);
    std::printf("\ncase %d: %s\n", ++index, sim::normalized_json(spec).c_str());
    for (const Row& row : reference_checks(spec)) {
      std::printf("  %-64s %-10s %s\n", row.check.c_str(), row.value.c_str(), row.pass ? "PASS" : "FAIL");
      ++total;
      failures += row.pass ? 0 : 1;
    }
  }

  std::filesystem::path folder;
  if (!keep_folder.empty()) {
    folder = keep_folder;
    std::filesystem::create_directories(folder);
  } else {  // a private folder of this process (mkdtemp): nothing of another user's is followed or removed
    std::string scratch = (std::filesystem::temp_directory_path() / "cpgold-demo-XXXXXX").string();
    if (!::mkdtemp(scratch.data())) fail_input(scratch, "cannot create a temporary folder (", std::strerror(errno), ")");
    folder = scratch;
  }
  std::printf("\n2. The quick suite: fixtures in %s, the float64 CP simulation against the non-CP oracle "
              "(limit 1e-12 relative),\n   and `cpgold check --self` (the CP simulator in the case dtype with another "
              "order of operations, checked per rank and gathered;\n   ratio = error / deciding budget, pass <= 1)\n\n",
              folder.string().c_str());
  const std::vector<SuiteRow> rows = suite_checks(folder);
  std::printf("| case | comm | CP f64 vs oracle | verdict | self-check worst ratio (where) | verdict |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const SuiteRow& row : rows) {
    std::printf("| %s | %s | %s | %s | %.3f (%s) | %s |\n", row.name.c_str(), row.comm.c_str(),
                fmt(row.cp_error).c_str(), row.cp_ok ? "PASS" : "FAIL", row.worst_ratio, row.worst_where.c_str(),
                row.self_ok ? "PASS" : "FAIL");
    total += 2;
    failures += (row.cp_ok ? 0 : 1) + (row.self_ok ? 0 : 1);
  }
  int unsupported = 0;
  gpu_checks(rows, folder, total, failures, unsupported);
  if (keep_folder.empty()) std::filesystem::remove_all(folder);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\ndemo: %d passed, %d failed", total - failures, failures);
  if (unsupported > 0) std::printf(", %d unsupported on the GPU (outside its capability table)", unsupported);
  std::printf(" (%.1f s)\n", seconds);
  return failures == 0 ? kExitPass : kExitFail;
}

const RegisterCommand registration{"demo", [](CLI::App& app) {
  auto* sub = app.add_subcommand("demo",
                                 "Run what the build has on built-in cases and print the verdicts: reference self-checks, "
                                 "the quick suite (CP simulation vs oracle, check --self) and, with a GPU, the CUDA "
                                 "kernels");
  auto keep = std::make_shared<std::string>();
  sub->add_option("--keep", *keep, "Write the quick suite's fixtures to this folder and keep them");
  return std::function<int()>([keep] { return run_demo(*keep); });
}};

}  // namespace
}  // namespace cpgold::app
