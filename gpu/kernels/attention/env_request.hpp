#pragma once
// The names ForwardKernel and BackwardKernel share, and a kernel or schedule request read from an environment variable
// (CPGOLD_FORWARD_KERNEL, CPGOLD_BACKWARD_KERNEL, CPGOLD_FORWARD_SCHEDULE): read once, it replaces a call's
// `automatic` request; a value the parser rejects makes such a call fail with invalid_argument naming the variable and
// the value.
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "gpu/kernels/attention/attention.hpp"

namespace cpgold::gpu::detail {

// Names of the kernel choices ForwardKernel and BackwardKernel share.
template <class Kernel>
std::string_view kernel_choice_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::automatic: return "automatic";
    case Kernel::mma_sync: return "mma.sync";
    case Kernel::wgmma: return "wgmma";
  }
  return "?";
}

// auto/automatic, mma/mma.sync, wgmma; nullopt for anything else.
template <class Kernel>
std::optional<Kernel> parse_kernel_choice(std::string_view text) {
  if (text == "auto" || text == "automatic") return Kernel::automatic;
  if (text == "mma" || text == "mma.sync") return Kernel::mma_sync;
  if (text == "wgmma") return Kernel::wgmma;
  return std::nullopt;
}

template <class Request>
struct EnvRequest {
  const char* variable = nullptr;
  bool set = false, valid = true;
  Request value = Request::automatic;
  std::string text;
};

// Reads `variable` now; unset or empty leaves `set` false.
template <class Request>
EnvRequest<Request> read_env_request(const char* variable, std::optional<Request> (*parse)(std::string_view)) {
  EnvRequest<Request> r;
  r.variable = variable;
  if (const char* v = std::getenv(variable); v != nullptr && *v != '\0') {
    r.set = true;
    r.text = v;
    const std::optional<Request> parsed = parse(r.text);
    r.valid = parsed.has_value();
    if (parsed) r.value = *parsed;
  }
  return r;
}

// Replaces an `automatic` request by the variable's value; `read_once` (holding the EnvRequest read on first use) is
// called only then. `allowed` lists the accepted values for the error message.
template <class Request>
Outcome apply_env_request(const EnvRequest<Request>& (*read_once)(), std::string_view allowed, Request& requested) {
  if (requested != Request::automatic) return {};
  const EnvRequest<Request>& env = read_once();
  if (env.set && !env.valid)
    return {Status::invalid_argument,
            std::string(env.variable) + ": value '" + env.text + "' is not one of " + std::string(allowed)};
  if (env.set) requested = env.value;
  return {};
}

}  // namespace cpgold::gpu::detail
