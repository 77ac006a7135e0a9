#pragma once
// Host-tensor entry points for tests and `cpgold verify`: upload float tensors holding values of the dtype, run the
// kernels, download the results as float. Synchronous.
#include "gpu/attention.hpp"
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
// unwritten shows up as NaN (LSE pad rows excepted: the contract leaves them to the kernel).
Outcome forward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                          const Tensor3<float>& v, HostForward& out);
Outcome backward_on_device(const AttentionCall& call, DType dtype, const Tensor3<float>& q, const Tensor3<float>& k,
                           const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                           const Tensor3<float>& dout, BackwardMode mode, HostBackward& out);

// The shape of a call on these tensors (heads and dims read off q and v).
AttentionShape shape_of(DType dtype, const Tensor3<float>& q, const Tensor3<float>& k, const Tensor3<float>& v);

}  // namespace cpgold::gpu
