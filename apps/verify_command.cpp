// `cpgold verify FIXTURE... [--dump FILE] [--deterministic]`: runs the GPU non-CP path (gpu/attention.hpp) on each
// fixture's inputs and checks O, LSE, dQ, dK, dV with the engine of `cpgold check`, printing the same table.
// A fixture outside the GPU capability table is reported UNSUPPORTED with the reason, never passed.
// Exit codes: 0 every fixture passed; 1 a fixture failed or was unsupported; 2 unusable input or no GPU.
// `--dump FILE` (one fixture) writes the GPU outputs as a candidate file that `cpgold check` accepts.
#include <cstdio>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/command_registry.hpp"
#include "reference/input_error.hpp"

#if CPGOLD_HAVE_CUDA
#include "fixtures/check.hpp"
#include "fixtures/fixture_reader.hpp"
#include "fixtures/hdf5_file.hpp"
#include "gpu/attention.hpp"
#include "gpu/host_attention.hpp"
#include "sim/case_spec.hpp"
#endif

namespace cpgold::app {
namespace {

struct VerifyArgs {
  std::vector<std::string> fixtures;
  std::string dump;
  std::string format = "text";
  bool deterministic = false;
};

#if CPGOLD_HAVE_CUDA

enum class Verdict { pass, fail, unsupported };

// Writes a global candidate file (fixtures candidate layout: /o, /lse [h, t], /dq, /dk, /dv as float32).
void write_candidate(const std::string& path, const gpu::HostForward& fwd, const gpu::HostBackward& bwd) {
  fx::h5::Writer writer(path);
  writer.attribute("/", "scope", std::string("global"));
  writer.attribute("/", "producer", std::string("cpgold verify (GPU non-CP path)"));
  auto put = [&](const char* name, const Tensor3<float>& x) {
    writer.dataset(std::string("/") + name, {x.rows, x.heads, x.dim}, x.values.data(), fx::h5::Element::fp32);
  };
  put("o", fwd.o);
  writer.dataset("/lse", {fwd.lse.heads, fwd.lse.rows}, fwd.lse.values.data(), fx::h5::Element::fp32);
  put("dq", bwd.dq);
  put("dk", bwd.dk);
  put("dv", bwd.dv);
  writer.close();
}

Verdict verify_one(const std::string& path, const VerifyArgs& args, const std::string& dump_path) {
  const fx::h5::Reader reader(path);
  const fx::FixtureFile fixture = fx::open_fixture(reader, fx::OpenOptions{false});
  auto input = [&](const char* name) {
    const std::string dataset = std::string("/inputs/") + name;
    const fx::h5::DatasetInfo info = reader.info(dataset);
    if (info.dims.size() != 3) fail_input(reader.where(dataset), "expected a [t, h, d] tensor, found ", fx::h5::dims_text(info.dims));
    Tensor3<float> t(info.dims[0], info.dims[1], info.dims[2]);
    t.values = reader.read_float(dataset);
    return t;
  };
  const sim::CaseSpec& spec = fixture.spec;
  gpu::AttentionShape shape;
  shape.dtype = spec.dtype;
  shape.heads_q = spec.heads_q;
  shape.heads_kv = sim::heads_kv(spec);
  shape.dim_qk = spec.dim_qk;
  shape.dim_v = sim::dim_v(spec);
  if (const gpu::Outcome cap = gpu::check_capability(shape); !cap.ok()) {
    std::cout << "fixture    " << path << "\nUNSUPPORTED on the GPU (" << gpu::status_name(cap.status)
              << "): " << cap.message << "\n\n";
    return Verdict::unsupported;
  }
  const Tensor3<float> q = input("q"), k = input("k"), v = input("v"), dout = input("dout");
  const AttentionCall call = non_cp_call(fixture.layout, sim::mask_window(spec), sim::softmax_scale(spec));
  gpu::HostForward fwd;
  gpu::HostBackward bwd;
  gpu::Outcome run = gpu::forward_on_device(call, spec.dtype, q, k, v, fwd);
  if (run.ok())
    run = gpu::backward_on_device(call, spec.dtype, q, k, v, fwd.o, fwd.lse, dout,
                                  args.deterministic ? gpu::BackwardMode::deterministic : gpu::BackwardMode::atomic,
                                  bwd);
  if (run.status == gpu::Status::unsupported) {
    std::cout << "fixture    " << path << "\nUNSUPPORTED on the GPU: " << run.message << "\n\n";
    return Verdict::unsupported;
  }
  if (!run.ok()) throw std::runtime_error("GPU run on " + path + ": " + std::string(gpu::status_name(run.status)) + ": " + run.message);

  write_candidate(dump_path, fwd, bwd);
  const fx::CheckReport report = fx::check(path, {dump_path});
  if (args.format == "json") std::cout << fx::to_json(report).dump(2) << "\n";
  else std::cout << fx::render_text(report) << "\n";
  return report.pass() ? Verdict::pass : Verdict::fail;
}

int run_verify(const VerifyArgs& args) {
  if (args.format != "text" && args.format != "json") fail_input("--format", "expected text or json, got \"", args.format, "\"");
  if (!args.dump.empty() && args.fixtures.size() != 1)
    fail_input("--dump", "writes the outputs of one fixture; got ", args.fixtures.size(), " fixtures");
  if (gpu::cuda_device_count() == 0) fail_input("verify", "no CUDA device (the GPU path needs one)");
  int passed = 0, failed = 0, unsupported = 0;
  namespace fs = std::filesystem;
  for (const std::string& path : args.fixtures) {
    std::string dump = args.dump;
    bool temporary = false;
    if (dump.empty()) {
      dump = (fs::temp_directory_path() / ("cpgold-verify-" + std::to_string(::getpid()) + ".h5")).string();
      temporary = true;
    }
    Verdict verdict;
    try {
      verdict = verify_one(path, args, dump);
    } catch (...) {
      if (temporary) fs::remove(dump);
      throw;
    }
    if (temporary) fs::remove(dump);
    (verdict == Verdict::pass ? passed : verdict == Verdict::fail ? failed : unsupported) += 1;
  }
  std::printf("verify: %d passed, %d failed, %d unsupported (of %zu fixtures; backward mode %s)\n", passed, failed,
              unsupported, args.fixtures.size(), args.deterministic ? "deterministic" : "atomic");
  return failed == 0 && unsupported == 0 ? kExitPass : kExitFail;
}

#else

int run_verify(const VerifyArgs&) {
  fail_input("verify", "this cpgold was built without CUDA (no nvcc at configure time)");
}

#endif

const RegisterCommand registered("verify", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("verify", "run the GPU non-CP path on fixtures and check it like `cpgold check`");
  auto args = std::make_shared<VerifyArgs>();
  sub->add_option("fixtures", args->fixtures, "FIXTURE... (golden HDF5 files)")->required();
  sub->add_option("--dump", args->dump, "write the GPU outputs as a candidate file (one fixture)");
  sub->add_option("--format", args->format, "text or json");
  sub->add_flag("--deterministic", args->deterministic, "bitwise reproducible backward (dQ by a separate pass)");
  return [=] { return run_verify(*args); };
});

}  // namespace
}  // namespace cpgold::app
