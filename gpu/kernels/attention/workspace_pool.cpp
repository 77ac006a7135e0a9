// The stream-ordered memory pool of the backward's workspace (one per device, owned by the library). Its release
// threshold keeps the memory reserved between calls: with the default pool's threshold (0) every synchronisation
// hands the pages back to the driver and the next call pays for mapping them again (hundreds of megabytes of float32
// dQ accumulator at 64k tokens), which a caller that synchronises after each backward would pay on every call.
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/kernels/attention/attention_launch.hpp"

namespace cpgold::gpu {

namespace {

std::mutex& pools_mutex() {
  static std::mutex m;
  return m;
}

// Indexed by device; created on first use and never destroyed (the driver frees them with the process).
std::vector<cudaMemPool_t>& pools() {
  static std::vector<cudaMemPool_t> v;
  return v;
}

}  // namespace

namespace detail {

cudaError_t workspace_pool(cudaMemPool_t& pool) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(pools_mutex());
  std::vector<cudaMemPool_t>& v = pools();
  if (static_cast<size_t>(device) >= v.size()) v.resize(static_cast<size_t>(device) + 1, nullptr);
  if (v[device] == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t created = nullptr;
    if (cudaError_t e = cudaMemPoolCreate(&created, &props); e != cudaSuccess) return e;
    uint64_t keep = UINT64_MAX;
    if (cudaError_t e = cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep); e != cudaSuccess) {
      cudaMemPoolDestroy(created);
      return e;
    }
    v[device] = created;
  }
  pool = v[device];
  return cudaSuccess;
}

}  // namespace detail

Outcome release_workspace_memory() {
  std::lock_guard<std::mutex> lock(pools_mutex());
  for (size_t device = 0; device < pools().size(); ++device) {
    if (pools()[device] == nullptr) continue;
    if (cudaError_t e = cudaMemPoolTrimTo(pools()[device], 0); e != cudaSuccess)
      return {Status::cuda_error, "release_workspace_memory: cudaMemPoolTrimTo on device " + std::to_string(device) +
                                      ": " + cudaGetErrorString(e)};
  }
  return {};
}

Outcome workspace_memory_reserved(int device, uint64_t& bytes) {
  bytes = 0;
  std::lock_guard<std::mutex> lock(pools_mutex());
  if (device < 0 || static_cast<size_t>(device) >= pools().size() || pools()[device] == nullptr) return {};
  if (cudaError_t e = cudaMemPoolGetAttribute(pools()[device], cudaMemPoolAttrReservedMemCurrent, &bytes);
      e != cudaSuccess)
    return {Status::cuda_error, std::string("workspace_memory_reserved: ") + cudaGetErrorString(e)};
  return {};
}

}  // namespace cpgold::gpu
