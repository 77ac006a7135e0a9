// RankRowOps: gathers, scatters, accumulation, the forward merge and the rounding of one rank (see the header).
#include "gpu/cp/rank_row_ops.hpp"

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "gpu/kernels/cp/cp_kernels.hpp"

namespace cpgold::gpu {

DeviceLse RankRowOps::lse_empty(int64_t heads, int64_t rows) {
  DeviceLse l = memory_.alloc_lse(heads, rows);
  timing_.timed("lse", l.bytes(),
                [&] { streams_.check(launch_fill(l.data(), l.count(), -INFINITY, streams_.compute()), "fill"); });
  return l;
}

DeviceTensor RankRowOps::gather(const DeviceTensor& x, const std::vector<int64_t>& rows, int h0, int h1) {
  memory_.materialize(x);
  DeviceTensor out = memory_.alloc(static_cast<int64_t>(rows.size()), h1 - h0, x.dim, x.elem);
  const auto idx = memory_.upload_rows(rows);
  timing_.timed("gather", 2.0 * out.bytes(), [&] {
    streams_.check(launch_gather_rows(out.data(), x.data(), RankMemory::rows_ptr(idx), out.rows, x.heads, h0, h1 - h0,
                                      x.dim, x.elem, streams_.compute()),
                   "gather");
  });
  return out;
}

void RankRowOps::scatter(DeviceTensor& dst, const std::vector<int64_t>& rows, int h0, const DeviceTensor& src) {
  if (dst.elem != src.elem) throw std::logic_error(streams_.who() + ": scatter between element types");
  memory_.materialize(dst);
  memory_.materialize(src);
  const auto idx = memory_.upload_rows(rows);
  timing_.timed("scatter", 2.0 * src.bytes(), [&] {
    streams_.check(
        launch_scatter_rows(dst.data(), src.data(), RankMemory::rows_ptr(idx), static_cast<int64_t>(rows.size()),
                            dst.heads, h0, src.heads, src.dim, src.elem, streams_.compute()),
        "scatter");
  });
}

void RankRowOps::scatter_add(DeviceTensor& dst, const std::vector<int64_t>& rows, const DeviceTensor& src) {
  if (dst.elem != Elem::f32) throw std::logic_error(streams_.who() + ": accumulation into 16-bit");
  if (src.heads * src.dim != dst.heads * dst.dim)
    throw std::logic_error(streams_.who() + ": scatter_add between row widths");
  // With accumulate_aside, both are only read and written on the accumulation stream from here on, in program
  // order there: no wait for an earlier accumulation, only for the zero fills (on the compute stream).
  const bool aside = accumulate_aside_;
  const cudaStream_t on = aside ? streams_.accumulation() : streams_.compute();
  memory_.fill_pending_zeros(src);
  const bool assign = memory_.start_sum(dst, rows);
  const auto idx = memory_.upload_rows(rows);
  // The accumulation stream starts after everything the compute stream has enqueued so far (the partial, the zero
  // fill, the upload of the rows, the exchange that delivered dst).
  if (aside)
    streams_.check(cudaStreamWaitEvent(on, streams_.record(streams_.compute())->event, 0),
                   "cudaStreamWaitEvent (accumulation)");
  timing_.timed(
      "scatter_add", src.bytes() + (assign ? 1.0 : 2.0) * src.count() * 4,
      [&] {
        streams_.check(
            launch_scatter_add(static_cast<float*>(dst.data()), src.data(), src.elem, RankMemory::rows_ptr(idx),
                               static_cast<int64_t>(rows.size()), src.heads * src.dim, assign, on),
            "scatter_add");
      },
      on);
  if (!aside) return;
  const EventRef done = streams_.record(streams_.accumulation());
  for (const auto& m : {dst.mem, src.mem})
    if (m) m->side_use = done;
}

DeviceLse RankRowOps::lse_gather(const DeviceLse& x, const std::vector<int64_t>& rows) {
  DeviceLse out = memory_.alloc_lse(x.heads, static_cast<int64_t>(rows.size()));
  const auto idx = memory_.upload_rows(rows);
  timing_.timed("lse", 2.0 * out.bytes(), [&] {
    streams_.check(launch_lse_gather(out.data(), x.data(), RankMemory::rows_ptr(idx), out.rows, x.heads, x.rows,
                                     streams_.compute()),
                   "lse_gather");
  });
  return out;
}

void RankRowOps::lse_scatter(DeviceLse& dst, const std::vector<int64_t>& rows, int h0, const DeviceLse& src) {
  const auto idx = memory_.upload_rows(rows);
  timing_.timed("lse", 2.0 * src.bytes(), [&] {
    streams_.check(launch_lse_scatter(dst.data(), src.data(), RankMemory::rows_ptr(idx),
                                      static_cast<int64_t>(rows.size()), src.heads, dst.rows, h0, streams_.compute()),
                   "lse_scatter");
  });
}

void RankRowOps::merge_forward(const std::vector<Partial>& parts, DeviceTensor& o, DeviceLse& lse) {
  if (!o.mem || !o.mem->pending_zero)
    throw std::logic_error(streams_.who() + ": merge_forward expects a fresh zero accumulator");
  if (parts.size() > static_cast<size_t>(kMaxMergeSources))
    throw std::logic_error(streams_.who() + ": " + std::to_string(parts.size()) +
                           " forward partials, the merge takes at most " + std::to_string(kMaxMergeSources));
  std::vector<MergeSource> sources;
  std::vector<std::shared_ptr<DeviceMemory>> idx;
  double bytes = 0;
  for (const Partial& part : parts) {
    memory_.materialize(*part.o);
    if (part.o->heads != o.heads || part.o->dim != o.dim || part.lse->heads != lse.heads)
      throw std::logic_error(streams_.who() + ": forward partial heads/dims differ from O");
    idx.push_back(memory_.upload_rows(source_rows(*part.rows, o.rows)));
    sources.push_back(
        {part.o->data(), part.lse->data(), RankMemory::rows_ptr(idx.back()), part.lse->rows, part.o->elem});
    bytes += part.o->bytes() + part.lse->bytes() + o.rows * 8.0;
  }
  DeviceTensor out = memory_.alloc(o.rows, o.heads, o.dim, storage_);
  bytes += out.bytes() + lse.bytes();
  timing_.timed("merge", bytes, [&] {
    streams_.check(launch_merge_forward(out.data(), out.elem, lse.data(), sources.data(),
                                        static_cast<int>(sources.size()), o.rows, o.heads, o.dim, streams_.compute()),
                   "forward merge");
  });
  o = std::move(out);
}

void RankRowOps::finalize(DeviceTensor& x) {
  if (x.elem == storage_) return;
  memory_.own(x.mem);
  DeviceTensor out = memory_.alloc(x.rows, x.heads, x.dim, storage_);
  if (x.mem && x.mem->pending_zero) {
    out.mem->pending_zero = true;
    memory_.materialize(out);
  } else {
    timing_.timed("convert", x.bytes() + out.bytes(), [&] {
      streams_.check(launch_convert(out.data(), storage_, x.data(), x.elem, x.count(), streams_.compute()), "convert");
    });
  }
  x = std::move(out);
}

std::vector<int64_t> RankRowOps::source_rows(const std::vector<int64_t>& rows, int64_t n) const {
  std::vector<int64_t> src(static_cast<size_t>(n), -1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    if (r < 0 || r >= n || src[static_cast<size_t>(r)] >= 0)
      throw std::logic_error(streams_.who() + ": forward partial row " + std::to_string(i) + " maps to row " +
                             std::to_string(r) + " (outside 0.." + std::to_string(n - 1) + " or taken twice)");
    src[static_cast<size_t>(r)] = static_cast<int64_t>(i);
  }
  return src;
}

}  // namespace cpgold::gpu
