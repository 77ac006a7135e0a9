// Which backward kernel serves a call: the sm_90a wgmma backward on devices of compute capability 9.0 for the head
// dims of the capability table (sim/case/gpu_table.hpp), the mma.sync backward elsewhere; an explicit request or
// CPGOLD_BACKWARD_KERNEL picks one.
#include <string>

#include "gpu/kernels/attention/attention.hpp"
#include "gpu/kernels/attention/attention_launch.hpp"
#include "gpu/kernels/attention/env_request.hpp"

namespace cpgold::gpu {

std::string_view backward_kernel_name(BackwardKernel kernel) { return detail::kernel_choice_name(kernel); }

std::optional<BackwardKernel> parse_backward_kernel(std::string_view text) {
  return detail::parse_kernel_choice<BackwardKernel>(text);
}

bool wgmma_backward_serves(const AttentionShape& shape) {
  // The configurations of gpu/kernels/sm90/attention_sm90_backward_launch.cuh (in builds that have it): every
  // head-dim pair of the capability table (32/32, 64/64, 96/96, 128/128, 128/64 with 128 keys per CTA; 192/128 and
  // 256/256 in the wide configuration, 64 keys per CTA).
  const int d = shape.dim_qk, dv = shape.dim_v;
  return CPGOLD_HAVE_SM90_BACKWARD && (shape.dtype == DType::bf16 || shape.dtype == DType::fp16) &&
         ((d == dv && (d == 32 || d == 64 || d == 96 || d == 128 || d == 256)) || (d == 128 && dv == 64) ||
          (d == 192 && dv == 128));
}

Outcome choose_backward_kernel(const AttentionShape& shape, int cc, BackwardKernel requested, BackwardKernel& chosen) {
  const bool serves = wgmma_backward_serves(shape);
  // d_qk 32 runs in 64-column tiles in the wgmma backward (half of its products are padding): the mma.sync backward
  // is faster there (0.82-0.90x for wgmma, run B11 of lab/records/gpu-results.md), so it stays the automatic choice.
  const bool automatic = serves && shape.dim_qk > 32;
  return detail::choose_kernel(
      {"backward", CPGOLD_HAVE_SM90_BACKWARD != 0, serves, automatic,
       "; it serves 32/32, 64/64, 96/96, 128/128, 128/64, 192/128 and 256/256"},
      shape, cc, requested, chosen);
}

Outcome backward_kernel_for(const AttentionShape& shape, BackwardKernel requested, BackwardKernel& chosen) {
  Outcome o = detail::apply_env_request("CPGOLD_BACKWARD_KERNEL", parse_backward_kernel, "auto, mma, wgmma", requested);
  if (!o.ok()) return o;
  return choose_backward_kernel(shape, detail::current_device_cc(), requested, chosen);
}

std::string backward_kernel_description(const AttentionShape& shape, BackwardKernel requested) {
  BackwardKernel chosen = BackwardKernel::mma_sync;
  if (Outcome o = backward_kernel_for(shape, requested, chosen); !o.ok()) return "unsupported: " + o.message;
  if (chosen == BackwardKernel::wgmma) {
    if (detail::wgmma_backward_wide(shape.dim_qk, shape.dim_v))
      return "wgmma sm_90a (key tile 64, Q blocks 64 of 32 rows per warpgroup, dK/dV head-dim columns split between "
             "2 consumer warpgroups; atomic dQ: TMA reduce-add; deterministic dQ: Q tile 128)";
    return "wgmma sm_90a (key tile 128, Q blocks 64, 2 consumer warpgroups; atomic dQ: TMA reduce-add; "
           "deterministic dQ: Q tile 128)";
  }
  return "mma.sync (key tile 64, Q tile 64)";
}

}  // namespace cpgold::gpu
