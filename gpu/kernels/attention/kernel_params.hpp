#pragma once
// Plain parameter structs between the host launchers and the attention kernels: pointers, strides, sizes and the
// tile lists of one AttentionCall (built by gpu/kernels/attention/attention_plan.cpp). No CUDA types, so C++ code may include it.
#include <cstdint>

namespace cpgold::gpu {

// One sequence of the call: at most two Q and two KV segments (first row, count, global position), and the
// sequence's global actual lengths for the bottom-right alignment delta = length_kv - length_q.
struct SequenceDesc {
  int64_t q_first_row[2];
  int32_t q_count[2];
  int32_t q_position[2];
  int64_t kv_first_row[2];
  int32_t kv_count[2];
  int32_t kv_position[2];
  int32_t length_q;
  int32_t length_kv;
};

// A tile of consecutive rows: `rows` rows from `first_row`. A work tile (sequence >= 0) lies inside one segment
// (`segment` 0 or 1) and its first row sits at global position `position`; a pad tile (sequence == -1) covers
// rows outside every segment, which the kernel writes as zeros.
struct RowTile {
  int64_t first_row;
  int32_t rows;
  int32_t position;
  int32_t sequence;
  int32_t segment;
};

struct AttentionParams {
  // Inputs and outputs; THD tensors [rows, heads, dim] with contiguous rows (row stride heads * dim).
  const void* q;      // [q_rows, heads_q, dim_qk]
  const void* k;      // [kv_rows, heads_kv, dim_qk]
  const void* v;      // [kv_rows, heads_kv, dim_v]
  void* o;            // [q_rows, heads_q, dim_v]
  float* lse;         // [heads_q, q_rows]
  const void* dout;   // [q_rows, heads_q, dim_v]
  void* dq;           // [q_rows, heads_q, dim_qk]
  void* dk;           // [kv_rows, heads_kv, dim_qk]
  void* dv;           // [kv_rows, heads_kv, dim_v]
  float* dq_accum;    // [q_rows, heads_q, dim_qk] float32 workspace (atomic backward)
  float* delta;       // [heads_q, q_rows] rowsum(dO * O) workspace (backward)
  // Summing backward (all three set, or none): instead of writing dq/dk/dv, row i of each output, rounded to the
  // dtype, is added in float32 to row *_sum_rows[i] of a float32 sum with the same row width:
  // sum[map[i]] = (assign ? 0 : sum[map[i]]) + float(dtype(value)).
  float* dq_sum;
  float* dk_sum;
  float* dv_sum;
  const int64_t* q_sum_rows;   // [q_rows]
  const int64_t* kv_sum_rows;  // [kv_rows]
  int32_t dq_sum_assign;
  int32_t dk_sum_assign;
  int32_t dv_sum_assign;
  // Optional, per sum: the last contribution. Instead of writing the float32 sum back, dtype(sum + value) is written
  // to row map[i] of this [rows, heads, dim] tensor of the dtype (same row layout as the sum); the sum is left as it was.
  void* dq_result;
  void* dk_result;
  void* dv_result;

  int64_t q_rows;
  int64_t kv_rows;
  int32_t heads_q;
  int32_t heads_kv;
  int32_t group;            // heads_q / heads_kv
  int32_t window_left;      // -1 unbounded
  int32_t window_right;     // -1 unbounded
  float softmax_scale;
  float scale_log2;         // softmax_scale * log2(e)

  const SequenceDesc* sequences;
  const RowTile* q_tiles;   // tiles of the Q rows (work and pad), kernel's tile height
  int32_t q_tile_count;
  const RowTile* kv_tiles;  // tiles of the KV rows (work and pad), kernel's tile height
  int32_t kv_tile_count;
};

}  // namespace cpgold::gpu
