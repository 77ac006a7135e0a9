// Which forward kernel serves a call: the sm_90a wgmma kernel on devices of compute capability 9.0 (every head-dim
// pair of the capability table), the mma.sync kernel elsewhere; an explicit request or CPGOLD_FORWARD_KERNEL picks one.
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <string>

#include "sim/case/gpu_table.hpp"
#include "gpu/kernels/attention/attention.hpp"
#include "gpu/kernels/attention/attention_launch.hpp"
#include "gpu/kernels/attention/env_request.hpp"
#include "reference/enum_names.hpp"

namespace cpgold::gpu {

std::string_view forward_kernel_name(ForwardKernel kernel) { return detail::kernel_choice_name(kernel); }

std::optional<ForwardKernel> parse_forward_kernel(std::string_view text) {
  return detail::parse_kernel_choice<ForwardKernel>(text);
}

bool wgmma_forward_serves(const AttentionShape& shape) {
  // Every pair of the capability table has a configuration (gpu/kernels/sm90/attention_sm90_launch.cuh) in builds
  // that have it.
  return CPGOLD_HAVE_SM90_FORWARD && (shape.dtype == DType::bf16 || shape.dtype == DType::fp16) &&
         sim::head_dims_in_gpu_table(shape.dim_qk, shape.dim_v);
}

Outcome choose_forward_kernel(const AttentionShape& shape, int cc, ForwardKernel requested, ForwardKernel& chosen) {
  const bool serves = wgmma_forward_serves(shape);
  return detail::choose_kernel({"forward", CPGOLD_HAVE_SM90_FORWARD != 0, serves, serves, ""}, shape, cc, requested,
                               chosen);
}

namespace detail {

namespace {

constexpr int kCachedDevices = 64;
using DeviceCache = std::array<std::atomic<int>, kCachedDevices>;  // per device index; 0: not read yet; else value + 1

// One value of the current device, read by `read(device, value)` once per device index; `fallback` (not cached) when
// there is no current device or `read` fails.
template <class Read>
int cached_device_value(DeviceCache& cache, int fallback, Read read) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fallback;
  }
  if (device >= 0 && device < kCachedDevices) {
    if (const int c = cache[static_cast<size_t>(device)].load(std::memory_order_relaxed); c != 0) return c - 1;
  }
  int value = 0;
  if (!read(device, value)) {
    cudaGetLastError();
    return fallback;
  }
  if (device >= 0 && device < kCachedDevices)
    cache[static_cast<size_t>(device)].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace

// Compute capability of the current device (major * 10 + minor), read once per device index; 0 without one (also the
// backward's choice, backward_kernel.cpp).
int current_device_cc() {
  static DeviceCache cache{};
  return cached_device_value(cache, 0, [](int device, int& cc) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return false;
    cc = major * 10 + minor;
    return true;
  });
}

int current_device_sm_count() {
  static DeviceCache cache{};
  return cached_device_value(cache, 1, [](int device, int& sms) {
    return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess && sms > 0;
  });
}

}  // namespace detail

Outcome forward_kernel_for(const AttentionShape& shape, ForwardKernel requested, ForwardKernel& chosen) {
  Outcome o = detail::apply_env_request("CPGOLD_FORWARD_KERNEL", parse_forward_kernel, "auto, mma, wgmma", requested);
  if (!o.ok()) return o;
  return choose_forward_kernel(shape, detail::current_device_cc(), requested, chosen);
}

constexpr std::pair<ForwardSchedule, std::string_view> kScheduleNames[] = {
    {ForwardSchedule::automatic, "auto"}, {ForwardSchedule::tile128, "tile128"}, {ForwardSchedule::tile64, "tile64"},
    {ForwardSchedule::persistent, "persistent"}, {ForwardSchedule::persistent128, "persistent128"},
    {ForwardSchedule::persistent64, "persistent64"}};

std::string_view forward_schedule_name(ForwardSchedule schedule) { return name_in(kScheduleNames, schedule); }

