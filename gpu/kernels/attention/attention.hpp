#pragma once
// Varlen attention on the GPU over an AttentionCall (reference/attention_call.hpp): forward (O, LSE) and backward
// (dQ, dK, dV), bf16/fp16 storage with float32 accumulation, for the capability table of docs/numerics.md.
// Shapes: q [q_rows, h_q, d_qk], k [kv_rows, h_kv, d_qk], v [kv_rows, h_kv, d_v], o/dout [q_rows, h_q, d_v],
// lse [h_q, q_rows] float32; rows are contiguous (row stride h * d); h_q = g * h_kv, query head h reads kv head h/g.
// Contract (the kernels themselves, no clearing by the caller): rows outside the call's Q segments get O = 0,
// dQ = 0 and LSE = -inf; K/V rows outside its KV segments get dK = dV = 0; a valid row with no visible key gets
// O = 0 and LSE = -inf; rows outside the segments are never read into arithmetic, so NaN/Inf there stay there.
// Outside the capability table every entry point returns Status::unsupported with the reason; nothing falls back.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "reference/attention_call.hpp"
#include "reference/dtype.hpp"

namespace cpgold::gpu {

enum class Status {
  ok,
  unsupported,       // outside the capability table (dtype, head dims)
  invalid_argument,  // the call or the buffers do not fit together (heads, rows, overlapping KV rows)
  cuda_error,        // a CUDA call failed; the message names it
};
std::string_view status_name(Status status);  // "ok", "unsupported", "invalid_argument", "cuda_error"

struct Outcome {
  Status status = Status::ok;
  std::string message;  // empty when ok
  bool ok() const { return status == Status::ok; }
};

struct AttentionShape {
  DType dtype = DType::bf16;
  int heads_q = 0, heads_kv = 0;
  int dim_qk = 0, dim_v = 0;
};

// The capability table: bf16/fp16; (d_qk, d_v) in sim/case/gpu_table.hpp (32/32, 64/64, 96/96, 128/128, 128/64,
// 192/128, 256/256); h_q = g * h_kv.
Outcome check_capability(const AttentionShape& shape);

// What the backward does with the rows outside the call's segments. By default it writes them as the contract above
// says (dQ = 0 / dK = dV = 0, or +0 added into the sums). leave_q (leave_kv) keeps the Q (K/V) side's as they are,
// for a call that reads part of larger tensors in place (a CP step reading one half of a rank's tensors): only with
// the summing backward into sums that already hold every row (RowSum::assign false), where it gives the same bits.
// Adding +0 changes no float32 sum: the sums are made by float adds from +0, so none is -0, and every NaN in them is
// the canonical NaN an add returns. The forward takes no plan with leave_q (its O and LSE rows would be unwritten).
struct OutsideRows {
  bool leave_q = false;
  bool leave_kv = false;
};

// Device-side form of one AttentionCall (sequence descriptors and tile lists), built once, reused by every launch.
class AttentionPlan {
 public:
  AttentionPlan();
  ~AttentionPlan();
  AttentionPlan(AttentionPlan&&) noexcept;
  AttentionPlan& operator=(AttentionPlan&&) noexcept;

  // Checks the shape against the capability table and the call (AttentionCall::check, KV rows of different
  // sequences disjoint), then uploads. On failure the plan stays empty.
  Outcome build(const AttentionCall& call, const AttentionShape& shape, OutsideRows outside = {});

