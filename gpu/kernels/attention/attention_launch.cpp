// Entry points of the GPU attention: argument checks and dispatch on the dtype.
#include <cmath>
#include <string>

#include "gpu/kernels/attention/attention_launch.hpp"

namespace cpgold::gpu {

namespace detail {
AttentionParams base_params(const AttentionPlan::Impl& plan) {
  AttentionParams p{};
  p.q_rows = plan.q_rows;
  p.kv_rows = plan.kv_rows;
  p.heads_q = plan.shape.heads_q;
  p.heads_kv = plan.shape.heads_kv;
  p.group = plan.shape.heads_q / plan.shape.heads_kv;
  p.window_left = plan.window.left;
  p.window_right = plan.window.right;
  p.softmax_scale = static_cast<float>(plan.softmax_scale);
  p.scale_log2 = static_cast<float>(plan.softmax_scale * 1.4426950408889634);
  p.sequences = plan.sequences;
  return p;
}

AttentionParams forward_params(const AttentionPlan::Impl& plan, const ForwardBuffers& b) {
  AttentionParams p = base_params(plan);
  p.q = b.q;
  p.k = b.k;
  p.v = b.v;
  p.o = b.o;
  p.lse = b.lse;
  return p;
}

AttentionParams backward_params(const AttentionPlan::Impl& plan, const BackwardBuffers& b) {
  // The backward reads O and the LSE; the kernels' parameter block holds them as the forward writes them.
  AttentionParams p = forward_params(plan, {b.q, b.k, b.v, const_cast<void*>(b.o), const_cast<float*>(b.lse)});
  p.dout = b.dout;
  p.dq = b.dq;
  p.dk = b.dk;
  p.dv = b.dv;
  p.dq_sum = b.dq_sum.data;
  p.dk_sum = b.dk_sum.data;
  p.dv_sum = b.dv_sum.data;
  p.q_sum_rows = b.dq_sum.rows;
  p.kv_sum_rows = b.dk_sum.rows;
  p.dq_sum_assign = b.dq_sum.assign;
  p.dk_sum_assign = b.dk_sum.assign;
  p.dv_sum_assign = b.dv_sum.assign;
  p.dq_result = b.dq_sum.result;
  p.dk_result = b.dk_sum.result;
  p.dv_result = b.dv_sum.result;
  p.delta = const_cast<float*>(b.delta);
  return p;
}

cudaError_t allocate_backward_workspace(AttentionParams& p, bool atomic, int dim_qk, cudaStream_t stream,
                                        BackwardWorkspace& w) {
  w.own_delta = p.delta == nullptr;
  const size_t delta_elems = w.own_delta ? static_cast<size_t>(p.heads_q) * p.q_rows : 0;
  w.accum_elems = atomic ? static_cast<size_t>(p.q_rows) * p.heads_q * dim_qk : 0;
  const size_t bytes = (delta_elems + w.accum_elems) * sizeof(float);
  w.data = nullptr;
  if (bytes > 0) {
    cudaMemPool_t pool = nullptr;
    if (cudaError_t e = workspace_pool(pool); e != cudaSuccess) return e;
    if (cudaError_t e = cudaMallocFromPoolAsync(&w.data, bytes, pool, stream); e != cudaSuccess) {
      w.data = nullptr;
      return e;
    }
  }
  p.dq_accum = static_cast<float*>(w.data);
  if (w.own_delta) p.delta = static_cast<float*>(w.data) + w.accum_elems;
  return cudaSuccess;
}

cudaError_t free_backward_workspace(const BackwardWorkspace& w, cudaStream_t stream) {
  return w.data != nullptr ? cudaFreeAsync(w.data, stream) : cudaSuccess;
}
}  // namespace detail

Outcome attention_forward(const AttentionPlan& plan, const ForwardBuffers& b, void* stream, ForwardKernel kernel,
                          ForwardSchedule schedule) {
  const AttentionPlan::Impl* impl = plan.impl();
  if (impl == nullptr) return {Status::invalid_argument, "attention_forward: the plan was not built"};
  if (impl->outside.leave_q)
    return {Status::invalid_argument, "attention_forward: a plan built with leave_q would leave O and LSE rows unwritten"};
  if ((impl->q_rows > 0 && (b.q == nullptr || b.o == nullptr || b.lse == nullptr)) ||
      (impl->kv_rows > 0 && (b.k == nullptr || b.v == nullptr)))
    return {Status::invalid_argument, "attention_forward: a buffer is null"};
  ForwardKernel chosen = ForwardKernel::mma_sync;
  if (Outcome o = forward_kernel_for(impl->shape, kernel, chosen); !o.ok()) return o;
  auto s = static_cast<cudaStream_t>(stream);
#if CPGOLD_HAVE_SM90_FORWARD
  if (chosen == ForwardKernel::wgmma) {
    ForwardScheduleChoice sched;
    if (Outcome o = forward_schedule_for(plan, schedule, sched); !o.ok()) return o;
    if (impl->shape.dtype == DType::bf16) return detail::launch_forward_sm90_bf16(*impl, b, sched, s);
    if (impl->shape.dtype == DType::fp16) return detail::launch_forward_sm90_fp16(*impl, b, sched, s);
  }
#endif
  if (impl->shape.dtype == DType::bf16) return detail::launch_forward_bf16(*impl, b, s);
  if (impl->shape.dtype == DType::fp16) return detail::launch_forward_fp16(*impl, b, s);
  return {Status::unsupported, "attention_forward: dtype outside the capability table"};
}

Outcome attention_backward(const AttentionPlan& plan, const BackwardBuffers& b, BackwardMode mode, void* stream,
                           BackwardKernel kernel) {
  const AttentionPlan::Impl* impl = plan.impl();
  if (impl == nullptr) return {Status::invalid_argument, "attention_backward: the plan was not built"};
  const int sums = (b.dq_sum.data != nullptr) + (b.dk_sum.data != nullptr) + (b.dv_sum.data != nullptr);
  if (sums != 0 && sums != 3)
    return {Status::invalid_argument, "attention_backward: dq_sum, dk_sum and dv_sum are set together or not at all"};
  const bool summing = sums == 3;
  const bool any_result = b.dq_sum.result != nullptr || b.dk_sum.result != nullptr || b.dv_sum.result != nullptr;
  if (any_result && !summing)
    return {Status::invalid_argument, "attention_backward: a sum's result is set outside the summing form"};
  if ((b.dk_sum.result != nullptr) != (b.dv_sum.result != nullptr))
    return {Status::invalid_argument, "attention_backward: dk_sum.result and dv_sum.result are set together or not at all"};
  if ((impl->outside.leave_q && b.dq_sum.result != nullptr) || (impl->outside.leave_kv && b.dk_sum.result != nullptr))
    return {Status::invalid_argument,
            "attention_backward: a sum's result with a plan that leaves rows outside its segments (their result rows "
            "would stay unwritten)"};
  if (summing && ((impl->q_rows > 0 && b.dq_sum.rows == nullptr) ||
                  (impl->kv_rows > 0 && (b.dk_sum.rows == nullptr || b.dk_sum.rows != b.dv_sum.rows))))
    return {Status::invalid_argument, "attention_backward: a sum's row map is null, or dK's and dV's differ"};
  if ((impl->q_rows > 0 && (b.q == nullptr || b.o == nullptr || b.lse == nullptr || b.dout == nullptr ||
                            (!summing && b.dq == nullptr))) ||
      (impl->kv_rows > 0 && (b.k == nullptr || b.v == nullptr || (!summing && (b.dk == nullptr || b.dv == nullptr)))))
    return {Status::invalid_argument, "attention_backward: a buffer is null"};
  if (impl->outside.leave_kv && impl->kv_rows > 0 && (!summing || b.dk_sum.assign || b.dv_sum.assign))
    return {Status::invalid_argument,
            "attention_backward: a plan built with leave_kv needs the summing form into sums that hold every row "
            "already (dk_sum/dv_sum assign false)"};
  if (impl->outside.leave_q && impl->q_rows > 0 && (!summing || b.dq_sum.assign))
    return {Status::invalid_argument,
            "attention_backward: a plan built with leave_q needs the summing form into a sum that holds every row "
            "already (dq_sum assign false)"};
  BackwardKernel chosen = BackwardKernel::mma_sync;
  if (Outcome o = backward_kernel_for(impl->shape, kernel, chosen); !o.ok()) return o;
  auto s = static_cast<cudaStream_t>(stream);
#if CPGOLD_HAVE_SM90_BACKWARD
  if (chosen == BackwardKernel::wgmma) {
    if (impl->shape.dtype == DType::bf16) return detail::launch_backward_sm90_bf16(*impl, b, mode, s);
    if (impl->shape.dtype == DType::fp16) return detail::launch_backward_sm90_fp16(*impl, b, mode, s);
  }
#endif
  if (impl->shape.dtype == DType::bf16) return detail::launch_backward_bf16(*impl, b, mode, s);
  if (impl->shape.dtype == DType::fp16) return detail::launch_backward_fp16(*impl, b, mode, s);
  return {Status::unsupported, "attention_backward: dtype outside the capability table"};
}

Outcome attention_row_delta(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                            void* stream) {
  if (Outcome cap = check_capability(shape); !cap.ok()) return cap;
  if (rows < 0) return {Status::invalid_argument, "attention_row_delta: rows=" + std::to_string(rows) + " is negative"};
  if (rows > 0 && (o == nullptr || dout == nullptr || delta == nullptr))
    return {Status::invalid_argument, "attention_row_delta: a buffer is null"};
  auto s = static_cast<cudaStream_t>(stream);
  if (shape.dtype == DType::bf16) return detail::launch_row_delta_bf16(shape, o, dout, rows, delta, s);
  return detail::launch_row_delta_fp16(shape, o, dout, rows, delta, s);
}

}  // namespace cpgold::gpu
