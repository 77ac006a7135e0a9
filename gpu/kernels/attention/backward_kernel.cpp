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
#if CPGOLD_HAVE_SM90_BACKWARD
  // The configurations of gpu/kernels/sm90/attention_sm90_backward_launch.cuh: every head-dim pair of the capability
  // table (32/32, 64/64, 96/96, 128/128, 128/64 with 128 keys per CTA; 192/128 and 256/256 in the wide
  // configuration, 64 keys per CTA).
  const int d = shape.dim_qk, dv = shape.dim_v;
  return (shape.dtype == DType::bf16 || shape.dtype == DType::fp16) &&
         ((d == dv && (d == 32 || d == 64 || d == 96 || d == 128 || d == 256)) || (d == 128 && dv == 64) ||
          (d == 192 && dv == 128));
#else
  (void)shape;
  return false;
#endif
}

Outcome choose_backward_kernel(const AttentionShape& shape, int cc, BackwardKernel requested, BackwardKernel& chosen) {
  const bool device_ok = cc == 90;  // sm_90a code runs on compute capability 9.0 only
  const bool serves = wgmma_backward_serves(shape);
  switch (requested) {
    case BackwardKernel::mma_sync: chosen = BackwardKernel::mma_sync; return {};
    case BackwardKernel::automatic:
      // d_qk 32 runs in 64-column tiles in the wgmma backward (half of its products are padding): the mma.sync
      // backward is faster there (0.82-0.90x for wgmma, run B11 of lab/records/gpu-results.md), so it stays the choice.
      chosen = device_ok && serves && shape.dim_qk > 32 ? BackwardKernel::wgmma : BackwardKernel::mma_sync;
      return {};
    case BackwardKernel::wgmma:
      if (!serves) {
#if CPGOLD_HAVE_SM90_BACKWARD
        return {Status::unsupported, "the wgmma backward does not serve d_qk=" + std::to_string(shape.dim_qk) +
                                         ", d_v=" + std::to_string(shape.dim_v) + " (" +
                                         std::string(dtype_name(shape.dtype)) +
                                         "); it serves 32/32, 64/64, 96/96, 128/128, 128/64, 192/128 and 256/256"};
#else
        return {Status::unsupported, "the wgmma backward is not in this build (nvcc older than 12.3)"};
#endif
      }
      if (!device_ok)
        return {Status::unsupported,
                "the wgmma backward needs a device of compute capability 9.0 (sm_90a); this one is " +
                    (cc == 0 ? std::string("absent") : std::to_string(cc / 10) + "." + std::to_string(cc % 10))};
      chosen = BackwardKernel::wgmma;
      return {};
  }
  return {Status::invalid_argument, "backward kernel request out of range"};
}

namespace {

// CPGOLD_BACKWARD_KERNEL, read once: the request that replaces `automatic`.
const detail::EnvRequest<BackwardKernel>& env_kernel() {
  static const auto request = detail::read_env_request("CPGOLD_BACKWARD_KERNEL", parse_backward_kernel);
  return request;
}

}  // namespace

Outcome backward_kernel_for(const AttentionShape& shape, BackwardKernel requested, BackwardKernel& chosen) {
  if (Outcome o = detail::apply_env_request(env_kernel, "auto, mma, wgmma", requested); !o.ok()) return o;
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
