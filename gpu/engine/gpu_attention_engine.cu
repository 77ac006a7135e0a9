// The GPU engine (gpu/engine/gpu_attention_engine.hpp for the contract and the arithmetic).
#include "gpu/engine/gpu_attention_engine.hpp"

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "reference/attention.hpp"
#include "reference/input_error.hpp"

namespace cpgold::gpu_engine {

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("GPU engine: ") + what + ": " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
}
void check_blas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("GPU engine: ") + what + ": cuBLAS status " + std::to_string(int(status)));
}
void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// Rounding modes of the peer: none (the oracle, and fp32), bf16, fp16.
enum RoundMode : int { kRoundNone = 0, kRoundBf16 = 1, kRoundFp16 = 2 };

__device__ __forceinline__ float round_value(float x, int mode) {
  if (mode == kRoundBf16) {  // reference/dtype.hpp round_to_bf16, bit for bit
    const uint32_t bits = __float_as_uint(x);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const uint32_t quiet_nan = (bits & 0x80000000u) | 0x7fc00000u;
    return __uint_as_float((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
  if (mode == kRoundFp16) return __half2float(__float2half_rn(x));
  return x;
}
__device__ __forceinline__ double round_value(double x, int) { return x; }

// Arithmetic without contraction (the reference is compiled with -ffp-contract=off).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float log_of(float x) { return logf(x); }
__device__ __forceinline__ double log_of(double x) { return log(x); }

// The key runs of one block (at most 2 KV segments per sequence: at most 2 runs), as kernel parameters.
struct KeyRuns {
  int count = 0;
  int64_t col[4] = {0, 0, 0, 0};       // first column of the run in the score tile
  int64_t length[4] = {0, 0, 0, 0};    // keys in the run
  int64_t position[4] = {0, 0, 0, 0};  // position of the run's first key
};
struct MaskParams {
  int32_t left = -1, right = -1;  // window
  int64_t delta = 0;              // L_kv - L_q of the sequence
  int64_t q_position = 0;         // position of the block's first query row
};

// Whether column c of row i is a visible key (reference/attention.cpp, visible_columns).
__device__ __forceinline__ bool column_visible(const KeyRuns& runs, const MaskParams& m, int64_t i, int64_t c) {
  int r = 0;
#pragma unroll
  for (int x = 1; x < 4; ++x)
    if (x < runs.count && c >= runs.col[x]) r = x;
  const int64_t k_pos = runs.position[r] + (c - runs.col[r]);
  const int64_t diag = m.q_position + i + m.delta;
  if (m.left >= 0 && k_pos < diag - m.left) return false;
  if (m.right >= 0 && k_pos > diag + m.right) return false;
  return true;
}

constexpr int kRowThreads = 256;

// Fixed-order block reduction (the same tree on every run).
template <class T, class Op>
__device__ T block_reduce(T value, T* shared, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kRowThreads / 32 ? shared[lane] : shared[0];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const T other = __shfl_down_sync(0xffffffffu, value, offset);
      if (lane + offset < kRowThreads / 32) value = op(value, other);
    }
    if (lane == 0) shared[0] = value;
  }
  __syncthreads();
  const T result = shared[0];
  __syncthreads();
  return result;
}

// Forward softmax of one row per thread block (grid: rows x heads of the group): row max over the visible keys,
// P = exp(s - max) (0 where masked), the row sum of the unrounded P, then P rounded to the dtype in place.
template <class T>
__global__ void softmax_forward_kernel(T* s, int64_t rows, int64_t n, KeyRuns runs, MaskParams mask, T* row_max,
                                       T* row_sum, int mode) {
  __shared__ T shared[32];
  const int64_t i = blockIdx.x, head = blockIdx.y;
  T* row = s + (head * rows + i) * n;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  T local = neg_inf;
  for (int64_t c = threadIdx.x; c < n; c += kRowThreads)
    if (column_visible(runs, mask, i, c)) local = fmax(local, row[c]);
  const T mx = block_reduce(local, shared, [](T a, T b) { return fmax(a, b); });
  if (mx == neg_inf) {  // no visible key: O = 0, LSE = -inf
    for (int64_t c = threadIdx.x; c < n; c += kRowThreads) row[c] = T(0);
    if (threadIdx.x == 0) row_max[head * rows + i] = neg_inf, row_sum[head * rows + i] = T(0);
    return;
  }
  T sum = T(0);
  for (int64_t c = threadIdx.x; c < n; c += kRowThreads) {
    const T p = column_visible(runs, mask, i, c) ? exp_of(sub_rn(row[c], mx)) : T(0);
    sum = add_rn(sum, p);
    row[c] = round_value(p, mode);
  }
  const T total = block_reduce(sum, shared, [](T a, T b) { return add_rn(a, b); });
  if (threadIdx.x == 0) row_max[head * rows + i] = mx, row_sum[head * rows + i] = total;
}

// O = round(O_acc / sum), LSE = max + log(sum) for rows with a visible key (others keep O = 0, LSE = -inf).
template <class T>
__global__ void forward_finalize_kernel(const T* o_acc, const T* row_max, const T* row_sum, T* o, T* lse,
                                        int64_t rows, int64_t group, int64_t dim, int64_t first_row, int64_t head0,
                                        int64_t heads, int64_t total_rows, int mode) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= group * rows * dim) return;
  const int64_t x = e % dim, i = (e / dim) % rows, j = e / (dim * rows);
  const T sum = row_sum[j * rows + i];
  if (sum == T(0)) return;
  o[((first_row + i) * heads + head0 + j) * dim + x] = round_value(div_rn(o_acc[e], sum), mode);
  if (x == 0) lse[(head0 + j) * total_rows + first_row + i] = add_rn(row_max[j * rows + i], log_of(sum));
}

