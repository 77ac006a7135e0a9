// The engine hook of the golden run without a GPU (reference/attention_engine.hpp, GenerateOptions::engine): an
// engine that counts its calls and computes them on the CPU reference gives the CPU fixture's every dataset bit for
// bit and is called for the oracle, the non-CP peer and every CP tile; a fixture and a part record a non-CPU engine
// (and its versions) and a CPU fixture's attributes stay as they were; merge refuses parts of different engines;
// `gen --engine` refuses gpu where no device or no GPU engine is (exit 2, nothing written) and says what auto chose.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "fixtures/golden/fixture_part.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "reference/attention_engine.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"
#ifdef CPGOLD_BINARY
#include "tests/fixtures/cli.hpp"
#endif

namespace cpgold::fx {
namespace {

// The CPU reference under another name, counting its calls (float64 and float32 apart).
class CountingEngine final : public AttentionEngine {
 public:
  explicit CountingEngine(std::string versions = "test versions 1") : versions_(std::move(versions)) {}
  std::string name() const override { return "counting"; }
  std::string versions() const override { return versions_; }
  ForwardResult<double> forward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                const Tensor3<double>& v, const KernelOptions& o) const override {
    ++calls64;
    return cpu_engine().forward(c, q, k, v, o);
  }
  BackwardResult<double> backward(const AttentionCall& c, const Tensor3<double>& q, const Tensor3<double>& k,
                                  const Tensor3<double>& v, const Tensor3<double>& o, const LseTensor<double>& l,
                                  const Tensor3<double>& d, const KernelOptions& opt) const override {
    ++calls64;
    return cpu_engine().backward(c, q, k, v, o, l, d, opt);
  }
  ForwardResult<float> forward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                               const Tensor3<float>& v, DType t, const KernelOptions& o) const override {
    ++calls32;
    return cpu_engine().forward(c, q, k, v, t, o);
  }
  BackwardResult<float> backward(const AttentionCall& c, const Tensor3<float>& q, const Tensor3<float>& k,
                                 const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& l,
                                 const Tensor3<float>& d, DType t, const KernelOptions& opt) const override {
    ++calls32;
    return cpu_engine().backward(c, q, k, v, o, l, d, t, opt);
  }
  mutable std::atomic<int> calls64{0}, calls32{0};

 private:
  std::string versions_;
};

const char* kCase = R"({"seqlens_q": [70, 33, 1], "heads_q": 4, "heads_kv": 2, "dim_qk": 16, "dtype": "bf16",
                        "mask": "causal", "cp_size": 2, "comm": "p2p"})";

std::filesystem::path temp(const std::string& name) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() / ("cpgold_engine_hook_" + name);
  std::filesystem::remove(p);
  return p;
}

TEST_CASE("engine hook: a counting engine on the CPU reference gives the CPU fixture bit for bit and is used throughout") {
  const sim::CaseSpec spec = sim::parse_case_text(kCase);
  CountingEngine engine;
  GenerateOptions options;
  options.engine = &engine;
  options.trace = true;
  GoldenRun with = generate(spec, options);
  GenerateOptions cpu_options;
  cpu_options.trace = true;
  GoldenRun without = generate(spec, cpu_options);
  CHECK(with.engine == "counting");
  CHECK(with.engine_versions == "test versions 1");
  CHECK(without.engine == "cpu");
  CHECK(without.engine_versions.empty());
  // The oracle's forward and backward and the CP oracle's (trace) computed tiles; the non-CP peer's two and the CP
  // peer's computed tiles.
  int tiles = 0;
  for (const sim::PassPlan* pass : {&with.plan.forward, &with.plan.backward})
    for (const sim::Tile& t : pass->tiles) tiles += t.computed ? 1 : 0;
  CHECK(tiles >= 8);
  CHECK(engine.calls64 == 2 + tiles);
  CHECK(engine.calls32 == 2 + tiles);
  for (Quantity q : kAllQuantities) {
    CHECK(with.golden(q).oracle == without.golden(q).oracle);
    CHECK(with.golden(q).peer == without.golden(q).peer);
  }
  // Written: every dataset the same; the engine attributes only in the fixture of the other engine.
  const std::filesystem::path a = temp("with.h5"), b = temp("without.h5");
  write_fixture(std::move(with), a.string(), {});
  write_fixture(std::move(without), b.string(), {});
  const h5::Reader ra(a.string()), rb(b.string());
  CHECK(ra.attr_string("/case", "engine") == "counting");
  CHECK(ra.attr_string("/case", "engine_versions") == "test versions 1");
  CHECK_FALSE(rb.has_attribute("/case", "engine"));
  CHECK_FALSE(rb.has_attribute("/case", "engine_versions"));
  std::vector<std::string> names_a = ra.attribute_names("/case"), names_b = rb.attribute_names("/case");
  std::erase(names_a, "engine");
  std::erase(names_a, "engine_versions");
  CHECK(names_a == names_b);
#ifdef CPGOLD_BINARY
  // `cpgold inspect` names the engine of each.
  const CliResult ia = run_cli("inspect " + a.string()), ib = run_cli("inspect " + b.string());
  CHECK(ia.code == 0);
  CHECK(ia.output.find("engine    counting (test versions 1)") != std::string::npos);
  CHECK(ib.code == 0);
  CHECK(ib.output.find("engine    cpu (the CPU reference") != std::string::npos);
#endif
  std::filesystem::remove(a);
  std::filesystem::remove(b);
}

