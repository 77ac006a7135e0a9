// Which forward kernel serves a call: the sm_90a wgmma kernel on devices of compute capability 9.0 (every head-dim
// pair of the capability table), the mma.sync kernel elsewhere; an explicit request or CPGOLD_FORWARD_KERNEL picks one.
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>

#include "fixtures/gpu_table.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/attention_launch.hpp"

namespace cpgold::gpu {

std::string_view forward_kernel_name(ForwardKernel kernel) {
  switch (kernel) {
    case ForwardKernel::automatic: return "automatic";
    case ForwardKernel::mma_sync: return "mma.sync";
    case ForwardKernel::wgmma: return "wgmma";
  }
  return "?";
}

bool parse_forward_kernel(std::string_view text, ForwardKernel& kernel) {
  if (text == "auto" || text == "automatic") kernel = ForwardKernel::automatic;
  else if (text == "mma" || text == "mma.sync") kernel = ForwardKernel::mma_sync;
  else if (text == "wgmma") kernel = ForwardKernel::wgmma;
  else return false;
  return true;
}

bool wgmma_forward_serves(const AttentionShape& shape) {
#if CPGOLD_HAVE_SM90_FORWARD
  // Every pair of the capability table has a configuration (gpu/kernels/attention_sm90_launch.cuh).
  return (shape.dtype == DType::bf16 || shape.dtype == DType::fp16) &&
         fx::head_dims_in_gpu_table(shape.dim_qk, shape.dim_v);
#else
  (void)shape;
  return false;
#endif
}

Outcome choose_forward_kernel(const AttentionShape& shape, int cc, ForwardKernel requested, ForwardKernel& chosen) {
  const bool device_ok = cc == 90;  // sm_90a code runs on compute capability 9.0 only
  const bool serves = wgmma_forward_serves(shape);
  switch (requested) {
    case ForwardKernel::mma_sync: chosen = ForwardKernel::mma_sync; return {};
    case ForwardKernel::automatic: chosen = device_ok && serves ? ForwardKernel::wgmma : ForwardKernel::mma_sync; return {};
    case ForwardKernel::wgmma:
      if (!serves) {
#if CPGOLD_HAVE_SM90_FORWARD
        return {Status::unsupported, "the wgmma forward does not serve d_qk=" + std::to_string(shape.dim_qk) +
                                         ", d_v=" + std::to_string(shape.dim_v) + " (" +
                                         std::string(dtype_name(shape.dtype)) + ")"};
#else
        return {Status::unsupported, "the wgmma forward is not in this build (nvcc older than 12.3)"};
#endif
      }
      if (!device_ok)
        return {Status::unsupported, "the wgmma forward needs a device of compute capability 9.0 (sm_90a); this one is " +
                                         (cc == 0 ? std::string("absent") : std::to_string(cc / 10) + "." +
                                                                                std::to_string(cc % 10))};
      chosen = ForwardKernel::wgmma;
      return {};
  }
  return {Status::invalid_argument, "forward kernel request out of range"};
}

namespace detail {

// Compute capability of the current device (major * 10 + minor), read once per device index; 0 without one (also the
// backward's choice, backward_kernel.cpp).
int current_device_cc() {
  constexpr int kCached = 64;
  static std::array<std::atomic<int>, kCached> cache{};  // 0: not read yet; else cc + 1
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (device >= 0 && device < kCached) {
    if (const int c = cache[static_cast<size_t>(device)].load(std::memory_order_relaxed); c != 0) return c - 1;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const int cc = major * 10 + minor;
  if (device >= 0 && device < kCached) cache[static_cast<size_t>(device)].store(cc + 1, std::memory_order_relaxed);
  return cc;
}

}  // namespace detail

namespace {

// CPGOLD_FORWARD_KERNEL, read once: the request that replaces `automatic`.
struct EnvRequest {
  bool set = false, valid = true;
  ForwardKernel kernel = ForwardKernel::automatic;
  std::string text;
};
const EnvRequest& env_request() {
  static const EnvRequest request = [] {
    EnvRequest r;
    if (const char* v = std::getenv("CPGOLD_FORWARD_KERNEL"); v != nullptr && *v != '\0') {
      r.set = true;
      r.text = v;
      r.valid = parse_forward_kernel(r.text, r.kernel);
    }
    return r;
  }();
  return request;
}

}  // namespace

Outcome forward_kernel_for(const AttentionShape& shape, ForwardKernel requested, ForwardKernel& chosen) {
  if (requested == ForwardKernel::automatic) {
    const EnvRequest& env = env_request();
    if (env.set && !env.valid)
      return {Status::invalid_argument,
              "CPGOLD_FORWARD_KERNEL: value '" + env.text + "' is not one of auto, mma, wgmma"};
    if (env.set) requested = env.kernel;
  }
  return choose_forward_kernel(shape, detail::current_device_cc(), requested, chosen);
}

std::string forward_kernel_description(const AttentionShape& shape, ForwardKernel requested) {
  ForwardKernel chosen = ForwardKernel::mma_sync;
  if (Outcome o = forward_kernel_for(shape, requested, chosen); !o.ok()) return "unsupported: " + o.message;
  if (chosen == ForwardKernel::wgmma)
    return std::string("wgmma sm_90a (Q tile 128, key tile ") + (shape.dim_qk > 192 ? "64" : "128") +
           ", TMA, 2 consumer warpgroups ping-pong)";
  return "mma.sync (Q tile 64, key tile 64)";
}

}  // namespace cpgold::gpu
