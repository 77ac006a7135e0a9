#pragma once
// Host-tensor entry points for tests and `cpgold verify`: upload float tensors holding values of the dtype, run the
// kernels, download the results as float. Synchronous.
#include "gpu/kernels/attention/attention.hpp"
#include <cstdint>
#include <vector>

#include "reference/tensor.hpp"

namespace cpgold::gpu {

struct HostForward {
  Tensor3<float> o;       // [q_rows, h_q, d_v]
  LseTensor<float> lse;   // [h_q, q_rows]
};

struct HostBackward {
  Tensor3<float> dq, dk, dv;
};

// Output tensors are pre-filled on the device with a NaN pattern before the launch, so a row the kernels leave
// unwritten shows up as NaN (LSE pad rows excepted: the contract leaves them to the kernel). `kernel` as in
// attention_forward.
Outcome forward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                          const Tensor3<float>& v, HostForward& out, ForwardKernel kernel = ForwardKernel::automatic,
                          ForwardSchedule schedule = ForwardSchedule::automatic);
// The backward's choices: `kernel` as in attention_backward; caller_delta: delta computed first by
// attention_row_delta and given as BackwardBuffers::delta (the CP executor's way) instead of by the backward.
struct HostBackwardOptions {
  BackwardKernel kernel = BackwardKernel::automatic;
  bool caller_delta = false;
};
Outcome backward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                           const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                           const Tensor3<float>& dout, BackwardMode mode, HostBackward& out,
                           HostBackwardOptions options = {});

// The summing form (BackwardBuffers' RowSum): dq, dk and dv are float32 sums of any row count, uploaded, added into at
// the maps' rows (q_map: one entry per Q row of the call; kv_map: per KV row, shared by dK and dV), downloaded back.
// result_q (result_kv): the call is the last contribution (RowSum::result); dq (dk and dv) then come back as the
// dtype results, read from a result tensor pre-filled with a NaN pattern (rows outside the map stay NaN).
struct HostSums {
  Tensor3<float> dq, dk, dv;
  std::vector<int64_t> q_map, kv_map;
  bool assign_q = false, assign_kv = false;
  bool result_q = false, result_kv = false;
  OutsideRows outside;  // the plan's OutsideRows: with leave_q (leave_kv), rows outside the segments add nothing
};
Outcome backward_sum_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q,
                               const Tensor3<float>& k, const Tensor3<float>& v, const Tensor3<float>& o,
                               const LseTensor<float>& lse, const Tensor3<float>& dout, BackwardMode mode,
                               HostSums& sums, HostBackwardOptions options = {});

// The shape of a call on these tensors (heads and dims read off q and v).
AttentionShape shape_of(DType dtype, const Tensor3<float>& q, const Tensor3<float>& k, const Tensor3<float>& v);

}  // namespace cpgold::gpu
