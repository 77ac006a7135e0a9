// RankAttention: the attention calls of one rank's CP steps and their plans (see the header).
#include "gpu/cp/rank_attention.hpp"

#include <stdexcept>
#include <string>

#include "gpu/kernels/cp/cp_kernels.hpp"

namespace cpgold::gpu {

RankAttention::Forward RankAttention::forward(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k,
                                              const DeviceTensor& v) {
  return forward_with(plan_for(t, q, k, v), t, q, k, v);
}

RankAttention::Forward RankAttention::forward_rows(const sim::Tile& t, const sim::StepRows& rows, const DeviceTensor& q,
                                                   const DeviceTensor& k, const DeviceTensor& v) {
  const DeviceTensor qx = rows.q_half ? rows_.gather(q, rows.q, 0, static_cast<int>(q.heads)) : q;
  if (!rows.kv_half) return forward(t, qx, k, v);
  return forward_with(plan_in_place(t, nullptr, &rows.kv, qx, k, v, {.leave_q = false, .leave_kv = true}), t, qx, k, v);
}

RankAttention::Forward RankAttention::forward_with(const AttentionPlan& plan, const sim::Tile& t, const DeviceTensor& q,
                                                   const DeviceTensor& k, const DeviceTensor& v) {
  for (const DeviceTensor* x : {&q, &k, &v}) memory_.materialize(*x);
  Forward r{memory_.alloc(q.rows, q.heads, v.dim, storage_), memory_.alloc_lse(q.heads, q.rows)};
  Outcome out;
  timing_.timed(attention_phase(sim::PassKind::forward, t.section).c_str(), 0, [&] {
    out = attention_forward(plan, {q.data(), k.data(), v.data(), r.o.data(), r.lse.data()}, streams_.compute());
  });
  if (!out.ok()) fail_step(t, "attention_forward", out);
  if (options_.inject && options_.inject->rank == streams_.rank() && options_.inject->step == t.step) corrupt(t, r.o);
  return r;
}

RankAttention::Backward RankAttention::backward(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k,
                                                const DeviceTensor& v, const DeviceTensor& o, const DeviceLse& lse,
                                                const DeviceTensor& dout) {
  for (const DeviceTensor* x : {&q, &k, &v, &o, &dout}) memory_.materialize(*x);
  const AttentionPlan& plan = plan_for(t, q, k, v);
  Backward r{memory_.alloc(q.rows, q.heads, q.dim, storage_), memory_.alloc(k.rows, k.heads, k.dim, storage_),
             memory_.alloc(v.rows, v.heads, v.dim, storage_)};
  Outcome out;
  timing_.timed(attention_phase(sim::PassKind::backward, t.section).c_str(), 0, [&] {
    out = attention_backward(plan,
                             {q.data(), k.data(), v.data(), o.data(), dout.data(), lse.data(), r.dq.data(), r.dk.data(),
                              r.dv.data(), {}, {}, {}},
                             options_.mode, streams_.compute());
  });
  if (!out.ok()) fail_step(t, "attention_backward", out);
  return r;
}

void RankAttention::backward_sum(const sim::Tile& t, const sim::StepRows& rows, const DeviceTensor& q,
                                 const DeviceTensor& k, const DeviceTensor& v, const DeviceTensor& o,
                                 const DeviceLse& lse, const DeviceTensor& dout, DeviceTensor& dq, DeviceTensor& dk,
                                 DeviceTensor& dv, sim::SumEnds ends) {
  for (const DeviceTensor* x : {&q, &k, &v, &o, &dout}) memory_.materialize(*x);
  const DeviceLse& rank_delta = delta_of(o, dout, q, k);
  const bool q_in_place = rows.q_half && options_.read_halves_in_place,
             kv_in_place = rows.kv_half && options_.read_halves_in_place;
  DeviceTensor qx = q, ox = o, dox = dout, kx = k, vx = v;
  DeviceLse lsex = lse, deltax = rank_delta;
  if (rows.q_half && !q_in_place) {
    qx = rows_.gather(q, rows.q, 0, static_cast<int>(q.heads));
    ox = rows_.gather(o, rows.q, 0, static_cast<int>(o.heads));
    dox = rows_.gather(dout, rows.q, 0, static_cast<int>(dout.heads));
    lsex = rows_.lse_gather(lse, rows.q);
    deltax = rows_.lse_gather(rank_delta, rows.q);
  }
  if (rows.kv_half && !kv_in_place) {
    kx = rows_.gather(k, rows.kv, 0, static_cast<int>(k.heads));
    vx = rows_.gather(v, rows.kv, 0, static_cast<int>(v.heads));
  }
  auto sum_of = [&](DeviceTensor& dst, const std::vector<int64_t>& map, const DeviceTensor& like) {
    if (dst.elem != Elem::f32 || dst.heads * dst.dim != like.heads * like.dim ||
        static_cast<int64_t>(map.size()) != like.rows)
      throw std::logic_error(streams_.who() + ": backward_sum into a sum of another shape");
    memory_.own(dst.mem);
    const bool assign = memory_.start_sum(dst, map);
    return RowSum{static_cast<float*>(dst.data()), RankMemory::rows_ptr(memory_.upload_rows(map)), assign};
  };
  const std::vector<int64_t>& q_map = q_in_place ? identity_rows(q.rows) : rows.q;
  const std::vector<int64_t>& kv_map = kv_in_place ? identity_rows(k.rows) : rows.kv;
  BackwardBuffers buffers{qx.data(), kx.data(), vx.data(), ox.data(), dox.data(), lsex.data(), nullptr, nullptr,
                          nullptr, sum_of(dq, q_map, qx), sum_of(dk, kv_map, kx), sum_of(dv, kv_map, vx),
                          deltax.data()};
  const bool end_q = ends.dq && !rows.q_half && options_.last_sum_in_dtype;
  const bool end_kv = ends.dkv && !rows.kv_half && options_.last_sum_in_dtype;
  DeviceTensor dq_end, dk_end, dv_end;
  if (end_q) {
    dq_end = memory_.alloc(dq.rows, dq.heads, dq.dim, storage_);
    buffers.dq_sum.result = dq_end.data();
  }
  if (end_kv) {
    dk_end = memory_.alloc(dk.rows, dk.heads, dk.dim, storage_);
    dv_end = memory_.alloc(dv.rows, dv.heads, dv.dim, storage_);
    buffers.dk_sum.result = dk_end.data();
    buffers.dv_sum.result = dv_end.data();
  }
  const OutsideRows outside{.leave_q = q_in_place && !buffers.dq_sum.assign,
                            .leave_kv = kv_in_place && !buffers.dk_sum.assign && !buffers.dv_sum.assign};
  const AttentionPlan& plan =
      q_in_place || kv_in_place
          ? plan_in_place(t, q_in_place ? &rows.q : nullptr, kv_in_place ? &rows.kv : nullptr, q, k, v, outside)
          : plan_for(t, qx, kx, vx);
  Outcome out;
  timing_.timed(attention_phase(sim::PassKind::backward, t.section).c_str(), 0,
                [&] { out = attention_backward(plan, buffers, options_.mode, streams_.compute()); });
  if (!out.ok()) fail_step(t, "attention_backward", out);
  if (end_q) dq = std::move(dq_end);
  if (end_kv) {
    dk = std::move(dk_end);
    dv = std::move(dv_end);
  }
}

const DeviceLse& RankAttention::delta_of(const DeviceTensor& o, const DeviceTensor& dout, const DeviceTensor& q,
                                         const DeviceTensor& k) {
  if (delta_.o == o.mem && delta_.dout == dout.mem && delta_.delta.mem) return delta_.delta;
  DeviceLse d = memory_.alloc_lse(o.heads, o.rows);
  const AttentionShape shape{dtype_, static_cast<int>(o.heads), static_cast<int>(k.heads), static_cast<int>(q.dim),
                             static_cast<int>(o.dim)};
  Outcome out;
  timing_.timed("delta", static_cast<double>(o.bytes() + dout.bytes() + d.bytes()),
                [&] { out = attention_row_delta(shape, o.data(), dout.data(), o.rows, d.data(), streams_.compute()); });
  if (!out.ok())
    throw std::runtime_error(streams_.who() + " attention_row_delta: " + std::string(status_name(out.status)) + ": " +
                             out.message);
  delta_ = {o.mem, dout.mem, std::move(d)};
  return delta_.delta;
}

const std::vector<int64_t>& RankAttention::identity_rows(int64_t n) {
  auto it = identities_.find(n);
  if (it == identities_.end()) it = identities_.emplace(n, sim::program_detail::identity_rows(n)).first;
  return it->second;
}

const AttentionPlan& RankAttention::plan_in_place(const sim::Tile& t, const std::vector<int64_t>* q_rows,
                                                  const std::vector<int64_t>* kv_rows, const DeviceTensor& q,
                                                  const DeviceTensor& k, const DeviceTensor& v, OutsideRows outside) {
  const int variant = (q_rows ? 1 : 0) | (kv_rows ? 2 : 0) | (outside.leave_q ? 4 : 0) | (outside.leave_kv ? 8 : 0);
  const auto key = std::make_pair(&t, variant);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  auto move_segments = [&](std::vector<RowSegment>& segments, const std::vector<int64_t>& map, const char* side) {
    for (RowSegment& seg : segments) {
      if (seg.count == 0) {
        seg.first_row = 0;
        continue;
      }
      const auto at = [&](int64_t i) {
        if (i < 0 || i >= static_cast<int64_t>(map.size()))
          throw std::logic_error(streams_.who() + " step " + std::to_string(t.step) + ": " + side + " segment row " +
                                 std::to_string(i) + " outside the half's " + std::to_string(map.size()) + " rows");
        return map[static_cast<size_t>(i)];
      };
      const int64_t first = at(seg.first_row);
      for (int32_t j = 1; j < seg.count; ++j)
        if (at(seg.first_row + j) != first + j)
          throw std::logic_error(streams_.who() + " step " + std::to_string(t.step) + ": the " + side +
                                 " half's rows of a segment are not consecutive in the rank's tensor");
      seg.first_row = first;
    }
  };
  AttentionCall call = t.call;
  if (q_rows) call.q_rows = q.rows;
  if (kv_rows) call.kv_rows = k.rows;
  for (SequenceTile& seq : call.sequences) {
    if (q_rows) move_segments(seq.q, *q_rows, "Q");
    if (kv_rows) move_segments(seq.kv, *kv_rows, "KV");
  }
  AttentionShape shape{dtype_, static_cast<int>(q.heads), static_cast<int>(k.heads), static_cast<int>(q.dim),
                       static_cast<int>(v.dim)};
  AttentionPlan plan;
  const Outcome built = plan.build(call, shape, outside);
  if (!built.ok()) fail_step(t, variant ? "AttentionPlan::build (halves in place)" : "AttentionPlan::build", built);
  return plans_.emplace(key, std::move(plan)).first->second;
}

const AttentionPlan& RankAttention::plan_for(const sim::Tile& t, const DeviceTensor& q, const DeviceTensor& k,
                                             const DeviceTensor& v) {
  return plan_in_place(t, nullptr, nullptr, q, k, v, {});
}

void RankAttention::corrupt(const sim::Tile& t, DeviceTensor& o) {
  for (const SequenceTile& s : t.call.sequences)
    for (const RowSegment& seg : s.q)
      if (seg.count > 0) {
        const size_t row_elems = static_cast<size_t>(o.heads * o.dim);
        streams_.check(launch_add_one(o.data(), o.elem, static_cast<size_t>(seg.first_row) * row_elems, row_elems,
                                      streams_.compute()),
                       "inject");
        return;
      }
}

void RankAttention::fail_step(const sim::Tile& t, const char* what, const Outcome& out) const {
  throw std::runtime_error(streams_.who() + " step " + std::to_string(t.step) + " " + what + ": " +
                           std::string(status_name(out.status)) + ": " + out.message);
}

}  // namespace cpgold::gpu