// dst[j][i][x] = src[first_row + i, head0 + j, x]: the group's rows of a [t, h, d] tensor, contiguous.
template <class T>
__global__ void pack_rows_kernel(const T* src, T* dst, int64_t rows, int64_t group, int64_t dim, int64_t first_row,
                                 int64_t head0, int64_t heads) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= group * rows * dim) return;
  const int64_t x = e % dim, i = (e / dim) % rows, j = e / (dim * rows);
  dst[e] = src[((first_row + i) * heads + head0 + j) * dim + x];
}

// D[j][i] = sum_x dO * O over x in order (reference/attention.cpp, row_delta), and the row's LSE.
template <class T>
__global__ void row_delta_kernel(const T* o, const T* dout, const T* lse, T* d, T* row_lse, int64_t rows,
                                 int64_t group, int64_t dim, int64_t first_row, int64_t head0, int64_t heads,
                                 int64_t total_rows) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= group * rows) return;
  const int64_t i = e % rows, j = e / rows;
  const int64_t base = ((first_row + i) * heads + head0 + j) * dim;
  T sum = T(0);
  for (int64_t x = 0; x < dim; ++x) sum = add_rn(sum, mul_rn(dout[base + x], o[base + x]));
  d[e] = sum;
  row_lse[e] = lse[(head0 + j) * total_rows + first_row + i];
}

// P = exp(s - lse) (0 where masked or the row has no key), dS = P (dP - D); then P and dS rounded to the dtype.
// On return `s` holds the rounded P and `dp` the rounded dS.
template <class T>
__global__ void softmax_backward_kernel(T* s, T* dp, const T* row_lse, const T* d, int64_t rows, int64_t n,
                                        int64_t group, KeyRuns runs, MaskParams mask, int mode) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= group * rows * n) return;
  const int64_t c = e % n, r = e / n, i = r % rows;
  const T l = row_lse[r];
  T p = T(0), ds = T(0);
  if (l != -std::numeric_limits<T>::infinity() && column_visible(runs, mask, i, c)) {
    p = exp_of(sub_rn(s[e], l));
    ds = mul_rn(p, sub_rn(dp[e], d[r]));
  }
  s[e] = round_value(p, mode);
  dp[e] = round_value(ds, mode);
}

