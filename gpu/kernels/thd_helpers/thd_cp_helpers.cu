// THD CP helper kernels; the index maps are those of sim/plan/step_rows.hpp and sim/plan/partition.hpp, written for the device.
// Row kernels: one warp per row, 16-byte vectors, four vectors in flight per lane (bandwidth-bound by design).
#include "gpu/kernels/thd_helpers/thd_cp_helpers.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "reference/input_error.hpp"
#include "sim/thd_helpers/lse_merge_float.hpp"
#include "sim/plan/step_rows.hpp"

namespace cpgold::gpu {

// ---------------------------------------------------------------------------------------------------------------
// Device offsets.

DeviceOffsets::DeviceOffsets(std::vector<int32_t> host) : host_(std::move(host)), facts_(sim::offset_facts(host_)) {
  const size_t bytes = std::max<size_t>(host_.size(), 1) * sizeof(int32_t);
  if (cudaError_t e = cudaMalloc(&device_, bytes); e != cudaSuccess)
    throw std::runtime_error(std::string("cudaMalloc of offsets: ") + cudaGetErrorString(e));
  if (!host_.empty())
    if (cudaError_t e = cudaMemcpy(device_, host_.data(), host_.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
        e != cudaSuccess)
      throw std::runtime_error(std::string("cudaMemcpy of offsets: ") + cudaGetErrorString(e));
}

DeviceOffsets::~DeviceOffsets() {
  if (device_ != nullptr) cudaFree(device_);
}

DeviceOffsets::DeviceOffsets(DeviceOffsets&& other) noexcept
    : host_(std::move(other.host_)), facts_(std::exchange(other.facts_, {})),
      device_(std::exchange(other.device_, nullptr)) {}

DeviceOffsets& DeviceOffsets::operator=(DeviceOffsets&& other) noexcept {
  if (this != &other) {
    if (device_ != nullptr) cudaFree(device_);
    host_ = std::move(other.host_);
    facts_ = std::exchange(other.facts_, {});
    device_ = std::exchange(other.device_, nullptr);
  }
  return *this;
}

namespace {

constexpr int kThreads = 256;

// ---------------------------------------------------------------------------------------------------------------
// Index maps (device copies of sim::sequence_of_row, sim::StepRows::at, SidePartition::global_row).

// Largest b in [0, batch-1] with cu[b] / divisor <= x.
__device__ __forceinline__ int find_sequence(const int32_t* __restrict__ cu, int batch, int64_t x, int divisor) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) / divisor <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

struct StepRowD {
  int sequence;
  int64_t local_row, column, local_column, half_length;
};

// The same search for a warp walking rows upwards: from a sequence s at or below the answer, step forward.
__device__ __forceinline__ int advance_sequence(const int32_t* __restrict__ cu, int batch, int64_t x, int divisor,
                                                int s) {
  while (s + 1 < batch && __ldg(cu + s + 1) / divisor <= x) ++s;
  return s;
}

// Step row x of sequence s; select: 0 full, 1 first half, 2 second half (sim::HalfSelect order).
__device__ __forceinline__ StepRowD step_row_in(const int32_t* __restrict__ cu, int select, int64_t x, int s) {
  const int div = select == 0 ? 1 : 2;
  StepRowD r;
  r.sequence = s;
  const int64_t start = __ldg(cu + s) / div, next = __ldg(cu + s + 1) / div;
  r.column = x - start;
  r.half_length = next - start;
  r.local_row = select == 0 ? x : (select == 1 ? x + start : x + next);
  r.local_column = r.local_row - __ldg(cu + s);
  return r;
}

__device__ __forceinline__ StepRowD step_row(const int32_t* __restrict__ cu, int batch, int select, int64_t x) {
  return step_row_in(cu, select, x, find_sequence(cu, batch, x, select == 0 ? 1 : 2));
}

// Element kernels (the LSE kernels, the partitioned indices) walk tiles of consecutive rows per warp: one warp-wide
// search per tile, then every lane steps its sequence forward (searching per element made them latency-bound,
// 20-25% of the copy bandwidth; one binary search per 256-row tile still left the indices at 19%).
constexpr int kRowsPerLane = 8;
constexpr int64_t kTileRows = 32 * kRowsPerLane;

// find_sequence for a whole warp (every lane calls it with the same x): 32 offsets per step, so the 18 dependent
// loads of a binary search over 220k sequences become 4.
__device__ __forceinline__ int warp_find_sequence(const int32_t* __restrict__ cu, int batch, int64_t x, int divisor,
                                                  int lane) {
  int lo = 0, hi = batch - 1;  // invariant: cu[lo] / divisor <= x, the answer lies in [lo, hi]
  while (hi > lo) {
    const int step = (hi - lo + 32) / 32;
    const int b = lo + lane * step;
    const bool at_or_below = b <= hi && __ldg(cu + b) / divisor <= x;
    const unsigned below = __ballot_sync(0xffffffffu, at_or_below);  // bit 0 set by the invariant
    lo += (31 - __clz(below)) * step;
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

// Global row of local row i (of sequence s) of rank (cp-semantics §2.2); cu_padded global, W ranks.
__device__ __forceinline__ int64_t partition_source_in(const int32_t* __restrict__ cu_padded, int cp_size, int rank,
                                                       int64_t i, int s) {
  const int64_t start = __ldg(cu_padded + s) / cp_size;
  const int64_t half = (__ldg(cu_padded + s + 1) / cp_size - start) / 2;
  const int64_t k = i - start;
  const int64_t base = __ldg(cu_padded + s);
  return k < half ? base + rank * half + k : base + (2 * cp_size - 1 - rank) * half + (k - half);
}

__device__ __forceinline__ int64_t partition_source(const int32_t* __restrict__ cu_padded, int batch, int cp_size,
                                                    int rank, int64_t i) {
  return partition_source_in(cu_padded, cp_size, rank, i, find_sequence(cu_padded, batch, i, cp_size));
}

__device__ __forceinline__ int64_t lse_index(bool packed, int heads, int64_t seqlen, int sequence, int head,
                                             int64_t row, int64_t column) {
  return packed ? head * seqlen + row : (static_cast<int64_t>(sequence) * heads + head) * seqlen + column;
}

// ---------------------------------------------------------------------------------------------------------------
// Element arithmetic of the output dtype.

template <class T>
struct Elem;
template <>
struct Elem<float> {
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};
template <>
struct Elem<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> {
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
};

// a + b in the dtype: float sum (no contraction), rounded once to T; the twin is round_to(dtype, a + b).
template <class T>
__device__ __forceinline__ uint4 add_vector(uint4 a, uint4 b) {
  T* pa = reinterpret_cast<T*>(&a);
  const T* pb = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int e = 0; e < static_cast<int>(sizeof(uint4) / sizeof(T)); ++e)
    pa[e] = Elem<T>::from_float(__fadd_rn(Elem<T>::to_float(pa[e]), Elem<T>::to_float(pb[e])));
  return a;
}

enum RowOp : int { kSkip = 0, kCopy = 1, kAdd = 2 };

// Moves one row of vpr vectors from src to dst (copy or add), the warp's lanes striding over the vectors.
template <class T>
__device__ __forceinline__ void move_row(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t vpr,
                                         int op, int lane) {
  constexpr int kInFlight = 4;
  for (int64_t v0 = lane; v0 < vpr; v0 += 32 * kInFlight) {
    uint4 a[kInFlight], b[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t v = v0 + 32 * u;
      if (v < vpr) {
        a[u] = __ldg(src + v);
        if (op == kAdd) b[u] = dst[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t v = v0 + 32 * u;
      if (v < vpr) dst[v] = op == kAdd ? add_vector<T>(b[u], a[u]) : a[u];
    }
  }
}

// One warp per item; map(i, dst_row, src_row) returns the RowOp of item i.
template <class T, class Map>
__global__ void __launch_bounds__(kThreads) row_kernel(Map map, const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                       int64_t items, int64_t vpr) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; i < items; i += warps) {
    int64_t d = 0, s = 0;
    const int op = map(i, d, s);
    if (op != kSkip) move_row<T>(src + s * vpr, dst + d * vpr, vpr, op, lane);
  }
}

// Item gi is row gi of the rank-major layout; ToRank: rank-major <- sequence order, else sequence order <- rank-major.
template <bool ToRank>
struct PartitionMap {
  const int32_t* cu;
  int batch, cp_size;
  int64_t per_rank;
  __device__ int operator()(int64_t gi, int64_t& d, int64_t& s) const {
    (ToRank ? d : s) = gi;
    (ToRank ? s : d) = partition_source(cu, batch, cp_size, static_cast<int>(gi / per_rank), gi % per_rank);
    return kCopy;
  }
};
using SequenceToRankMap = PartitionMap<true>;
using RankToSequenceMap = PartitionMap<false>;

struct ReadHalfMap {
  const int32_t* cu;
  int batch, half;
  // The whole warp maps the same row (row_kernel), so the 32-wide search applies: its source loads wait for the search.
  __device__ int operator()(int64_t x, int64_t& d, int64_t& s) const {
    d = x;
    const int select = half == 0 ? 1 : 2;
    s = step_row_in(cu, select, x, warp_find_sequence(cu, batch, x, 2, threadIdx.x & 31)).local_row;
    return kCopy;
  }
};

struct ValidRowsMap {
  const int32_t* cu_padded;
  const int32_t* cu;
  int batch;
  __device__ int operator()(int64_t x, int64_t& d, int64_t& s) const {
    const int b = find_sequence(cu_padded, batch, x, 1);
    const int64_t loc = x - __ldg(cu_padded + b);
    d = s = x;
    return loc >= 0 && loc < __ldg(cu + b + 1) - __ldg(cu + b) ? kCopy : kSkip;
  }
};

struct GradMap {
  const int32_t* cu;
  int batch, select, first, second;
  __device__ int operator()(int64_t x, int64_t& d, int64_t& s) const {
    const StepRowD r = step_row(cu, batch, select, x);
    d = r.local_row;
    s = x;
    if (select == 1) return first;
    if (select == 2) return second;
    return r.column < r.half_length / 2 ? first : second;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// LSE kernels. Both layouts index element (row, head) as f0 + head * S of the full tensor and h0 + head * S2 of the
// half tensor (packed: f0 = local row, h0 = step row; unpacked: f0 = s*h*S + local column, h0 = s*h*S2 + column).
// A warp takes a tile of 256 rows and walks the heads in groups: every access of one group covers 1 KiB runs of a
// few heads (as the row kernels move whole rows), where one head at a time for 32 rows left 128-byte pieces of 16
// heads in flight and the kernels at 73% of the copy rate. The read writes every element of lse_half once: the
// copied rows and zeros elsewhere (no separate memset pass).

// Device operations of sim::LseMergeFloat: the round-to-nearest intrinsics, which nvcc never contracts.
struct DeviceFloatOps {
  __device__ static float fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
  __device__ static float add(float a, float b) { return __fadd_rn(a, b); }
  __device__ static float sub(float a, float b) { return __fsub_rn(a, b); }
  __device__ static float mul(float a, float b) { return __fmul_rn(a, b); }
  __device__ static float div(float a, float b) { return __fdiv_rn(a, b); }
  __device__ static float rint(float a) { return rintf(a); }
  __device__ static float pow2(int e) { return __int_as_float((e + 127) << 23); }
};

struct LseArgs {
  float* full;
  float* half;
  int heads;
  int64_t full_seqlen, half_seqlen;  // S, S2: the head strides of both layouts
  const int32_t* cu;
  int batch;
  int64_t rows;   // step rows (cu[B] / 2)
  int64_t items;  // packed: step rows (correction) or S2 (read); unpacked: B * S2
};

// Accesses of WIDTH consecutive floats: 4-byte elements, or 16-byte vectors for the packed layout when every
// rank-local length is a multiple of 8 (every chunk a multiple of 4 rows, as CP layouts padded to multiples of 8W
// have) and head strides and pointers are multiples of 4 floats / 16 bytes: a run of 4 step rows x..x+3 with
// x % 4 == 0 then lies in one sequence, and its full-tensor rows x + cu[s+1]/2 start at a multiple of 4 too.
template <int WIDTH>
struct LseAccess;
template <>
struct LseAccess<1> {
  using V = float;
  __device__ static V zero() { return 0.f; }
  __device__ static V load(const float* p) { return *p; }
  __device__ static V load_nc(const float* p) { return __ldg(p); }
  __device__ static void store(float* p, V v) { *p = v; }
};
template <>
struct LseAccess<4> {
  using V = float4;
  __device__ static V zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ static V load(const float* p) { return *reinterpret_cast<const float4*>(p); }
  __device__ static V load_nc(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
  __device__ static void store(float* p, V v) { *reinterpret_cast<float4*>(p) = v; }
};

// sim::LseMergeFloat per element (templates: its constexpr functions are then built for the device only).
template <class Ops>
__device__ __forceinline__ float lse_merge(float a, float b) {
  return sim::LseMergeFloat<Ops>::merge(a, b);
}
template <class Ops>
__device__ __forceinline__ float4 lse_merge(float4 a, float4 b) {
  using M = sim::LseMergeFloat<Ops>;
  return make_float4(M::merge(a.x, b.x), M::merge(a.y, b.y), M::merge(a.z, b.z), M::merge(a.w, b.w));
}

// Lane `lane` of a warp tile moves rows base + it * 32 * WIDTH + WIDTH * lane + j (j < WIDTH). Blocks per SM: enough
// warps to hide the loads (and the merge arithmetic) without register spills.
template <bool CORRECT, bool PACKED, int WIDTH>
__global__ void __launch_bounds__(kThreads, PACKED ? (CORRECT ? 3 : 4) : 2) second_half_lse_kernel(LseArgs a) {
  static_assert(WIDTH == 1 || PACKED, "16-byte accesses serve the packed layout only");
  using Access = LseAccess<WIDTH>;
  // Loads in flight per lane: 16 elements (correction) or 32 (read); 8 vectors either way.
  constexpr int kHeadsPerGroup = CORRECT ? (WIDTH == 4 ? 2 : 1) : 4;
  constexpr int kItems = kRowsPerLane / WIDTH;  // accesses per lane and head
  float* __restrict__ full = a.full;  // the two LSE tensors never overlap: loads of later heads may pass stores
  float* __restrict__ half = a.half;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t fs = a.full_seqlen, hs = a.half_seqlen;
  for (int64_t base = ((static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5) * kTileRows; base < a.items;
       base += warps * kTileRows) {
    int s = PACKED && base < a.rows ? warp_find_sequence(a.cu, a.batch, base, 2, lane) : 0;
    // f0: packed, the shift local row - step row (int32: fewer registers); unpacked, the full offset.
    std::conditional_t<PACKED, int32_t, int64_t> f0[kItems];
    int64_t h0[kItems];
    unsigned inside = 0, valid = 0;  // bit it: rows exist / rows are copied (else zero-filled by the read)
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int64_t x = base + it * 32 * WIDTH + WIDTH * lane;
      f0[it] = h0[it] = 0;  // packed: the half column is x itself (not kept, fewer registers)
      if (x >= a.items) continue;  // with WIDTH 4, items and rows are multiples of 4: a run is all in or all out
      inside |= 1u << it;
      if (PACKED) {  // x: step row, or a column of lse_half beyond them (read: zeros)
        if (x < a.rows) {
          s = advance_sequence(a.cu, a.batch, x, 2, s);
          f0[it] = __ldg(a.cu + s + 1) / 2;
          valid |= 1u << it;
        }
      } else {  // x: (sequence, column) of lse_half [B, h, S2]
        const int q = static_cast<int>(x / hs);
        const int64_t column = x - q * hs;
        const int64_t length = __ldg(a.cu + q + 1) / 2 - __ldg(a.cu + q) / 2;  // second-half rows of q
        if (column < length) valid |= 1u << it;
        if constexpr (!PACKED) f0[it] = static_cast<int64_t>(q) * a.heads * fs + column + length;
        h0[it] = static_cast<int64_t>(q) * a.heads * hs + column;
      }
    }
    for (int k0 = 0; k0 < a.heads; k0 += kHeadsPerGroup) {
      typename Access::V v[kHeadsPerGroup][kItems], w[kHeadsPerGroup][kItems];
#pragma unroll
      for (int u = 0; u < kHeadsPerGroup; ++u)
#pragma unroll
        for (int it = 0; it < kItems; ++it) {
          const int64_t k = k0 + u, x = base + it * 32 * WIDTH + WIDTH * lane;
          v[u][it] = w[u][it] = Access::zero();
          if (k < a.heads && (valid >> it & 1u)) {
            const int64_t fi = (PACKED ? x : 0) + f0[it] + k * fs;
            v[u][it] = CORRECT ? Access::load(full + fi) : Access::load_nc(full + fi);
            if (CORRECT) w[u][it] = Access::load_nc(half + (PACKED ? x : h0[it]) + k * hs);
          }
        }
#pragma unroll
      for (int u = 0; u < kHeadsPerGroup; ++u)
#pragma unroll
        for (int it = 0; it < kItems; ++it) {
          const int64_t k = k0 + u, x = base + it * 32 * WIDTH + WIDTH * lane;
          if (k >= a.heads) continue;
          if (CORRECT) {
            if (valid >> it & 1u)
              Access::store(full + (PACKED ? x : 0) + f0[it] + k * fs, lse_merge<DeviceFloatOps>(v[u][it], w[u][it]));
          } else if (inside >> it & 1u) {
            Access::store(half + (PACKED ? x : h0[it]) + k * hs, v[u][it]);  // zeros where the rows are not copied
          }
        }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Out correction: one warp per step row; a lane's vector lies in one head (head bytes % 16 == 0).

struct OutArgs {
  const uint4* out_i;
  uint4* out;
  const float* lse;
  const float* lse_i;
  bool packed;
  int heads;
  int64_t lse_seqlen, lse_i_seqlen;
  const int32_t* cu;
  int batch, select;
  int64_t rows, vpr, vph;  // step rows, vectors per row, vectors per head
};

template <class T>
__global__ void __launch_bounds__(kThreads) out_correction_kernel(OutArgs a) {
  constexpr int kPer = static_cast<int>(sizeof(uint4) / sizeof(T));
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t x = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; x < a.rows; x += warps) {
    const StepRowD r = step_row(a.cu, a.batch, a.select, x);
    const uint4* src = a.out_i + x * a.vpr;
    uint4* dst = a.out + r.local_row * a.vpr;
    for (int64_t v = lane; v < a.vpr; v += 32) {
      const int head = static_cast<int>(v / a.vph);
      const float l = __ldg(a.lse + lse_index(a.packed, a.heads, a.lse_seqlen, r.sequence, head, r.local_row,
                                              r.local_column));
      const float li = __ldg(a.lse_i + lse_index(a.packed, a.heads, a.lse_i_seqlen, r.sequence, head, x, r.column));
      const float w = static_cast<float>(exp(static_cast<double>(__fsub_rn(li, l))));
      uint4 vi = __ldg(src + v), o = dst[v];
      const T* pi = reinterpret_cast<const T*>(&vi);
      T* po = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const float val = Elem<T>::to_float(pi[e]);
        const float term = val == 0.f ? 0.f : Elem<T>::to_float(Elem<T>::from_float(__fmul_rn(val, w)));
        po[e] = Elem<T>::from_float(__fadd_rn(Elem<T>::to_float(po[e]), term));
      }
      dst[v] = o;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.

Outcome invalid(const std::string& message) { return {Status::invalid_argument, message}; }

Outcome cuda_status(const char* what) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {Status::cuda_error, std::string(what) + ": " + cudaGetErrorString(e)};
  return {};
}

int grid_for(int64_t items_per_block_units) {
  static const int sms = [] {
    int device = 0, count = 132;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return count;
  }();
  return static_cast<int>(std::clamp<int64_t>(items_per_block_units, 1, static_cast<int64_t>(sms) * 8));
}

// 16-byte vector access: row bytes a multiple of 16, pointers aligned. Throws InputError naming the field.
void check_vectors(const DeviceRows& x, const char* name) {
  if (x.rows < 0) fail_input(std::string(name) + ".rows", "value ", x.rows, " is negative");
  if (x.row_bytes() % 16 != 0)
    fail_input(std::string(name) + ".row_bytes", "value ", x.row_bytes(), " (heads ", x.heads, " x dim ", x.dim,
               " x ", dtype_bytes(x.dtype), " bytes) is not a multiple of 16 (16-byte vector accesses)");
  if (reinterpret_cast<uintptr_t>(x.data) % 16 != 0)
    fail_input(std::string(name) + ".data", "device pointer is not 16-byte aligned");
}

void check_same_rows(const DeviceRows& a, const DeviceRows& b, const char* name_b) {
  if (b.heads != a.heads || b.dim != a.dim || b.dtype != a.dtype)
    fail_input(std::string(name_b) + ".row", "[heads ", b.heads, ", dim ", b.dim, ", ", dtype_name(b.dtype),
               "] differs from [", a.heads, ", ", a.dim, ", ", dtype_name(a.dtype), "]");
}

// Global padded offsets for the partition: start at 0, every PL_b a multiple of 2W.
void check_partition(const DeviceOffsets& cu_padded, int cp_size) {
  if (cp_size < 1) fail_input("cp_size", "value ", cp_size, " must be >= 1");
  if (const sim::OffsetFacts& f = cu_padded.facts(); f.ordered && f.length_gcd % (2 * cp_size) == 0) return;
  // Invalid: walk the offsets to name the entry.
  sim::check_offsets(cu_padded.host(), "cu_seqlens_padded");
  const auto& cu = cu_padded.host();
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    if ((cu[b + 1] - cu[b]) % (2 * cp_size) != 0)
      fail_input("cu_seqlens_padded[" + std::to_string(b + 1) + "]", "value ", cu[b + 1], " leaves sequence ", b,
                 " with padded length ", cu[b + 1] - cu[b], ", not a multiple of 2 * cp_size = ", 2 * cp_size);
}

template <class Map>
Outcome launch_rows(DType dtype, Map map, const void* src, void* dst, int64_t items, int64_t vpr, cudaStream_t s,
                    const char* name) {
  if (items == 0 || vpr == 0) return {};
  const int grid = grid_for((items + kThreads / 32 - 1) / (kThreads / 32));
  const auto* in = static_cast<const uint4*>(src);
  auto* out = static_cast<uint4*>(dst);
  switch (dtype) {
    case DType::bf16: row_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(map, in, out, items, vpr); break;
    case DType::fp16: row_kernel<__half><<<grid, kThreads, 0, s>>>(map, in, out, items, vpr); break;
    case DType::fp32: row_kernel<float><<<grid, kThreads, 0, s>>>(map, in, out, items, vpr); break;
  }
  return cuda_status(name);
}

// Runs body, turning an InputError into invalid_argument (the message names field and value).
template <class Body>
Outcome guarded(Body body) {
  try {
    return body();
  } catch (const InputError& e) {
    return invalid(e.what());
  }
}

Outcome reorder(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_padded, int cp_size,
                bool to_rank, cudaStream_t stream) {
  return guarded([&]() -> Outcome {
    check_partition(cu_padded, cp_size);
    check_vectors(in, "in");
    check_vectors(out, "out");
    check_same_rows(in, out, "out");
    const int64_t total = cu_padded.host().back();
    if (in.rows != total) fail_input("in.rows", "value ", in.rows, " differs from cu_seqlens_padded[B] = ", total);
    if (out.rows != total) fail_input("out.rows", "value ", out.rows, " differs from cu_seqlens_padded[B] = ", total);
    const int64_t vpr = in.row_bytes() / 16;
    if (to_rank)
      return launch_rows(in.dtype, SequenceToRankMap{cu_padded.device(), cu_padded.batch(), cp_size, total / cp_size},
                         in.data, out.data, total, vpr, stream, "sequence_to_rank_order");
    return launch_rows(in.dtype, RankToSequenceMap{cu_padded.device(), cu_padded.batch(), cp_size, total / cp_size},
                       in.data, out.data, total, vpr, stream, "rank_to_sequence_order");
  });
}

// Partitioned indices: a warp tile of 4096 rows (one search per 32 KiB written), each lane writing pairs of rows
// (16-byte stores; a pair never straddles a sequence: every local sequence start cuP[b] / W is even). After the
// search, lane j holds the offset of sequence s0 + j, and every pair finds its sequence among those 32 by five
// shuffles: stepping lanes through the offsets with dependent loads left the kernel at 33% of the copy rate while
// its stores alone ran at 105%. A row beyond the 31 sequences the window describes falls back to stepping.
constexpr int kPairsPerLane = 64;
constexpr int64_t kIndexTileRows = 2 * 32 * kPairsPerLane;

struct PartitionRun {
  int64_t split, first, second;  // first-half end; offsets of both halves: index = (i < split ? first : second) + i
  __device__ PartitionRun(int32_t base, int32_t start, int32_t next, int cp_size, int rank) {
    const int64_t half = (next - start) / 2;
    split = start + half;
    first = base + rank * half - start;
    second = base + (2 * cp_size - 1 - rank) * half - half - start;
  }
  __device__ int64_t at(int64_t i) const { return (i < split ? first : second) + i; }
};

__global__ void __launch_bounds__(kThreads) partitioned_indices_kernel(const int32_t* __restrict__ cu, int batch,
                                                                       int cp_size, int rank, int64_t* idx,
                                                                       int64_t count, bool vectors) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t base = ((static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5) * kIndexTileRows;
       base < count; base += warps * kIndexTileRows) {
    const int s0 = warp_find_sequence(cu, batch, base, cp_size, lane);
    const int32_t offset = __ldg(cu + min(s0 + lane, batch));  // cu[s0 + lane]; past the end: cu[B]
    const int32_t start = offset / cp_size;                     // non-decreasing over the lanes
    for (int p = 0; p < kPairsPerLane && base + 64 * p < count; ++p) {  // warp-uniform bound: all lanes shuffle
      const int64_t i = base + 2 * (p * 32 + lane);
      int j = 0;  // largest j with start(s0 + j) <= i (TransformerEngine's search, zero-length sequences skipped)
#pragma unroll
      for (int step = 16; step >= 1; step >>= 1)
        if (__shfl_sync(kAll, start, j + step) <= i) j += step;
      const int32_t base_j = __shfl_sync(kAll, offset, j), start_j = __shfl_sync(kAll, start, j),
                    next_j = __shfl_sync(kAll, start, min(j + 1, 31));
      if (i >= count) continue;
      PartitionRun run(base_j, start_j, next_j, cp_size, rank);
      if (j == 31) {  // sequence s0 + 31 or later: its end is not in the window
        const int s = advance_sequence(cu, batch, i, cp_size, s0 + 31);
        run = PartitionRun(__ldg(cu + s), __ldg(cu + s) / cp_size, __ldg(cu + s + 1) / cp_size, cp_size, rank);
      }
      if (vectors) {
        reinterpret_cast<longlong2*>(idx)[i / 2] = make_longlong2(run.at(i), run.at(i + 1));
      } else {
        idx[i] = run.at(i);
        idx[i + 1] = run.at(i + 1);
      }
    }
  }
}

void check_lse(const DeviceLse& x, const char* name) {
  if (x.data == nullptr && x.shape.size() > 0) fail_input(std::string(name) + ".data", "is null");
}

}  // namespace

Outcome partitioned_indices(const DeviceOffsets& cu_padded, int cp_size, int rank, int64_t* indices, int64_t count,
                            void* stream) {
  return guarded([&]() -> Outcome {
    check_partition(cu_padded, cp_size);
    if (rank < 0 || rank >= cp_size) fail_input("rank", "value ", rank, " is outside [0, cp_size = ", cp_size, ")");
    const int64_t local = cu_padded.host().back() / cp_size;
    if (count != local) fail_input("count", "value ", count, " differs from cu_seqlens_padded[B] / cp_size = ", local);
    if (count == 0) return {};
    if (indices == nullptr) fail_input("indices", "is null");
    const int64_t tiles = (count + kIndexTileRows - 1) / kIndexTileRows;
    const bool vectors = reinterpret_cast<uintptr_t>(indices) % 16 == 0;
    partitioned_indices_kernel<<<grid_for((tiles + kThreads / 32 - 1) / (kThreads / 32)), kThreads, 0,
                                 static_cast<cudaStream_t>(stream)>>>(cu_padded.device(), cu_padded.batch(), cp_size,
                                                                      rank, indices, count, vectors);
    return cuda_status("partitioned_indices");
  });
}

Outcome sequence_to_rank_order(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_padded,
                               int cp_size, void* stream) {
  return reorder(in, out, cu_padded, cp_size, true, static_cast<cudaStream_t>(stream));
}

Outcome rank_to_sequence_order(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_padded,
                               int cp_size, void* stream) {
  return reorder(in, out, cu_padded, cp_size, false, static_cast<cudaStream_t>(stream));
}

Outcome read_half(const DeviceRows& in, const DeviceRows& out, const DeviceOffsets& cu_local, int half, void* stream) {
  return guarded([&]() -> Outcome {
    if (half != 0 && half != 1) fail_input("half", "value ", half, " must be 0 or 1");
    const sim::StepRows rows(cu_local.host(), half == 0 ? sim::HalfSelect::first : sim::HalfSelect::second);
    check_vectors(in, "in");
    check_vectors(out, "out");
    check_same_rows(in, out, "out");
    sim::check_step_shape({in.rows, in.heads, in.dim}, {out.rows, out.heads, out.dim}, rows);
    return launch_rows(in.dtype, ReadHalfMap{cu_local.device(), cu_local.batch(), half}, in.data, out.data,
                       rows.rows(), in.row_bytes() / 16, static_cast<cudaStream_t>(stream), "read_half");
  });
}

Outcome copy_valid_rows(const DeviceRows& out, const DeviceRows& in, const DeviceOffsets& cu_padded_step,
                        const DeviceOffsets& cu_step, void* stream) {
  return guarded([&]() -> Outcome {
    sim::check_offsets(cu_padded_step.host(), "cu_seqlens_padded_step", false);
    sim::check_offsets(cu_step.host(), "cu_seqlens_step");
    if (cu_step.host().size() != cu_padded_step.host().size())
      fail_input("cu_seqlens_step", "has ", cu_step.host().size(), " entries, cu_seqlens_padded_step has ",
                 cu_padded_step.host().size());
    check_vectors(in, "in");
    check_vectors(out, "out");
    check_same_rows(in, out, "out");
    if (out.rows != in.rows) fail_input("out.rows", "value ", out.rows, " differs from in.rows = ", in.rows);
    return launch_rows(in.dtype, ValidRowsMap{cu_padded_step.device(), cu_step.device(), cu_step.batch()}, in.data,
                       out.data, in.rows, in.row_bytes() / 16, static_cast<cudaStream_t>(stream), "copy_valid_rows");
  });
}

namespace {
Outcome second_half_lse(const DeviceLse& lse, const DeviceLse& lse_half, const DeviceOffsets& cu_local, bool correct,
                        cudaStream_t stream) {
  return guarded([&]() -> Outcome {
    // Packed LSE on valid offsets (even lengths): O(1) from the upload's facts; otherwise the full check.
    const sim::OffsetFacts& f = cu_local.facts();
    const int64_t local_rows = cu_local.host().empty() ? 0 : cu_local.host().back(), step_rows = local_rows / 2;
    if (lse.shape.packed && f.ordered && f.length_gcd % 2 == 0) {
      sim::check_lse_heads_and_rows(lse.shape, lse_half.shape, local_rows, step_rows);
    } else {
      const sim::StepRows rows(cu_local.host(), sim::HalfSelect::second);
      sim::check_lse_shapes(lse.shape, lse_half.shape, rows);
    }
    check_lse(lse, "lse");
    check_lse(lse_half, "lse_half");
    const bool packed = lse.shape.packed;
    const int64_t items = packed ? (correct ? step_rows : lse_half.shape.seqlen)
                                 : static_cast<int64_t>(lse_half.shape.batch) * lse_half.shape.seqlen;
    if (items == 0 || lse.shape.heads == 0) return {};
    const LseArgs a{lse.data,          lse_half.data,     lse.shape.heads, lse.shape.seqlen, lse_half.shape.seqlen,
                    cu_local.device(), cu_local.batch(), step_rows,       items};
    const int64_t tiles = (items + kTileRows - 1) / kTileRows;
    const int grid = grid_for((tiles + kThreads / 32 - 1) / (kThreads / 32));
    const auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vectors = packed && f.ordered && f.length_gcd % 8 == 0 && lse.shape.seqlen % 4 == 0 &&
                         lse_half.shape.seqlen % 4 == 0 && aligned(lse.data) && aligned(lse_half.data);
    if (vectors && correct) second_half_lse_kernel<true, true, 4><<<grid, kThreads, 0, stream>>>(a);
    if (vectors && !correct) second_half_lse_kernel<false, true, 4><<<grid, kThreads, 0, stream>>>(a);
    if (!vectors && correct && packed) second_half_lse_kernel<true, true, 1><<<grid, kThreads, 0, stream>>>(a);
    if (!vectors && !correct && packed) second_half_lse_kernel<false, true, 1><<<grid, kThreads, 0, stream>>>(a);
    if (correct && !packed) second_half_lse_kernel<true, false, 1><<<grid, kThreads, 0, stream>>>(a);
    if (!correct && !packed) second_half_lse_kernel<false, false, 1><<<grid, kThreads, 0, stream>>>(a);
    return cuda_status(correct ? "second_half_lse_correction" : "read_second_half_lse");
  });
}
}  // namespace

Outcome second_half_lse_correction(const DeviceLse& lse, const DeviceLse& lse_half, const DeviceOffsets& cu_local,
                                   void* stream) {
  return second_half_lse(lse, lse_half, cu_local, true, static_cast<cudaStream_t>(stream));
}

Outcome read_second_half_lse(const DeviceLse& lse, const DeviceLse& lse_half, const DeviceOffsets& cu_local,
                             void* stream) {
  return second_half_lse(lse, lse_half, cu_local, false, static_cast<cudaStream_t>(stream));
}

Outcome out_correction(const DeviceRows& out, const DeviceRows& out_i, const DeviceLse& lse, const DeviceLse& lse_i,
                       const DeviceOffsets& cu_local, bool only_second_half, void* stream) {
  return guarded([&]() -> Outcome {
    const sim::StepRows rows(cu_local.host(), only_second_half ? sim::HalfSelect::second : sim::HalfSelect::full);
    check_vectors(out, "out");
    check_vectors(out_i, "out_i");
    check_same_rows(out, out_i, "out_i");
    if ((out.dim * dtype_bytes(out.dtype)) % 16 != 0)
      fail_input("out.dim", "value ", out.dim, " (", out.dim * dtype_bytes(out.dtype),
                 " bytes per head) is not a multiple of 16 bytes (16-byte vectors within a head)");
    sim::check_step_shape({out.rows, out.heads, out.dim}, {out_i.rows, out_i.heads, out_i.dim}, rows);
    sim::check_lse_shapes(lse.shape, lse_i.shape, rows);
    if (lse.shape.heads != out.heads)
      fail_input("lse.heads", "value ", lse.shape.heads, " differs from the output's heads ", out.heads);
    check_lse(lse, "lse");
    check_lse(lse_i, "lse_i");
    if (rows.rows() == 0 || out.row_bytes() == 0) return {};
    const OutArgs a{static_cast<const uint4*>(out_i.data), static_cast<uint4*>(out.data), lse.data, lse_i.data,
                    lse.shape.packed, lse.shape.heads, lse.shape.seqlen, lse_i.shape.seqlen, cu_local.device(),
                    cu_local.batch(), only_second_half ? 2 : 0, rows.rows(), out.row_bytes() / 16,
                    out.dim * dtype_bytes(out.dtype) / 16};
    const int grid = grid_for((rows.rows() + kThreads / 32 - 1) / (kThreads / 32));
    auto s = static_cast<cudaStream_t>(stream);
    switch (out.dtype) {
      case DType::bf16: out_correction_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(a); break;
      case DType::fp16: out_correction_kernel<__half><<<grid, kThreads, 0, s>>>(a); break;
      case DType::fp32: out_correction_kernel<float><<<grid, kThreads, 0, s>>>(a); break;
    }
    return cuda_status("out_correction");
  });
}

Outcome grad_correction(const DeviceRows& grad, const DeviceRows& grad_i, const DeviceOffsets& cu_local,
                        sim::GradOp first, sim::GradOp second, void* stream) {
  return guarded([&]() -> Outcome {
    const sim::HalfSelect select = sim::grad_step_rows(first, second);
    const sim::StepRows rows(cu_local.host(), select);
    check_vectors(grad, "grad");
    check_vectors(grad_i, "grad_i");
    check_same_rows(grad, grad_i, "grad_i");
    sim::check_step_shape({grad.rows, grad.heads, grad.dim}, {grad_i.rows, grad_i.heads, grad_i.dim}, rows);
    auto op = [](sim::GradOp g) { return g == sim::GradOp::add ? kAdd : (g == sim::GradOp::copy ? kCopy : kSkip); };
    const int sel = select == sim::HalfSelect::full ? 0 : (select == sim::HalfSelect::first ? 1 : 2);
    return launch_rows(grad.dtype, GradMap{cu_local.device(), cu_local.batch(), sel, op(first), op(second)},
                       grad_i.data, grad.data, rows.rows(), grad.row_bytes() / 16, static_cast<cudaStream_t>(stream),
                       "grad_correction");
  });
}

}  // namespace cpgold::gpu
