// GB/s of the THD CP helper kernels (gpu/kernels/thd_helpers/thd_cp_helpers.hpp) against the device's copy bandwidth measured in
// the same run (cudaMemcpy device-to-device, a plain 16-byte-vector copy kernel, and a write-only memset). Bytes =
// bytes the helper's result needs read + written (rows it skips are not counted), >= 1 GiB per call. Median of --reps
// timed calls after 3 warm-up calls, CUDA events.
// Usage: bench_thd_helpers [--reps N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/gpu/bench_checks.hpp"
#include "gpu/kernels/thd_helpers/thd_cp_helpers.hpp"

using namespace cpgold;
using cpgold::bench::check;
using namespace cpgold::gpu;

namespace {

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(size_t bytes) {
    check(cudaMalloc(&ptr, bytes), "cudaMalloc");
    check(cudaMemset(ptr, 0x3C, bytes), "cudaMemset");  // bf16 0x3C3C ~ 0.0115: nonzero rows, finite sums
  }
  ~Buffer() { cudaFree(ptr); }
};

// Padded lengths cycling over 512..4096 (multiples of 2W = 8), actual lengths 0..6 rows short of them, every
// eleventh sequence empty; offsets of `total` rows exactly (the last sequence takes the rest).
struct Layout {
  std::vector<int32_t> cu, cu_padded;
};
Layout layout(int64_t total) {
  static const int32_t cycle[] = {512, 1536, 2560, 3584, 1024, 3072, 2048, 4096};
  Layout l{{0}, {0}};
  for (int i = 0; l.cu_padded.back() < total; ++i) {
    int32_t pad = i % 11 == 10 ? 0 : cycle[i % 8];
    pad = static_cast<int32_t>(std::min<int64_t>(pad, total - l.cu_padded.back()));
    l.cu_padded.push_back(l.cu_padded.back() + pad);
    l.cu.push_back(l.cu.back() + std::max(0, pad - i % 7));
  }
  return l;
}

__global__ void copy_kernel(const uint4* __restrict__ in, uint4* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = in[i];
}

// The store pattern of partitioned_indices without its offsets (warp tiles of 4096 int64, 16-byte stores, values
// i): separates the cost of the writes from that of finding each row's sequence.
__global__ void tile_store_kernel(longlong2* out, int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t base = ((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * 4096; base < count;
       base += warps * 4096)
    for (int p = 0; p < 64; ++p) {
      const int64_t i = base + 2 * (p * 32 + lane);
      if (i >= count) break;
      out[i / 2] = make_longlong2(i, i + 1);
    }
}

double median_ms(int reps, const std::function<void()>& call) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) call();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(a), "record");
    call();
    check(cudaEventRecord(b), "record");
    check(cudaEventSynchronize(b), "sync");
    float t = 0;
    check(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
  }
  check(cudaGetLastError(), "kernel");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