// out[first_row + i, head0 + j, x] = round(scale * acc[j][i][x]).
template <class T>
__global__ void scatter_scaled_kernel(const T* acc, T* out, T scale, int64_t rows, int64_t group, int64_t dim,
                                      int64_t first_row, int64_t head0, int64_t heads, int mode) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= group * rows * dim) return;
  const int64_t x = e % dim, i = (e / dim) % rows, j = e / (dim * rows);
  out[((first_row + i) * heads + head0 + j) * dim + x] = round_value(mul_rn(scale, acc[e]), mode);
}

// x = round(scale * x) over n elements (scale 1: round(x)).
template <class T>
__global__ void scale_round_kernel(T* x, int64_t n, T scale, bool scaled, int mode) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  x[e] = round_value(scaled ? mul_rn(scale, x[e]) : x[e], mode);
}

template <class T>
__global__ void fill_kernel(T* x, int64_t n, T value) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e < n) x[e] = value;
}

unsigned blocks_for(int64_t n, int threads = 256) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Column-major strided-batched GEMM in T (cuBLAS names its operands column-major).
cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, double alpha,
                    const double* a, int lda, long long sa, const double* b, int ldb, long long sb, double beta,
                    double* c, int ldc, long long sc, int batch) {
  return cublasDgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb, sb, &beta, c, ldc, sc, batch);
}
cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                    const float* a, int lda, long long sa, const float* b, int ldb, long long sb, float beta, float* c,
                    int ldc, long long sc, int batch) {
  return cublasSgemmStridedBatched(h, ta, tb, m, n, k, &alpha, a, lda, sa, b, ldb, sb, &beta, c, ldc, sc, batch);
}

// A device buffer that grows and is reused (its contents are not kept across growth).
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  template <class T>
  T* get(size_t count) {
    const size_t need = std::max<size_t>(count * sizeof(T), 256);
    if (need > bytes) {
      if (ptr) check_cuda(cudaFree(ptr), "cudaFree");
      ptr = nullptr, bytes = 0;
      check_cuda(cudaMalloc(&ptr, need), "cudaMalloc");
      bytes = need;
    }
    return static_cast<T*>(ptr);
  }
};

// One block of query rows of one sequence and the key runs it sees (reference/attention.cpp, block_tasks and
// visible_key_runs).
struct Block {
  int seq = 0;
  int64_t first_row = 0, count = 0, position = 0;
  KeyRuns runs;
  int64_t run_first_row[4] = {0, 0, 0, 0};  // row in the K/V tensors of each run
  int64_t keys = 0;
};

std::vector<Block> make_blocks(const AttentionCall& call, int64_t row_block) {
  std::vector<Block> blocks;
  for (int b = 0; b < static_cast<int>(call.sequences.size()); ++b) {
    const SequenceTile& seq = call.sequences[static_cast<size_t>(b)];
    for (const RowSegment& s : seq.q)
      for (int64_t i = 0; i < s.count; i += row_block) {
        Block block;
        block.seq = b;
        block.first_row = s.first_row + i;
        block.count = std::min<int64_t>(row_block, s.count - i);
        block.position = s.position + i;
        const int64_t p0 = block.position, p1 = block.position + block.count - 1;
        const Window w = call.window;
        int64_t lo = w.left >= 0 ? p0 + seq.delta() - w.left : 0;
        int64_t hi = w.right >= 0 ? p1 + seq.delta() + w.right : seq.length_kv - 1;
        lo = std::max<int64_t>(lo, 0), hi = std::min<int64_t>(hi, seq.length_kv - 1);
        for (const RowSegment& kv : seq.kv) {
          const int64_t a = std::max<int64_t>(lo, kv.position);
          const int64_t e = std::min<int64_t>(hi, static_cast<int64_t>(kv.position) + kv.count - 1);
          if (a > e) continue;
          if (block.runs.count == 4) throw std::logic_error("GPU engine: more than 4 key runs in a block");
          const int r = block.runs.count++;
          block.runs.col[r] = block.keys;
          block.runs.length[r] = e - a + 1;
          block.runs.position[r] = a;
          block.run_first_row[r] = kv.first_row + (a - kv.position);
          block.keys += e - a + 1;
        }
        blocks.push_back(block);
      }
  }
  return blocks;
}