TEST_CASE("engine hook: parts record their engine, the merged fixture keeps it, and parts of two engines are refused") {
  const sim::CaseSpec spec = sim::parse_case_text(kCase);
  CountingEngine one("v1"), other("v2");
  std::vector<std::string> parts;
  for (int i = 1; i <= 2; ++i) {
    GenerateOptions options;
    options.engine = &one;
    options.heads = shard_heads(spec, i, 2);
    const std::filesystem::path p = temp("part" + std::to_string(i) + ".h5");
    write_part(generate(spec, options), i, 2, p.string());
    parts.push_back(p.string());
  }
  const std::filesystem::path merged = temp("merged.h5");
  merge_parts(parts, merged.string(), {});
  {
    const h5::Reader r(merged.string());
    CHECK(r.attr_string("/case", "engine") == "counting");
    CHECK(r.attr_string("/case", "engine_versions") == "v1");
  }
  // The second part again, from an engine of other versions: refused before anything is written.
  GenerateOptions options;
  options.engine = &other;
  options.heads = shard_heads(spec, 2, 2);
  const std::filesystem::path odd = temp("part2_other.h5"), refused = temp("refused.h5");
  write_part(generate(spec, options), 2, 2, odd.string());
  try {
    merge_parts({parts[0], odd.string()}, refused.string(), {});
    FAIL("merge of parts of two engines went through");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("engine_versions") != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists(refused));
  for (const std::string& p : parts) std::filesystem::remove(p);
  std::filesystem::remove(odd);
  std::filesystem::remove(merged);
}

#ifdef CPGOLD_BINARY

TEST_CASE("gen --engine: gpu without a GPU engine or device is refused (exit 2, nothing written), auto says which") {
  const std::filesystem::path out = temp("cli.h5");
  const std::string flags = "gen --seqlens-q 40 --heads-q 2 --cp-size 2 -o " + out.string();
  const CliResult gpu = run_cli(flags + " --engine gpu");
  if (gpu.code == 0) {  // a command line with the GPU engine on a machine with a device
    const h5::Reader r(out.string());
    CHECK(r.attr_string("/case", "engine") == "gpu");
    std::filesystem::remove(out);
  } else {
    CHECK(gpu.code == 2);
    CHECK(gpu.output.find("--engine: gpu: ") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(out));
  }
  const CliResult bad = run_cli(flags + " --engine tpu");
  CHECK(bad.code == 2);
  CHECK(bad.output.find("--engine: value \"tpu\" is not cpu, gpu or auto") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(out));
  const CliResult autoc = run_cli(flags + " --engine auto");
  CHECK(autoc.code == 0);
  CHECK(autoc.output.find("engine: ") != std::string::npos);
  REQUIRE(std::filesystem::exists(out));
  // Whichever engine auto chose, the fixture says so: cpu writes no engine attribute.
  const h5::Reader r(out.string());
  if (autoc.output.find("engine: cpu") != std::string::npos) CHECK_FALSE(r.has_attribute("/case", "engine"));
  else CHECK(r.attr_string("/case", "engine") == "gpu");
  std::filesystem::remove(out);
}
#endif

}  // namespace
}  // namespace cpgold::fx
