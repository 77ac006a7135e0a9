// Writes what the parity test of the Python extension (python/tests/test_parity.py) checks both ways: for every case
// of a suite, its fixture (NAME.h5), the FlashAttention-2 emulation's outputs as a candidate (NAME.ok.h5) and a wrong
// twin's (NAME.bug.h5, one of the emulation's bugs, taken in turn), each with global outputs at the root and every
// rank's under /ranks/<r>/ (tests/fixtures/flash2_emulation.hpp).
//   emulation_candidates SUITE FOLDER [NAME...]      (NAME...: only these cases of the suite)
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "fixtures/storage/hdf5_writer.hpp"
#include "fixtures/golden/suites.hpp"
#include "tests/fixtures/flash2_emulation.hpp"

using namespace cpgold;
using namespace cpgold::fx;
using namespace cpgold::fx::testing;

namespace {

void write_outputs(h5::Writer& writer, const std::string& group, const Flash2Outputs& out, DType dtype) {
  const h5::Element element = h5::element_of(dtype);
  auto dims = [](const Tensor3<float>& t) { return std::vector<int64_t>{t.rows, t.heads, t.dim}; };
  writer.dataset(group + "/o", dims(out.o), out.o.values.data(), element);
  writer.dataset(group + "/lse", {out.lse.heads, out.lse.rows}, out.lse.values.data(), h5::Element::fp32);
  writer.dataset(group + "/dq", dims(out.dq), out.dq.values.data(), element);
  writer.dataset(group + "/dk", dims(out.dk), out.dk.values.data(), element);
  writer.dataset(group + "/dv", dims(out.dv), out.dv.values.data(), element);
}

void write_candidate(const std::string& path, const sim::Plan& plan, const Flash2Outputs& global, DType dtype) {
  h5::Writer writer(path);
  write_outputs(writer, "", global, dtype);
  writer.group("/ranks");
  for (int r = 0; r < plan.cp_size; ++r) {
    writer.group("/ranks/" + std::to_string(r));
    write_outputs(writer, "/ranks/" + std::to_string(r), flash2_rank_shard(plan, r, global), dtype);
  }
  writer.close();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: emulation_candidates SUITE FOLDER [NAME...]\n");
    return 2;
  }
  try {
    const std::string folder = argv[2];
    const std::vector<std::string> only(argv + 3, argv + argc);
    const Flash2Bug bugs[] = {Flash2Bug::missing_rescale, Flash2Bug::causal_off_by_one,
                              Flash2Bug::lse_natural_log_of_exp2_max};
    int index = 0;
    for (const SuiteCase& c : suite_cases(argv[1])) {
      const Flash2Bug bug = bugs[index++ % 3];
      if (!only.empty() && std::find(only.begin(), only.end(), c.name) == only.end()) continue;
      const GoldenRun run = generate(c.spec);
      WriteOptions force;
      force.force = true;
      write_fixture(run, folder + "/" + c.name + ".h5", force);
      const sim::CaseInputs inputs = sim::make_case_inputs(c.spec);
      write_candidate(folder + "/" + c.name + ".ok.h5", run.plan, flash2_attention(c.spec, inputs), c.spec.dtype);
      Flash2Options wrong;
      wrong.bug = bug;
      write_candidate(folder + "/" + c.name + ".bug.h5", run.plan, flash2_attention(c.spec, inputs, wrong), c.spec.dtype);
      std::printf("%s %s\n", c.name.c_str(), std::string(flash2_bug_name(bug)).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulation_candidates: %s\n", e.what());
    return 2;
  }
  return 0;
}
