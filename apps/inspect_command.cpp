// `cpgold inspect FILE`: the case, a layout summary, every tensor with shape and type, and the budgets.
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "apps/command_registry.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/schema/inputs_digest.hpp"

namespace cpgold::app {
namespace {

std::string ints(const std::vector<int32_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

int run_inspect(const std::string& path, bool verify) {
  const fx::h5::Reader reader(path);
  fx::OpenOptions options;
  options.verify_checksums = verify;
  const fx::FixtureFile fixture = fx::open_fixture(reader, options);
  std::printf("fixture   %s\n", path.c_str());
  std::printf("schema    %lld (%s)\n", static_cast<long long>(fixture.schema_version), fixture.generator.c_str());
  std::printf("case      %s\n", fixture.case_json.c_str());
  std::printf("isa level %s\n", fixture.isa_level.empty() ? "not stored (written before the attribute existed)"
                                                           : (fixture.isa_level + " (the generating build's instruction set)").c_str());
  // The engine that computed the oracle and the peers (fixtures/SCHEMA.md): no attribute, the CPU reference.
  if (reader.has_attribute("/case", "engine"))
    std::printf("engine    %s (%s)\n", reader.attr_string("/case", "engine").c_str(),
                reader.has_attribute("/case", "engine_versions")
                    ? reader.attr_string("/case", "engine_versions").c_str()
                    : "no engine_versions attribute");
  else
    std::printf("engine    cpu (the CPU reference, the reference of record)\n");
  std::printf("traced    %s\n", fixture.traced ? "yes" : "no");
  if (fixture.inputs_sha256.empty())
    std::printf("inputs    sha256 %s (computed: the file predates the inputs_sha256 attribute)\n",
                fx::inputs_sha256(reader).c_str());
  else
    std::printf("inputs    sha256 %s (%s)\n", fixture.inputs_sha256.c_str(),
                verify ? "verified against the stored inputs" : "not verified: --no-verify");
  if (fixture.inputs_source == "given")
    std::printf("          given (the tensors of a run, not drawn from the seed)%s\n",
                fixture.inputs_nonfinite_valid == 0
                    ? ""
                    : ("; FLAGGED: " + std::to_string(fixture.inputs_nonfinite_valid) +
                       " NaN or infinite value(s) in valid rows, accepted on request")
                          .c_str());
  else
    std::printf("          drawn from the seed %llu\n", static_cast<unsigned long long>(fixture.spec.seed));
  const int unchecked = static_cast<int>(fixture.without_checksum.size());
  if (verify)
    std::printf("checksums verified: %d dataset(s) with Fletcher32 read in full; %d empty dataset(s) hold no data and no "
                "checksum", fixture.datasets - unchecked, unchecked);
  else
    std::printf("checksums not verified (--no-verify); every non-empty dataset carries one; %d empty dataset(s) none",
                unchecked);
  for (int i = 0; i < std::min(unchecked, 8); ++i)
    std::printf("%s%s", i ? ", " : ": ", fixture.without_checksum[static_cast<size_t>(i)].c_str());
  std::printf("%s\n", unchecked > 8 ? (", and " + std::to_string(unchecked - 8) + " more").c_str() : "");
  std::printf("\nlayout: %d sequence(s), %lld q rows, %lld kv rows, cp_size %d (%s)\n", fixture.layout.batch(),
              static_cast<long long>(fixture.layout.q.total_rows), static_cast<long long>(fixture.layout.kv.total_rows),
              fixture.plan.cp_size, std::string(sim::comm_name(fixture.plan.comm)).c_str());
  std::printf("  cu_seqlens_q         %s\n", ints(fixture.layout.q.cu_seqlens).c_str());
  std::printf("  cu_seqlens_q_padded  %s\n", ints(fixture.layout.q.cu_seqlens_padded).c_str());
  std::printf("  cu_seqlens_kv        %s\n", ints(fixture.layout.kv.cu_seqlens).c_str());
  std::printf("  cu_seqlens_kv_padded %s\n", ints(fixture.layout.kv.cu_seqlens_padded).c_str());
  for (int r = 0; r < fixture.plan.cp_size; ++r)
    std::printf("  rank %d: %lld q rows, %lld kv rows, cu_seqlens_q on rank %s\n", r,
                static_cast<long long>(fixture.plan.partition.q.local_rows()),
                static_cast<long long>(fixture.plan.partition.kv.local_rows()),
                ints(fixture.plan.partition.q.cu_seqlens_on_rank(r, true, true)).c_str());
  std::printf("  steps: forward %d, backward %d\n", fixture.plan.forward.steps, fixture.plan.backward.steps);

  std::printf("\n%-34s %-8s %-18s\n", "dataset", "type", "shape");
  for (const fx::ExpectedDataset& d : fx::expected_datasets(fixture.spec, fixture.plan, fixture.traced, fixture.inputs_source == "given")) {
    if (d.path.find("/steps/") != std::string::npos && d.path.find("cu_seqlens") != std::string::npos) continue;
    std::printf("%-34s %-8s %-18s\n", d.path.c_str(), std::string(fx::h5::element_name(d.element)).c_str(),
                fx::h5::dims_text(d.dims).c_str());
  }
  std::printf("\nbudgets (max | mean): CP peer decides for per-rank and gathered candidates, the larger for global-only\n");
  std::printf("%-14s %-6s %11s %11s %11s %11s %11s %11s\n", "tensor", "prec", "atol", "cp max", "cp mean", "noncp max",
              "noncp mean", "compared");
  auto show = [&](const std::string& dataset) {
    std::printf("%-14s %-6s %11.3e %11.3e %11.3e %11.3e %11.3e %11lld\n", dataset.c_str(),
                reader.attr_string(dataset, fx::attr::check_precision).c_str(),
                reader.attr_double(dataset, fx::attr::atol), reader.attr_double(dataset, fx::attr::cp_max_budget),
                reader.attr_double(dataset, fx::attr::cp_mean_budget),
                reader.attr_double(dataset, fx::attr::non_cp_max_budget),
                reader.attr_double(dataset, fx::attr::non_cp_mean_budget),
                static_cast<long long>(reader.attr_int64(dataset, fx::attr::compared)));
  };
  for (fx::Quantity q : fx::kAllQuantities) show(fx::golden_path(q));
  for (int r = 0; r < fixture.plan.cp_size; ++r)
    for (fx::Quantity q : fx::kAllQuantities) show(fx::rank_output_path(r, q));
  return kExitPass;
}

const RegisterCommand registered("inspect", [](CLI::App& app) -> std::function<int()> {
  auto* sub = app.add_subcommand("inspect", "summary of a fixture: case, layout, tensors, budgets");
  auto path = std::make_shared<std::string>();
  auto no_verify = std::make_shared<bool>(false);
  sub->add_option("file", *path, "fixture file")->required();
  sub->add_flag("--no-verify", *no_verify, "skip reading every dataset for its checksum");
  return [=] { return run_inspect(*path, !*no_verify); };
});

}  // namespace
}  // namespace cpgold::app