struct Row {
  std::string name;
  double bytes, ms;
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 10;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "argument %d: unknown '%s' (usage: bench_thd_helpers [--reps N])\n", i, argv[i]);
      return 2;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "--reps: value %d must be >= 1\n", reps);
    return 2;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs, %.0f MiB; reps %d (median)\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1048576.0, reps);

  const int W = 4, heads = 16, dim = 128;
  const DType dtype = DType::bf16;
  const int64_t row_bytes = heads * dim * 2;  // 4 KiB rows
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  std::vector<Row> rows;

  // Copy bandwidth of the device: 1 GiB buffers.
  const int64_t copy_bytes = int64_t{1} << 30;
  {
    Buffer a(copy_bytes), b(copy_bytes);
    rows.push_back({"cudaMemcpy D2D (reference)", 2.0 * copy_bytes, median_ms(reps, [&] {
                      check(cudaMemcpyAsync(b.ptr, a.ptr, copy_bytes, cudaMemcpyDeviceToDevice), "memcpy");
                    })});
    const int64_t n = copy_bytes / 16;
    rows.push_back({"copy kernel, 16-byte vectors (reference)", 2.0 * copy_bytes, median_ms(reps, [&] {
                      copy_kernel<<<prop.multiProcessorCount * 8, 256>>>(static_cast<const uint4*>(a.ptr),
                                                                         static_cast<uint4*>(b.ptr), n);
                    })});
    // Write-only rate (the limit of partitioned_indices, which reads nothing but the offsets): 1 GiB memset.
    rows.push_back({"cudaMemset (write-only reference)", 1.0 * copy_bytes, median_ms(reps, [&] {
                      check(cudaMemsetAsync(b.ptr, 0, copy_bytes), "memset");
                    })});
  }

  // Reorders: global tensor of T = 262144 rows (1 GiB), W = 4.
  {
    const int64_t T = 262144;
    const Layout l = layout(T);
    const DeviceOffsets cup(l.cu_padded);
    Buffer a(T * row_bytes), b(T * row_bytes);
    const DeviceRows in{a.ptr, T, heads, dim, dtype}, out{b.ptr, T, heads, dim, dtype};
    rows.push_back({"sequence_to_rank_order", 2.0 * T * row_bytes,
                    median_ms(reps, [&] { check(sequence_to_rank_order(in, out, cup, W), "s2r"); })});
    rows.push_back({"rank_to_sequence_order", 2.0 * T * row_bytes,
                    median_ms(reps, [&] { check(rank_to_sequence_order(in, out, cup, W), "r2s"); })});
  }

  // Rank-local helpers: local tensor of t = 262144 rows (1 GiB), offsets cuP/W of a layout of W * t rows.
  {
    const int64_t t = 262144;
    const Layout g = layout(t * W);
    std::vector<int32_t> cul;
    for (int32_t x : g.cu_padded) cul.push_back(x / W);
    const DeviceOffsets cu_local(cul);
    Buffer full(t * row_bytes), half(t / 2 * row_bytes), full2(t * row_bytes);
    const DeviceRows local{full.ptr, t, heads, dim, dtype}, halfrows{half.ptr, t / 2, heads, dim, dtype},
        local2{full2.ptr, t, heads, dim, dtype};
    rows.push_back({"read_half (half 1)", 2.0 * (t / 2) * row_bytes,
                    median_ms(reps, [&] { check(read_half(local, halfrows, cu_local, 1), "read_half"); })});
    // Valid-row copy of an all-gather step 0: rows [cuPl[b], cuPl[b] + n_b(r)) of rank r = 1.
    {
      std::vector<int32_t> cnt{0};
      int64_t valid = 0;
      for (size_t b = 0; b + 1 < g.cu.size(); ++b) {
        const int32_t pl = g.cu_padded[b + 1] - g.cu_padded[b], len = g.cu[b + 1] - g.cu[b], c = pl / (2 * W);
        const int32_t n = std::clamp(len - 1 * c, 0, c) + std::clamp(len - (2 * W - 2) * c, 0, c);
        cnt.push_back(cnt.back() + n);
        valid += n;
      }
      const DeviceOffsets cu_step(cnt);
      rows.push_back({"copy_valid_rows (both chunks)", 2.0 * valid * row_bytes, median_ms(reps, [&] {
                        check(copy_valid_rows(local2, local, cu_local, cu_step), "copy_valid");
                      })});
    }
    Buffer lse(heads * t * 4), lse_i(heads * t * 4);
    check(cudaMemset(lse.ptr, 0, heads * t * 4), "memset");
    check(cudaMemset(lse_i.ptr, 0, heads * t * 4), "memset");
    const DeviceLse l_full{static_cast<float*>(lse.ptr), {true, heads, 0, t}};
    const DeviceLse l_step_full{static_cast<float*>(lse_i.ptr), {true, heads, 0, t}};
    const DeviceLse l_step_half{static_cast<float*>(lse_i.ptr), {true, heads, 0, t / 2}};
    rows.push_back({"out_correction (full step)", 3.0 * t * row_bytes, median_ms(reps, [&] {
                      check(out_correction(local, local2, l_full, l_step_full, cu_local, false), "out");
                    })});
    rows.push_back({"out_correction (second half)", 3.0 * (t / 2) * row_bytes, median_ms(reps, [&] {
                      check(out_correction(local, halfrows, l_full, l_step_half, cu_local, true), "out");
                    })});
    using sim::GradOp;
    rows.push_back({"grad_correction (copy, none)", 2.0 * (t / 2) * row_bytes, median_ms(reps, [&] {
                      check(grad_correction(local, halfrows, cu_local, GradOp::copy, GradOp::none), "grad");
                    })});
    rows.push_back({"grad_correction (none, add)", 3.0 * (t / 2) * row_bytes, median_ms(reps, [&] {
                      check(grad_correction(local, halfrows, cu_local, GradOp::none, GradOp::add), "grad");
                    })});
    rows.push_back({"grad_correction (add, copy)", 2.5 * t * row_bytes, median_ms(reps, [&] {
                      check(grad_correction(local, local2, cu_local, GradOp::add, GradOp::copy), "grad");
                    })});
  }

  // LSE helpers: packed [16, 16M] float32 (1 GiB) of a rank-local layout of 16M rows.
  {
    const int64_t t = int64_t{16} << 20;
    const Layout g = layout(t * W);
    std::vector<int32_t> cul;
    for (int32_t x : g.cu_padded) cul.push_back(x / W);
    const DeviceOffsets cu_local(cul);
    Buffer full(heads * t * 4), half(heads * (t / 2) * 4);
    check(cudaMemset(full.ptr, 0, heads * t * 4), "memset");
    check(cudaMemset(half.ptr, 0, heads * (t / 2) * 4), "memset");
    const DeviceLse lf{static_cast<float*>(full.ptr), {true, heads, 0, t}};
    const DeviceLse lh{static_cast<float*>(half.ptr), {true, heads, 0, t / 2}};
    const double elems = static_cast<double>(heads) * (t / 2);
    rows.push_back({"second_half_lse_correction", 12.0 * elems, median_ms(reps, [&] {
                      check(second_half_lse_correction(lf, lh, cu_local), "lse corr");
                    })});
    // Every lse_half element written once (copied or zero) and every copied one read: 8 bytes per element (the
    // zero-fill is fused; a separate memset pass would add 4 more bytes per element that the result does not need).
    rows.push_back({"read_second_half_lse (zero-fill fused)", 8.0 * elems,
                    median_ms(reps, [&] { check(read_second_half_lse(lf, lh, cu_local), "lse read"); })});
    // The same calls on one sequence of t rows (diagnostic): the second-half rows of every head form one dense run
    // instead of runs of 64-512 rows with equal gaps between them, and no sequence boundary is crossed.
    const DeviceOffsets one_sequence(std::vector<int32_t>{0, static_cast<int32_t>(t)});
    rows.push_back({"  correction, one sequence (diagnostic)", 12.0 * elems, median_ms(reps, [&] {
                      check(second_half_lse_correction(lf, lh, one_sequence), "lse corr");
                    })});
    rows.push_back({"  read, one sequence (diagnostic)", 8.0 * elems,
                    median_ms(reps, [&] { check(read_second_half_lse(lf, lh, one_sequence), "lse read"); })});
  }

  // Partitioned indices: 128M local rows of a 512M-row layout (1 GiB of int64 written).
  {
    const int64_t T = int64_t{512} << 20;
    const Layout g = layout(T);
    const DeviceOffsets cup(g.cu_padded);
    const int64_t n = T / W;
    Buffer idx(n * 8);
    rows.push_back({"partitioned_indices (int64)", 8.0 * n, median_ms(reps, [&] {
                      check(partitioned_indices(cup, W, 1, static_cast<int64_t*>(idx.ptr), n), "indices");
                    })});
    rows.push_back({"  same stores, no offsets (diagnostic)", 8.0 * n, median_ms(reps, [&] {
                      tile_store_kernel<<<prop.multiProcessorCount * 8, 256>>>(static_cast<longlong2*>(idx.ptr), n);
                    })});
  }

  const double memcpy_gbs = rows[0].bytes / rows[0].ms / 1e6, kernel_gbs = rows[1].bytes / rows[1].ms / 1e6;
  std::printf("%-42s %10s %10s %10s %12s %12s\n", "helper (bf16 rows 16x128, W=4)", "GiB/call", "ms", "GB/s",
              "% memcpy", "% copy kern");
  for (const Row& r : rows) {
    const double gbs = r.bytes / r.ms / 1e6;
    std::printf("%-42s %10.3f %10.3f %10.1f %11.1f%% %11.1f%%\n", r.name.c_str(), r.bytes / GiB, r.ms, gbs,
                100.0 * gbs / memcpy_gbs, 100.0 * gbs / kernel_gbs);
  }
  return 0;
}