  struct Impl;
  const Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

struct ForwardBuffers {  // device pointers; 16-bit elements of the shape's dtype
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
};

// A float32 sum that a backward output is added into instead of being written: row i of the output, rounded to the
// dtype, goes to row rows[i] of `data` (same row width: heads * dim), data[rows[i]] = (assign ? 0 : data[rows[i]]) +
// value, the bits of writing the output and adding it in float32 afterwards. rows: device array, one entry per row of
// the call (Q rows for dQ, KV rows for dK and dV); distinct entries. assign: every row of `data` is written by this
// call before anything reads it (the first contribution to a fresh sum).
//
// result (optional): this call is the sum's last contribution. The finished row, dtype(data[rows[i]] + value), is
// written to row rows[i] of `result` (a tensor of the dtype with the sum's rows and row width) instead of being stored
// back in `data`, which keeps its old values: the bits of adding, then converting the sum. Rows of `result` outside
// the map are not written, so it is allowed only where the plan writes every row of its side (no OutsideRows);
// dk_sum and dv_sum take it together.
struct RowSum {
  float* data = nullptr;
  const int64_t* rows = nullptr;
  bool assign = false;
  void* result = nullptr;
};

struct BackwardBuffers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // Summing form (all three set, or none): dq/dk/dv are then not written and may be null. Rows of dK and dV share
  // one map (dk_sum.rows == dv_sum.rows).
  RowSum dq_sum, dk_sum, dv_sum;
  // Optional: rowsum(dO * O) of the call's Q rows, [h_q, q_rows] float32, from attention_row_delta over the same O and
  // dO. Given, the backward reads it instead of computing it (the same bits); null, it computes its own.
  const float* delta = nullptr;
};

enum class BackwardMode {
  atomic,         // dQ accumulated with float32 atomics (fast; dQ may differ in the last bits run to run)
  deterministic,  // dQ by a separate query-stationary pass: bitwise reproducible (dK, dV are in both modes)
};

// The forward kernels (docs/gpu-kernels.md, "Forward kernels"): the sm_90a wgmma kernel (TMA, mbarriers, warpgroup
// MMA; gpu/kernels/sm90/) serves every head-dim pair of the capability table on devices of compute capability 9.0;
// the mma.sync kernel serves every device and shape of the table and is the forward everywhere else.
enum class ForwardKernel {
  automatic,  // wgmma where the device is 9.0 and the build holds it, else mma.sync; CPGOLD_FORWARD_KERNEL overrides
  mma_sync,   // the mma.sync kernel
  wgmma,      // the wgmma kernel; Status::unsupported where it cannot run (device, build), never a fallback
};
std::string_view forward_kernel_name(ForwardKernel kernel);  // "automatic", "mma.sync", "wgmma"
// "auto", "mma" (or "mma.sync"), "wgmma": the values of CPGOLD_FORWARD_KERNEL and of the benchmarks' --forward.
std::optional<ForwardKernel> parse_forward_kernel(std::string_view text);
// True if this build holds the wgmma forward and it serves the shape's head dims (every pair of the table).
bool wgmma_forward_serves(const AttentionShape& shape);
// The kernel attention_forward runs for `shape` on a device of compute capability `cc` (major * 10 + minor; 0: no
// device) when asked for `requested` (automatic is resolved here without the environment variable). unsupported,
// naming the reason, when wgmma is asked for where it cannot run.
Outcome choose_forward_kernel(const AttentionShape& shape, int cc, ForwardKernel requested, ForwardKernel& chosen);
// The same on the calling thread's current device (its compute capability read once per device), with an automatic
// request taken from CPGOLD_FORWARD_KERNEL where that is set (auto, mma, wgmma; another value: invalid_argument).
Outcome forward_kernel_for(const AttentionShape& shape, ForwardKernel requested, ForwardKernel& chosen);
// What attention_forward runs for `shape` on the current device, one line: "wgmma sm_90a (...)" or "mma.sync (...)",
// or "unsupported: <reason>".
std::string forward_kernel_description(const AttentionShape& shape, ForwardKernel requested = ForwardKernel::automatic);

// The backward kernels (docs/gpu-kernels.md, "Backward kernels"): the sm_90a wgmma backward (gpu/kernels/sm90/
// attention_backward_sm90.cuh: dK/dV pass over 128-key tiles, 64-key tiles at 192/128 and 256/256, dQ by TMA
// reduce-add into a float32 accumulator or a query-stationary pass) serves every head-dim pair of the table (bf16,
// fp16; by default all but 32/32, where mma.sync is faster) on devices of compute capability 9.0, with every feature of
// attention_backward (both modes, BackwardBuffers::delta, the summing form with assign and result, OutsideRows); the
// mma.sync backward serves every device and shape of the table and is the backward everywhere else.
enum class BackwardKernel {
  automatic,  // wgmma where it serves the dims, the device is 9.0 and the build holds it, else mma.sync;
              // CPGOLD_BACKWARD_KERNEL overrides
  mma_sync,   // the mma.sync backward
  wgmma,      // the wgmma backward; Status::unsupported where it cannot run (dims, device, build), never a fallback
};
std::string_view backward_kernel_name(BackwardKernel kernel);  // "automatic", "mma.sync", "wgmma"
// "auto", "mma" (or "mma.sync"), "wgmma": the values of CPGOLD_BACKWARD_KERNEL and of the benchmarks' --backward.
std::optional<BackwardKernel> parse_backward_kernel(std::string_view text);
// True if this build holds the wgmma backward and it serves the shape's head dims (every pair of the capability
// table; bf16, fp16).
bool wgmma_backward_serves(const AttentionShape& shape);
// The kernel attention_backward runs for `shape` on a device of compute capability `cc` (major * 10 + minor; 0: no
// device) when asked for `requested` (automatic is resolved here without the environment variable). unsupported,
// naming the reason, when wgmma is asked for where it cannot run.
Outcome choose_backward_kernel(const AttentionShape& shape, int cc, BackwardKernel requested, BackwardKernel& chosen);
// The same on the calling thread's current device, with an automatic request taken from CPGOLD_BACKWARD_KERNEL where
// that is set (auto, mma, wgmma; another value: invalid_argument).
Outcome backward_kernel_for(const AttentionShape& shape, BackwardKernel requested, BackwardKernel& chosen);
// What attention_backward runs for `shape` on the current device, one line: "wgmma sm_90a (...)" or
// "mma.sync (...)", or "unsupported: <reason>".
std::string backward_kernel_description(const AttentionShape& shape,
                                        BackwardKernel requested = BackwardKernel::automatic);

// Schedules of the wgmma forward (docs/gpu-kernels.md, "Forward schedules"): the Q tile height and the grid. Each
// work item (Q tile, head) is computed the same way under both grids of one tile height, so those give the same
// bits; the two tile heights use different key tiles, so they agree to rounding, not bit for bit.
enum class ForwardSchedule {
  automatic,      // tile height by the plan's padding waste; persistent grid where 64-row tiles are chosen;
                  // CPGOLD_FORWARD_SCHEDULE overrides
  tile128,        // 128-row Q tiles (two consumer warpgroups, ping-pong), one CTA per (tile, head)
  tile64,         // 64-row Q tiles (one consumer warpgroup, two CTAs per SM), one CTA per (tile, head)
  persistent,     // tile height as automatic, persistent grid
  persistent128,  // 128-row Q tiles, persistent grid
  persistent64,   // 64-row Q tiles, persistent grid
};
std::string_view forward_schedule_name(ForwardSchedule schedule);  // "auto", "tile128", ...
// The names above ("automatic" also accepted): the values of CPGOLD_FORWARD_SCHEDULE.
std::optional<ForwardSchedule> parse_forward_schedule(std::string_view text);
// What a schedule resolves to for one plan: Q tile rows (64 or 128) and the grid.
struct ForwardScheduleChoice {
  int tile_rows = 128;
  bool persistent = false;
};
// 64-row tiles are chosen (automatic) when the 128-row tiles' score area exceeds the 64-row tiles' by more than this
// factor (the 128-row configuration's higher rate per area on whole sequences: run H1, 424 vs 388 TFLOP/s causal).
inline constexpr double kSmallTileAreaFactor = 1.10;
// The wgmma forward has the short-chunk schedules (64-row tiles, the persistent grid) for d_qk up to 192 (two CTAs
// of a d_qk 256 configuration do not fit an SM's shared memory; its persistent consumers would spill); elsewhere
// every schedule runs 128-row tiles, one CTA per tile and head.
bool wgmma_short_schedules_serve(const AttentionShape& shape);
// Resolves `requested` for the plan (automatic: CPGOLD_FORWARD_SCHEDULE where set, else the rule above;
// invalid_argument for an unknown value of the variable, or an unbuilt plan).
Outcome forward_schedule_for(const AttentionPlan& plan, ForwardSchedule requested, ForwardScheduleChoice& chosen);

// Launches on `stream` (a cudaStream_t; nullptr = default stream). Returns after the launch (no synchronisation);
// launch errors are reported, errors inside the kernels surface at the caller's next synchronisation.
// The forward runs the kernel forward_kernel_for(shape, kernel) names (the wgmma kernel with the schedule
// forward_schedule_for(plan, schedule) names; the mma.sync kernel ignores the schedule), the backward the one
// backward_kernel_for(shape, kernel) names.
Outcome attention_forward(const AttentionPlan& plan, const ForwardBuffers& buffers, void* stream = nullptr,
                          ForwardKernel kernel = ForwardKernel::automatic,
                          ForwardSchedule schedule = ForwardSchedule::automatic);
Outcome attention_backward(const AttentionPlan& plan, const BackwardBuffers& buffers,
                           BackwardMode mode = BackwardMode::atomic, void* stream = nullptr,
                           BackwardKernel kernel = BackwardKernel::automatic);

// The backward's float32 workspace (delta, and the atomic mode's dQ accumulator: 4 x q_rows x h_q x (d_qk + 1)
// bytes) comes from a memory pool of the library, one per device, that keeps its memory reserved between calls (the
// default pool would give it back at every synchronisation and each call would map it again). The reserve grows to
// the largest concurrent need and stays until this call hands the unused part back to the driver (after the caller
// has synchronised the streams the backward ran on; memory of calls still in flight stays).
Outcome release_workspace_memory();
// Bytes the pool of `device` holds now (0 before its first backward).
Outcome workspace_memory_reserved(int device, uint64_t& bytes);

// delta[h * rows + r] = sum over x of dO[r, h, x] * O[r, h, x] in float32 for every row r < rows and query head h,
// summed as attention_backward sums it for its own rows (o, dout: [rows, h_q, d_v] of the shape's dtype). One pass
// over a CP rank's O and dO serves every step's backward (BackwardBuffers::delta). Rows holding NaN (pads) give NaN,
// which no backward reads (only rows inside segments are).
Outcome attention_row_delta(const AttentionShape& shape, const void* o, const void* dout, int64_t rows, float* delta,
                            void* stream = nullptr);

// Number of CUDA devices visible (0 without a driver or GPU; never throws).
int cuda_device_count();

}  // namespace cpgold::gpu
