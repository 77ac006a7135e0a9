#pragma once
// The names ForwardKernel and BackwardKernel share, their one choice rule, and a kernel or schedule request read from
// an environment variable
// (CPGOLD_FORWARD_KERNEL, CPGOLD_BACKWARD_KERNEL, CPGOLD_FORWARD_SCHEDULE): read once, it replaces a call's
// `automatic` request; a value the parser rejects makes such a call fail with invalid_argument naming the variable and
// the value.
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "gpu/kernels/attention/attention.hpp"
#include "reference/enum_names.hpp"

namespace cpgold::gpu::detail {

// Names of the kernel choices ForwardKernel and BackwardKernel share, and the short spellings a parse accepts too.
template <class Kernel>
constexpr std::pair<Kernel, std::string_view> kKernelChoiceNames[] = {
    {Kernel::automatic, "automatic"}, {Kernel::mma_sync, "mma.sync"}, {Kernel::wgmma, "wgmma"}};
template <class Kernel>
constexpr std::pair<Kernel, std::string_view> kKernelChoiceShortNames[] = {{Kernel::automatic, "auto"},
                                                                           {Kernel::mma_sync, "mma"}};

template <class Kernel>
std::string_view kernel_choice_name(Kernel kernel) {
  return name_in(kKernelChoiceNames<Kernel>, kernel);
}

// auto/automatic, mma/mma.sync, wgmma; nullopt for anything else.
template <class Kernel>
std::optional<Kernel> parse_kernel_choice(std::string_view text) {
  if (auto kernel = parse_in(kKernelChoiceShortNames<Kernel>, text)) return kernel;
  return parse_in(kKernelChoiceNames<Kernel>, text);
}

// What a pass's wgmma kernel offers a call, for choose_kernel.
struct WgmmaOffer {
  std::string_view pass;         // "forward", "backward"
  bool in_build = false;         // compiled in (nvcc 12.3 or newer)
  bool serves = false;           // serves the call's dtype and head dims
  bool automatic = false;        // taken by an `automatic` request on a device of compute capability 9.0
  std::string_view served_note;  // appended to the refusal of a shape it does not serve
};

// The kernel that serves a request: mma.sync when asked for; the wgmma kernel when asked for (refused, never replaced,
// where it is not built, does not serve the shape or the device is not of compute capability 9.0, `cc` 0: none);
// `automatic`: the wgmma kernel where the offer says so and the device runs it, mma.sync otherwise.
template <class Kernel>
Outcome choose_kernel(const WgmmaOffer& offer, const AttentionShape& shape, int cc, Kernel requested, Kernel& chosen) {
  const bool device_ok = cc == 90;  // sm_90a code runs on compute capability 9.0 only
  const std::string pass(offer.pass);
  switch (requested) {
    case Kernel::mma_sync: chosen = Kernel::mma_sync; return {};
    case Kernel::automatic: chosen = device_ok && offer.automatic ? Kernel::wgmma : Kernel::mma_sync; return {};
    case Kernel::wgmma:
      if (!offer.in_build)
        return {Status::unsupported, "the wgmma " + pass + " is not in this build (nvcc older than 12.3)"};
      if (!offer.serves)
        return {Status::unsupported, "the wgmma " + pass + " does not serve d_qk=" + std::to_string(shape.dim_qk) +
                                         ", d_v=" + std::to_string(shape.dim_v) + " (" +
                                         std::string(dtype_name(shape.dtype)) + ")" + std::string(offer.served_note)};
      if (!device_ok)
        return {Status::unsupported,
                "the wgmma " + pass + " needs a device of compute capability 9.0 (sm_90a); this one is " +
                    (cc == 0 ? std::string("absent") : std::to_string(cc / 10) + "." + std::to_string(cc % 10))};
      chosen = Kernel::wgmma;
      return {};
  }
  return {Status::invalid_argument, pass + " kernel request out of range"};
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

// Replaces an `automatic` request by the value of `variable`, read by the first call that needs it and kept for the
// process (one variable for each Request type). `allowed` lists the accepted values for the error message.
template <class Request>
Outcome apply_env_request(const char* variable, std::optional<Request> (*parse)(std::string_view),
                          std::string_view allowed, Request& requested) {
  if (requested != Request::automatic) return {};
  static const EnvRequest<Request> env = read_env_request(variable, parse);
  if (env.set && !env.valid)
    return {Status::invalid_argument,
            std::string(env.variable) + ": value '" + env.text + "' is not one of " + std::string(allowed)};
  if (env.set) requested = env.value;
  return {};
}

}  // namespace cpgold::gpu::detail