template <class T>
void upload(T* device, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty())
    check_cuda(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream), "upload");
}
template <class T>
void download(std::vector<T>& host, const T* device, cudaStream_t stream) {
  if (!host.empty())
    check_cuda(cudaMemcpyAsync(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost, stream),
               "download");
}

int round_mode(DType dtype) {
  return dtype == DType::bf16 ? kRoundBf16 : dtype == DType::fp16 ? kRoundFp16 : kRoundNone;
}

void check_call(const AttentionCall& call, int64_t q_rows, int64_t q_heads, int64_t q_dim, int64_t kv_rows,
                int64_t kv_heads, int64_t k_dim, int64_t v_rows, int64_t v_heads) {
  if (q_rows != call.q_rows) fail_input("q", "has ", q_rows, " rows but the call addresses ", call.q_rows);
  if (kv_rows != call.kv_rows) fail_input("k", "has ", kv_rows, " rows but the call addresses ", call.kv_rows);
  if (v_rows != kv_rows) fail_input("v", "has ", v_rows, " rows but k has ", kv_rows);
  if (kv_heads <= 0 || q_heads % kv_heads != 0)
    fail_input("heads_kv", "value ", kv_heads, " does not divide heads_q = ", q_heads);
  if (v_heads != kv_heads) fail_input("v", "has ", v_heads, " heads but k has ", kv_heads);
  if (q_dim != k_dim) fail_input("dim_qk", "q has dim ", q_dim, " but k has ", k_dim);
  call.check();
}