std::optional<ForwardSchedule> parse_forward_schedule(std::string_view text) {
  if (text == "automatic") return ForwardSchedule::automatic;
  return parse_in(kScheduleNames, text);
}

bool wgmma_short_schedules_serve(const AttentionShape& shape) { return shape.dim_qk <= 192; }

namespace {

// CPGOLD_FORWARD_SCHEDULE: the schedule that replaces `automatic`.
Outcome env_schedule_request(ForwardSchedule& requested) {
  return detail::apply_env_request("CPGOLD_FORWARD_SCHEDULE", parse_forward_schedule,
                                   "auto, tile128, tile64, persistent, persistent128, persistent64", requested);
}

}  // namespace

Outcome forward_schedule_for(const AttentionPlan& plan, ForwardSchedule requested, ForwardScheduleChoice& chosen) {
  const AttentionPlan::Impl* impl = plan.impl();
  if (impl == nullptr) return {Status::invalid_argument, "forward schedule: the plan was not built"};
  if (Outcome o = env_schedule_request(requested); !o.ok()) return o;
  const bool small_ok = wgmma_short_schedules_serve(impl->shape);
  // The padding-waste rule: 64-row tiles where the 128-row tiles compute more than kSmallTileAreaFactor times the
  // score area (rows past short segments' ends, masked parts of key blocks on the diagonal).
  const bool rule_small = small_ok && impl->q_area_large > kSmallTileAreaFactor * impl->q_area_small;
  switch (requested) {
    case ForwardSchedule::automatic: chosen = {rule_small ? 64 : 128, rule_small}; break;
    case ForwardSchedule::tile128: chosen = {128, false}; break;
    case ForwardSchedule::tile64: chosen = {small_ok ? 64 : 128, false}; break;
    case ForwardSchedule::persistent: chosen = {rule_small ? 64 : 128, true}; break;
    case ForwardSchedule::persistent128: chosen = {128, true}; break;
    case ForwardSchedule::persistent64: chosen = {small_ok ? 64 : 128, true}; break;
    default: return {Status::invalid_argument, "forward schedule request out of range"};
  }
  if (!small_ok) chosen = {128, false};
  return {};
}

std::string forward_kernel_description(const AttentionShape& shape, ForwardKernel requested) {
  ForwardKernel chosen = ForwardKernel::mma_sync;
  if (Outcome o = forward_kernel_for(shape, requested, chosen); !o.ok()) return "unsupported: " + o.message;
  if (chosen == ForwardKernel::wgmma) {
    ForwardSchedule sched = ForwardSchedule::automatic;
    if (Outcome o = env_schedule_request(sched); !o.ok()) return "unsupported: " + o.message;
    const std::string large = std::string("Q tile 128 (key tile ") + (shape.dim_qk > 192 ? "64" : "128") +
                              ", 2 consumer warpgroups ping-pong)";
    const std::string small = wgmma_short_schedules_serve(shape) ? "Q tile 64 (key tile 64, 2 CTAs per SM)" : large;
    std::string tiles;
    switch (sched) {
      case ForwardSchedule::tile128:
      case ForwardSchedule::persistent128: tiles = large; break;
      case ForwardSchedule::tile64:
      case ForwardSchedule::persistent64: tiles = small; break;
      default:
        tiles = wgmma_short_schedules_serve(shape) ? large + " or " + small + " by the call's padding waste" : large;
    }
    const char* grid = sched == ForwardSchedule::automatic ? "persistent grid with 64-row tiles"
                       : sched == ForwardSchedule::tile128 || sched == ForwardSchedule::tile64
                           ? "one CTA per tile and head"
                           : "persistent grid";
    return "wgmma sm_90a (TMA; schedule " + std::string(forward_schedule_name(sched)) + ": " + tiles + ", " + grid +
           ")";
  }
  return "mma.sync (Q tile 64, key tile 64)";
}

}  // namespace cpgold::gpu
