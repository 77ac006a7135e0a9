#pragma once
// The GPU side of `cpgold verify`: runs the GPU non-CP path on a fixture's inputs, writes the outputs as a candidate
// file and checks it with the engine of `cpgold check`. Used by `cpgold verify` and `cpgold demo`.
#include <optional>
#include <string>

#include "fixtures/check.hpp"
#include "gpu/attention.hpp"

namespace cpgold::gpu {

enum class FixtureVerdict { pass, fail, unsupported };

struct FixtureVerification {
  FixtureVerdict verdict = FixtureVerdict::unsupported;
  std::string unsupported_reason;        // set when the case is outside the GPU capability table
  std::optional<fx::CheckReport> report;  // absent when unsupported
};

// candidate_path: where the GPU outputs are written (a global candidate: /o, /lse [h, t], /dq, /dk, /dv float32).
// Bad fixtures raise InputError (file and dataset named); a CUDA failure raises std::runtime_error.
FixtureVerification verify_fixture(const std::string& fixture_path, BackwardMode mode,
                                   const std::string& candidate_path);

}  // namespace cpgold::gpu
