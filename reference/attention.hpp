#pragma once
// Exact CPU attention over an AttentionCall, forward (O, LSE) and backward (dQ, dK, dV), in two arithmetics:
//  - the oracle: float64 throughout, on inputs as stored (bf16/fp16 values are exact in float64);
//  - the peer: rounds where a flash kernel rounds and nowhere else (docs/numerics.md): float32 accumulation,
//    inputs in the dtype, P rounded to the dtype before P.V and P^T.dO, dS rounded before dS.K and dS^T.Q,
//    O/dQ/dK/dV rounded to the dtype, LSE float32.
// Shapes: q [t_q, h_q, d_qk], k [t_kv, h_kv, d_qk], v [t_kv, h_kv, d_v], o/dout [t_q, h_q, d_v],
// lse [h_q, t_q]; h_q = g * h_kv with contiguous groups (query head h reads kv head h / g).
// Rows outside the call's Q segments: O, dQ = 0 and LSE = -inf; K/V rows outside its KV segments: dK, dV = 0.
// Rows outside the segments are never read, so NaN/Inf there cannot reach a valid output.
// Work is split with OpenMP over (sequence, head, row block); each output element is produced by one task in a
// fixed order, so results are bitwise identical for any thread count.
#include "reference/attention_call.hpp"
#include "reference/dtype.hpp"
#include "reference/input_error.hpp"
#include "reference/progress.hpp"
#include "reference/tensor.hpp"

namespace cpgold {

// Order-of-operations knobs of a run. Defaults define the reference; `cpgold check --self` varies them to get an
// independent but equally legitimate low-precision path.
struct KernelOptions {
  int row_block = 64;       // query rows per task and per tile (also key rows per backward dK/dV task)
  bool scale_on_k = false;  // multiply K by the scale (in the accumulation type) instead of the scores
  ProgressSink* progress = nullptr;  // told of every score tile computed; no influence on any result
};

template <class T>
struct ForwardResult {
  Tensor3<T> o;     // [t_q, h_q, d_v]
  LseTensor<T> lse; // [h_q, t_q]
};

template <class T>
struct BackwardResult {
  Tensor3<T> dq, dk, dv;
};

// Oracle (float64).
ForwardResult<double> attention_forward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                        const Tensor3<double>& v, const KernelOptions& options = {});
BackwardResult<double> attention_backward(const AttentionCall& call, const Tensor3<double>& q,
                                          const Tensor3<double>& k, const Tensor3<double>& v,
                                          const Tensor3<double>& o, const LseTensor<double>& lse,
                                          const Tensor3<double>& dout, const KernelOptions& options = {});

// Peer (float32 accumulation, rounding to `dtype`). Inputs must already hold values of the dtype.
ForwardResult<float> attention_forward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                       const Tensor3<float>& v, DType dtype, const KernelOptions& options = {});
BackwardResult<float> attention_backward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                         const Tensor3<float>& v, const Tensor3<float>& o,
                                         const LseTensor<float>& lse, const Tensor3<float>& dout, DType dtype,
                                         const KernelOptions& options = {});

// Bytes one thread's tasks hold while they run (score and gradient tiles, accumulators, Eigen's packing blocks) for
// tiles of `options.row_block` rows over at most `max_keys` keys, in the accumulation type (8 bytes for the oracle, 4
// for the peer): what the kernels need beside their inputs and outputs.
double attention_workspace_bytes(int64_t max_keys, int64_t dim_qk, int64_t dim_v, int element_bytes,
                                 const KernelOptions& options = {});

// Pins Eigen's cache-size assumptions (its GEMM blocking) and disables Eigen's own threading so that results do not
// depend on the host. Called by every entry point above; idempotent.
void pin_eigen_blocking();

// The tensors a backward takes beside q, k, v: o [tq, hq, d_v], dout of o's shape, lse [hq, tq]; InputError naming the
// tensor otherwise. Every engine's backward checks them (reference/attention_engine.hpp).
template <class T>
void check_backward_shapes(const Tensor3<T>& q, const Tensor3<T>& v, const Tensor3<T>& o, const LseTensor<T>& lse,
                           const Tensor3<T>& dout) {
  if (o.rows != q.rows || o.heads != q.heads || o.dim != v.dim)
    fail_input("o", "has shape [", o.rows, ", ", o.heads, ", ", o.dim, "], expected [", q.rows, ", ", q.heads, ", ",
               v.dim, "]");
  if (!dout.same_shape(o))
    fail_input("dout", "has shape [", dout.rows, ", ", dout.heads, ", ", dout.dim, "], expected that of o");
  if (lse.heads != q.heads || lse.rows != q.rows)
    fail_input("lse", "has shape [", lse.heads, ", ", lse.rows, "], expected [", q.heads, ", ", q.rows, "]");
}

}  // namespace cpgold
