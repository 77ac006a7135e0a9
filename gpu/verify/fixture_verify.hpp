#pragma once
// The GPU side of `cpgold verify`: runs the GPU non-CP path on a fixture's inputs, writes the outputs as a candidate
// file and checks it with the engine of `cpgold check`. Used by `cpgold verify` and `cpgold demo`.
#include <optional>
#include <string>

#include "gpu/cp/cp_executor.hpp"

#include "check/engine.hpp"
#include "fixtures/storage/hdf5_writer.hpp"
#include "gpu/kernels/attention/attention.hpp"

namespace cpgold::gpu {

// undecided: a fixture of another engine than the CPU reference cannot decide (fx::CheckReport::undecided).
enum class FixtureVerdict { pass, fail, undecided, unsupported };
FixtureVerdict verdict_of(const fx::CheckReport& report);

// Verdicts over the fixtures of one `cpgold verify`, and its exit status: 1 where one failed or was unsupported, else 5
// where one was undecided, else 0.
struct VerdictCounts {
  int passed = 0, failed = 0, undecided = 0, unsupported = 0;
  void add(FixtureVerdict verdict);
  std::string summary(size_t fixtures) const;  // "2 passed, 0 failed, 1 undecided, 0 unsupported (of 3 fixtures"
  int exit_code() const;
};

struct FixtureVerification {
  FixtureVerdict verdict = FixtureVerdict::unsupported;
  std::string unsupported_reason;        // set when the case is outside the GPU capability table
  std::optional<fx::CheckReport> report;  // absent when unsupported
  std::string forward_kernel;            // the forward kernel that ran (forward_kernel_description), when one ran
  std::string backward_kernel;           // the backward kernel that ran (backward_kernel_description), when one ran
};

// The fixture's /inputs (q, k, v, dout as [t, h, d] float), read through the caller's open handle; InputError naming
// the dataset for another shape.
sim::CaseInputs read_fixture_inputs(const fx::h5::Reader& reader);

// Writes o, dq, dk, dv ([t, h, d]) and lse ([h, t]) as float32 datasets under `group` ("" for the root) of a
// candidate file, the layout `cpgold check` reads.
void write_candidate_outputs(fx::h5::Writer& writer, const std::string& group, const Tensor3<float>& o,
                             const LseTensor<float>& lse, const Tensor3<float>& dq, const Tensor3<float>& dk,
                             const Tensor3<float>& dv);

// candidate_path: where the GPU outputs are written (a global candidate: /o, /lse [h, t], /dq, /dk, /dv float32).
// Bad fixtures raise InputError (file and dataset named); a CUDA failure raises std::runtime_error.
FixtureVerification verify_fixture(const std::string& fixture_path, BackwardMode mode,
                                   const std::string& candidate_path);

// `verify --backend local`: runs the fixture's comm type with W virtual ranks on one GPU (gpu/cp/cp_executor.hpp) from
// the fixture's own Plan and inputs, writes every rank's outputs (/ranks/<r>/...), the gathered outputs (scope
// cp_gathered) and, for a traced fixture, every step's partials (/ranks/<r>/steps/<s>/...) as one candidate file and
// checks it with the engine of `cpgold check`, so the report names the first wrong rank and step.
// inject: the checker's self-test (CpGpuOptions::inject). Exchange faults raise CommError (rank and operation).
FixtureVerification verify_fixture_local(const std::string& fixture_path, BackwardMode mode,
                                         const std::string& candidate_path, std::optional<StepRef> inject = {});

}  // namespace cpgold::gpu