class GpuEngine final : public AttentionEngine {
 public:
  GpuEngine() {
    check_cuda(cudaGetDevice(&device_), "cudaGetDevice");
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    int runtime = 0, driver = 0, blas = 0;
    check_cuda(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
    check_cuda(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_blas(cublasCreate(&blas_), "cublasCreate");
    check_blas(cublasSetStream(blas_, stream_), "cublasSetStream");
    // No reduced-precision shortcuts (no TF32 for float), no atomics: the same bits on every run.
    check_blas(cublasSetMathMode(blas_, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
               "cublasSetMathMode");
    check_blas(cublasSetAtomicsMode(blas_, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode");
    check_blas(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
    // A fixed workspace of its own, so that cuBLAS picks the same kernels whatever else runs.
    constexpr size_t kWorkspace = size_t{64} << 20;
    check_cuda(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc (cuBLAS workspace)");
    check_blas(cublasSetWorkspace(blas_, workspace_, kWorkspace), "cublasSetWorkspace");
    check_blas(cublasGetVersion(blas_, &blas), "cublasGetVersion");
    total_memory_ = prop.totalGlobalMem;
    std::ostringstream v;
    v << "device " << prop.name << " (sm_" << prop.major << prop.minor << ", " << prop.multiProcessorCount
      << " SMs, " << (prop.totalGlobalMem >> 20) << " MiB); CUDA runtime " << runtime / 1000 << "." << (runtime % 1000) / 10
      << ", driver API " << driver / 1000 << "." << (driver % 1000) / 10 << ", cuBLAS " << blas / 10000 << "."
      << (blas / 100) % 100 << "." << blas % 100;
    versions_ = v.str();
  }
  ~GpuEngine() override {
    buffers_.clear();
    if (workspace_) cudaFree(workspace_);
    if (blas_) cublasDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "gpu"; }
  std::string versions() const override { return versions_; }

  ForwardResult<double> forward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                const Tensor3<double>& v, const KernelOptions& options) const override {
    return run_forward<double>(call, q, k, v, kRoundNone, options);
  }
  BackwardResult<double> backward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                  const Tensor3<double>& v, const Tensor3<double>& o, const LseTensor<double>& lse,
                                  const Tensor3<double>& dout, const KernelOptions& options) const override {
    return run_backward<double>(call, q, k, v, o, lse, dout, kRoundNone, options);
  }
  ForwardResult<float> forward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                               const Tensor3<float>& v, DType dtype, const KernelOptions& options) const override {
    return run_forward<float>(call, q, k, v, round_mode(dtype), options);
  }
  BackwardResult<float> backward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                 const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                                 const Tensor3<float>& dout, DType dtype, const KernelOptions& options) const override {
    return run_backward<float>(call, q, k, v, o, lse, dout, round_mode(dtype), options);
  }

 private:
  // Buffers by role, reused across calls (the engine's mutex guards them).
  enum Slot { kQ, kK, kV, kO, kDout, kLse, kDq, kDk, kDv, kS, kDp, kAcc, kPack, kRowA, kRowB, kSlots };
  template <class T>
  T* buffer(Slot slot, size_t count) const {
    if (buffers_.empty()) buffers_ = std::vector<DeviceBuffer>(kSlots);
    return buffers_[slot].get<T>(count);
  }

  // Query rows per block: the score tiles (S, and dP in the backward) of a block of the group's heads within about
  // a sixteenth of the device's memory each, at most 2048 rows.
  template <class T>
  int64_t row_block(const AttentionCall& call, int64_t group) const {
    int64_t max_keys = 1;
    for (const SequenceTile& s : call.sequences) {
      int64_t keys = 0;
      for (const RowSegment& kv : s.kv) keys += kv.count;
      max_keys = std::max(max_keys, keys);
    }
    const double budget = double(total_memory_) / 16;
    const int64_t rows = static_cast<int64_t>(budget / (double(group) * double(max_keys) * sizeof(T)));
    return std::clamp<int64_t>(rows / 16 * 16, 16, 2048);
  }

  static MaskParams mask_of(const AttentionCall& call, const Block& b) {
    MaskParams m;
    m.left = call.window.left, m.right = call.window.right;
    m.delta = call.sequences[static_cast<size_t>(b.seq)].delta();
    m.q_position = b.position;
    return m;
  }

  // S[j] = scale Q_j K^T over the block's key runs (j: the group's query heads of KV head kvh), [group][rows][keys].
  template <class T>
  void scores(const Block& b, const T* q, const T* k, T* s, int64_t kvh, int64_t group, int64_t hq, int64_t hkv,
              int64_t dqk, T alpha) const {
    for (int r = 0; r < b.runs.count; ++r)
      check_blas(gemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(b.runs.length[r]), int(b.count), int(dqk), alpha,
                      k + (b.run_first_row[r] * hkv + kvh) * dqk, int(hkv * dqk), 0,
                      q + (b.first_row * hq + kvh * group) * dqk, int(hq * dqk), dqk, T(0), s + b.runs.col[r],
                      int(b.keys), b.count * b.keys, int(group)),
                 "score GEMM");
  }

  template <class T>
  ForwardResult<T> run_forward(const AttentionCall& call, const Tensor3<T>& q, const Tensor3<T>& k,
                               const Tensor3<T>& v, int mode, const KernelOptions& options) const {
    check_call(call, q.rows, q.heads, q.dim, k.rows, k.heads, k.dim, v.rows, v.heads);
    if (options.scale_on_k) throw std::logic_error("GPU engine: scale_on_k is the CPU reference's variant only");
    std::lock_guard<std::mutex> lock(mutex_);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t hq = q.heads, hkv = k.heads, group = hq / hkv, dqk = q.dim, dv = v.dim, tq = q.rows;
    ForwardResult<T> out{Tensor3<T>(q.rows, q.heads, v.dim),
                         LseTensor<T>(q.heads, q.rows, -std::numeric_limits<T>::infinity())};
    if (q.values.empty() || hq == 0) return out;
    T* dq_ = buffer<T>(kQ, q.values.size());
    T* dk_ = buffer<T>(kK, k.values.size());
    T* dv_ = buffer<T>(kV, v.values.size());
    T* do_ = buffer<T>(kO, out.o.values.size());
    T* dl_ = buffer<T>(kLse, out.lse.values.size());
    upload(dq_, q.values, stream_), upload(dk_, k.values, stream_), upload(dv_, v.values, stream_);
    fill_kernel<<<blocks_for(int64_t(out.o.values.size())), 256, 0, stream_>>>(do_, int64_t(out.o.values.size()), T(0));
    fill_kernel<<<blocks_for(int64_t(out.lse.values.size())), 256, 0, stream_>>>(
        dl_, int64_t(out.lse.values.size()), -std::numeric_limits<T>::infinity());
    check_launch("fill");
    const std::vector<Block> blocks = make_blocks(call, row_block<T>(call, group));
    const T scale = static_cast<T>(call.softmax_scale);
    for (const Block& b : blocks) {
      if (options.progress) options.progress->advance(b.count * b.keys * hq);
      if (b.keys == 0) continue;  // no key: the rows keep O = 0, LSE = -inf
      T* s = buffer<T>(kS, size_t(group * b.count * b.keys));
      T* acc = buffer<T>(kAcc, size_t(group * b.count * dv));
      T* mx = buffer<T>(kRowA, size_t(group * b.count));
      T* sum = buffer<T>(kRowB, size_t(group * b.count));
      const MaskParams mask = mask_of(call, b);
      for (int64_t kvh = 0; kvh < hkv; ++kvh) {
        scores(b, dq_, dk_, s, kvh, group, hq, hkv, dqk, scale);
        softmax_forward_kernel<T><<<dim3(unsigned(b.count), unsigned(group)), kRowThreads, 0, stream_>>>(
            s, b.count, b.keys, b.runs, mask, mx, sum, mode);
        check_launch("softmax_forward");
        // O_acc[j] = sum over runs of P[j][:, run] V_run.
        for (int r = 0; r < b.runs.count; ++r)
          check_blas(gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, int(dv), int(b.count), int(b.runs.length[r]), T(1),
                          dv_ + (b.run_first_row[r] * hkv + kvh) * dv, int(hkv * dv), 0, s + b.runs.col[r],
                          int(b.keys), b.count * b.keys, r == 0 ? T(0) : T(1), acc, int(dv), b.count * dv, int(group)),
                     "P.V GEMM");
        const int64_t n = group * b.count * dv;
        forward_finalize_kernel<T><<<blocks_for(n), 256, 0, stream_>>>(acc, mx, sum, do_, dl_, b.count, group, dv,
                                                                         b.first_row, kvh * group, hq, tq, mode);
        check_launch("forward_finalize");
      }
    }
    download(out.o.values, do_, stream_), download(out.lse.values, dl_, stream_);
    check_cuda(cudaStreamSynchronize(stream_), "forward");
    return out;
  }

  template <class T>
  BackwardResult<T> run_backward(const AttentionCall& call, const Tensor3<T>& q, const Tensor3<T>& k,
                                 const Tensor3<T>& v, const Tensor3<T>& o, const LseTensor<T>& lse,
                                 const Tensor3<T>& dout, int mode, const KernelOptions& options) const {
    check_call(call, q.rows, q.heads, q.dim, k.rows, k.heads, k.dim, v.rows, v.heads);
    check_backward_shapes(q, v, o, lse, dout);
    if (options.scale_on_k) throw std::logic_error("GPU engine: scale_on_k is the CPU reference's variant only");
    std::lock_guard<std::mutex> lock(mutex_);
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t hq = q.heads, hkv = k.heads, group = hq / hkv, dqk = q.dim, dv = v.dim, tq = q.rows;
    BackwardResult<T> out{Tensor3<T>(q.rows, q.heads, q.dim), Tensor3<T>(k.rows, k.heads, k.dim),
                          Tensor3<T>(v.rows, v.heads, v.dim)};
    if (q.values.empty() || k.values.empty() || hq == 0) return out;
    T* dq_ = buffer<T>(kQ, q.values.size());
    T* dk_ = buffer<T>(kK, k.values.size());
    T* dv_ = buffer<T>(kV, v.values.size());
    T* do_ = buffer<T>(kO, o.values.size());
    T* ddo_ = buffer<T>(kDout, dout.values.size());
    T* dl_ = buffer<T>(kLse, lse.values.size());
    T* gdq = buffer<T>(kDq, out.dq.values.size());
    T* gdk = buffer<T>(kDk, out.dk.values.size());
    T* gdv = buffer<T>(kDv, out.dv.values.size());
    upload(dq_, q.values, stream_), upload(dk_, k.values, stream_), upload(dv_, v.values, stream_);
    upload(do_, o.values, stream_), upload(ddo_, dout.values, stream_), upload(dl_, lse.values, stream_);
    for (auto [p, n] : {std::pair{gdq, out.dq.values.size()}, {gdk, out.dk.values.size()}, {gdv, out.dv.values.size()}})
      fill_kernel<<<blocks_for(int64_t(n)), 256, 0, stream_>>>(p, int64_t(n), T(0));
    check_launch("fill");
    const std::vector<Block> blocks = make_blocks(call, row_block<T>(call, group));
    const T scale = static_cast<T>(call.softmax_scale);
    for (const Block& b : blocks) {
      // The reference's two passes (dQ, then dK/dV) each compute the block's score tile.
      if (options.progress) options.progress->advance(2 * b.count * b.keys * hq);
      if (b.keys == 0) continue;  // no key: dQ = 0, and nothing to add to dK, dV
      const size_t tile = size_t(group * b.count * b.keys);
      T* s = buffer<T>(kS, tile);
      T* dp = buffer<T>(kDp, tile);
      T* acc = buffer<T>(kAcc, size_t(group * b.count * std::max(dqk, dv)));
      T* pack = buffer<T>(kPack, size_t(group * b.count * std::max(dqk, dv)));
      T* d = buffer<T>(kRowA, size_t(group * b.count));
      T* row_lse = buffer<T>(kRowB, size_t(group * b.count));
      const MaskParams mask = mask_of(call, b);
      for (int64_t kvh = 0; kvh < hkv; ++kvh) {
        const int64_t head0 = kvh * group;
        scores(b, dq_, dk_, s, kvh, group, hq, hkv, dqk, scale);
        // dP[j] = dO_j V^T over the runs.
        for (int r = 0; r < b.runs.count; ++r)
          check_blas(gemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, int(b.runs.length[r]), int(b.count), int(dv), T(1),
                          dv_ + (b.run_first_row[r] * hkv + kvh) * dv, int(hkv * dv), 0,
                          ddo_ + (b.first_row * hq + head0) * dv, int(hq * dv), dv, T(0), dp + b.runs.col[r],
                          int(b.keys), b.count * b.keys, int(group)),
                     "dP GEMM");
        row_delta_kernel<T><<<blocks_for(group * b.count), 256, 0, stream_>>>(
            do_, ddo_, dl_, d, row_lse, b.count, group, dv, b.first_row, head0, hq, tq);
        check_launch("row_delta");
        softmax_backward_kernel<T><<<blocks_for(int64_t(tile)), 256, 0, stream_>>>(s, dp, row_lse, d, b.count, b.keys,
                                                                                    group, b.runs, mask, mode);
        check_launch("softmax_backward");
        // dQ[j] = scale dS[j] K over the runs, rounded once.
        for (int r = 0; r < b.runs.count; ++r)
          check_blas(gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, int(dqk), int(b.count), int(b.runs.length[r]), T(1),
                          dk_ + (b.run_first_row[r] * hkv + kvh) * dqk, int(hkv * dqk), 0, dp + b.runs.col[r],
                          int(b.keys), b.count * b.keys, r == 0 ? T(0) : T(1), acc, int(dqk), b.count * dqk,
                          int(group)),
                     "dQ GEMM");
        scatter_scaled_kernel<T><<<blocks_for(group * b.count * dqk), 256, 0, stream_>>>(
            acc, gdq, scale, b.count, group, dqk, b.first_row, head0, hq, mode);
        check_launch("dq");
        // dV[run] += P^T dO and dK[run] += dS^T Q, over the group's heads and the block's rows at once (the rows
        // of the group packed: [group][rows][d]).
        pack_rows_kernel<T><<<blocks_for(group * b.count * dv), 256, 0, stream_>>>(ddo_, pack, b.count, group, dv,
                                                                                  b.first_row, head0, hq);
        check_launch("pack dO");
        for (int r = 0; r < b.runs.count; ++r)
          check_blas(gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, int(dv), int(b.runs.length[r]), int(group * b.count), T(1),
                          pack, int(dv), 0, s + b.runs.col[r], int(b.keys), 0, T(1),
                          gdv + (b.run_first_row[r] * hkv + kvh) * dv, int(hkv * dv), 0, 1),
                     "dV GEMM");
        pack_rows_kernel<T><<<blocks_for(group * b.count * dqk), 256, 0, stream_>>>(dq_, pack, b.count, group, dqk,
                                                                                   b.first_row, head0, hq);
        check_launch("pack Q");
        for (int r = 0; r < b.runs.count; ++r)
          check_blas(gemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, int(dqk), int(b.runs.length[r]), int(group * b.count),
                          T(1), pack, int(dqk), 0, dp + b.runs.col[r], int(b.keys), 0, T(1),
                          gdk + (b.run_first_row[r] * hkv + kvh) * dqk, int(hkv * dqk), 0, 1),
                     "dK GEMM");
      }
    }
    scale_round_kernel<T><<<blocks_for(int64_t(out.dk.values.size())), 256, 0, stream_>>>(
        gdk, int64_t(out.dk.values.size()), scale, true, mode);
    scale_round_kernel<T><<<blocks_for(int64_t(out.dv.values.size())), 256, 0, stream_>>>(
        gdv, int64_t(out.dv.values.size()), T(1), false, mode);
    check_launch("finalize dK, dV");
    download(out.dq.values, gdq, stream_), download(out.dk.values, gdk, stream_), download(out.dv.values, gdv, stream_);
    check_cuda(cudaStreamSynchronize(stream_), "backward");
    return out;
  }

  int device_ = 0;
  size_t total_memory_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* workspace_ = nullptr;
  std::string versions_;
  mutable std::mutex mutex_;
  mutable std::vector<DeviceBuffer> buffers_;
};

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::unique_ptr<AttentionEngine> make_gpu_engine() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    fail_input("--engine", "gpu: no CUDA device can be used (", cudaGetErrorName(status), ": ",
               cudaGetErrorString(status), "); --engine cpu computes the same fixture on the CPU");
  }
  if (count == 0) fail_input("--engine", "gpu: no CUDA device found; --engine cpu computes the same fixture on the CPU");
  try {
    return std::make_unique<GpuEngine>();
  } catch (const std::runtime_error& e) {
    fail_input("--engine", "gpu: the CUDA device could not be set up: ", e.what());
  }
}

}  // namespace cpgold::gpu_engine
