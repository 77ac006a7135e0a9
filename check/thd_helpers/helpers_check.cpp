#include "check/thd_helpers/helpers_check.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>

#include "reference/input_error.hpp"
#include "reference/tensor.hpp"
#include "reference/thd_layout.hpp"
#include "sim/thd_helpers/grad_correction.hpp"
#include "sim/thd_helpers/lse_halves.hpp"
#include "sim/thd_helpers/out_correction.hpp"
#include "sim/plan/partition.hpp"
#include "sim/thd_helpers/reorder.hpp"
#include "sim/plan/step_rows.hpp"

namespace cpgold::fx {

namespace {

using sim::HalfSelect;

Tensor3<float> tensor3(const FloatData& d, int64_t rows) {
  Tensor3<float> t;
  t.rows = rows;
  t.heads = d.dims[1];
  t.dim = d.dims[2];
  t.values.assign(d.values.begin(), d.values.begin() + rows * t.heads * t.dim);
  return t;
}
Tensor3<float> tensor3(const FloatData& d) { return tensor3(d, d.dims[0]); }

sim::LseShape lse_shape(const FloatData& d, bool packed) {
  if (packed) return {true, static_cast<int>(d.dims[0]), 0, d.dims[1]};
  return {false, static_cast<int>(d.dims[1]), static_cast<int>(d.dims[0]), d.dims[2]};
}

// The partition of the global padded offsets (every sequence fully valid: the maps use the padded offsets only).
sim::SidePartition partition_of(const std::vector<int32_t>& global_padded, int cp_size) {
  PackedSequences side;
  side.cu_seqlens = global_padded;
  side.cu_seqlens_padded = global_padded;
  side.total_rows = global_padded.back();
  return sim::SidePartition(side, cp_size, "q");
}

// Row `row` of a tensor laid out at offsets / divisor: its sequence (TransformerEngine's binary search) and row within.
void place_row(ElementPlace& p, const std::vector<int32_t>& offsets, int64_t row, int divisor = 1) {
  if (row < offsets.front() / divisor || row >= offsets.back() / divisor) return;
  p.sequence = sim::sequence_of_row(offsets, row, divisor);
  p.row_in_sequence = row - offsets[static_cast<size_t>(p.sequence)] / divisor;
}

// [rows, h, d]: row, head, dim of a flat index.
ElementPlace row_place(const FloatData& shape, int64_t flat, int64_t& row) {
  const int64_t h = shape.dims[1], d = shape.dims[2];
  row = d * h == 0 ? 0 : flat / (h * d);
  ElementPlace p;
  p.index = {{"row", row}, {"head", d == 0 ? 0 : (flat / d) % h}, {"dim", d == 0 ? 0 : flat % d}};
  return p;
}

// LSE [h, S] or [B, h, S] laid out at cu / divisor (divisor 2: a half tensor).
ElementPlace lse_place(const FloatData& shape, bool packed, const std::vector<int32_t>& cu, int divisor, int64_t flat) {
  ElementPlace p;
  if (packed) {
    const int64_t s = shape.dims[1];
    const int64_t column = flat % s;
    p.index = {{"head", flat / s}, {"column", column}};
    place_row(p, cu, column, divisor);
    return p;
  }
  const int64_t h = shape.dims[1], s = shape.dims[2];
  const int64_t sequence = flat / (h * s), column = flat % s;
  p.index = {{"sequence", sequence}, {"head", (flat / s) % h}, {"column", column}};
  p.sequence = static_cast<int>(sequence);
  const int64_t length = (cu[static_cast<size_t>(sequence) + 1] - cu[static_cast<size_t>(sequence)]) / divisor;
  if (column < length) p.row_in_sequence = column;
  return p;
}

uint32_t bits_of(float v) { return std::bit_cast<uint32_t>(v); }

template <class Place>
void compare_floats(HelperCallResult& r, const std::vector<float>& expected, const std::vector<float>& observed,
                    Place place) {
  const size_t n = expected.size();
  r.compared = static_cast<int64_t>(n);
  r.left_out = static_cast<int64_t>(observed.size()) - r.compared;
  for (size_t i = 0; i < n; ++i) {
    if (bits_of(expected[i]) == bits_of(observed[i])) continue;
    ++r.mismatches;
    if (const std::optional<int64_t> u = ulp_distance(expected[i], observed[i]))
      r.max_ulp = std::max(r.max_ulp.value_or(0), *u);
    if (r.first) continue;
    HelperMismatch m;
    m.flat = static_cast<int64_t>(i);
    m.place = place(static_cast<int64_t>(i));
    m.expected = expected[i];
    m.observed = observed[i];
    r.first = m;
  }
}

void add_row_params(HelperCallResult& r, const FloatData& t) {
  r.params.push_back({"rows", t.dims[0]});
  r.params.push_back({"heads", t.dims[1]});
  r.params.push_back({"dim", t.dims[2]});
}

void check_partitioned_indices(const HelperCall& c, HelperCallResult& r) {
  r.params = {{"cp_size", c.cp_size}, {"rank", c.rank}, {"total_rows", c.total_rows}, {"B", c.batch()}};
  const std::vector<int64_t> expected = partition_of(c.cu_seqlens_padded, c.cp_size).gather_indices(c.rank);
  r.compared = static_cast<int64_t>(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] == c.indices[i]) continue;
    ++r.mismatches;
    if (r.first) continue;
    HelperMismatch m;
    m.flat = static_cast<int64_t>(i);
    m.place.index = {{"row", m.flat}};
    place_row(m.place, c.cu_seqlens_padded, m.flat, c.cp_size);
    m.integer = true;
    m.expected_int = expected[i];
    m.observed_int = c.indices[i];
    r.first = m;
  }
}

void check_read_half(const HelperCall& c, HelperCallResult& r) {
  const FloatData& in = c.tensor("input");
  r.params = {{"cp_size", c.cp_size}, {"half", c.half}, {"B", c.batch()}};
  add_row_params(r, in);
  std::vector<int32_t> global;
  for (int32_t x : c.cu_seqlens_padded) global.push_back(x * c.cp_size);
  const Tensor3<float> expected = sim::read_half(tensor3(in), partition_of(global, c.cp_size), c.half);
  const FloatData& out = c.tensor("output");
  compare_floats(r, expected.values, out.values, [&](int64_t flat) {
    int64_t row = 0;
    ElementPlace p = row_place(out, flat, row);
    place_row(p, c.cu_seqlens_padded, row, 2);
    return p;
  });
  if (r.left_out > 0)
    r.left_out_reason = "output rows [" + std::to_string(expected.rows) + ", " + std::to_string(out.rows()) +
                        "), from cu_seqlens_padded[B] / 2 = " + std::to_string(expected.rows) +
                        " on, are not written by the kernel";
}

void check_reorder(const HelperCall& c, HelperCallResult& r) {
  const FloatData& in = c.tensor("input");
  r.params = {{"cp_size", c.cp_size}, {"B", c.batch()}};
  add_row_params(r, in);
  const sim::SidePartition side = partition_of(c.cu_seqlens_padded, c.cp_size);
  const bool to_rank = c.op == HelperOp::sequence_to_rank_order;
  const Tensor3<float> expected =
      to_rank ? sim::sequence_to_rank_order(tensor3(in), side) : sim::rank_to_sequence_order(tensor3(in), side);
  const FloatData& out = c.tensor("output");
  const int64_t per_rank = c.cu_seqlens_padded.back() / c.cp_size;
  compare_floats(r, expected.values, out.values, [&](int64_t flat) {
    int64_t row = 0;
    ElementPlace p = row_place(out, flat, row);
    if (to_rank) {
      p.rank = static_cast<int>(row / per_rank);
      place_row(p, c.cu_seqlens_padded, row % per_rank, c.cp_size);
    } else {
      place_row(p, c.cu_seqlens_padded, row);
    }
    return p;
  });
}

// Compares a rank-local row tensor with the call's output, placing each element by its row on the local offsets.
void compare_rank_local_rows(const HelperCall& c, HelperCallResult& r, const std::vector<float>& expected) {
  const FloatData& observed = c.tensor("output");
  compare_floats(r, expected, observed.values, [&](int64_t flat) {
    int64_t row = 0;
    ElementPlace p = row_place(observed, flat, row);
    place_row(p, c.cu_seqlens_padded, row);
    return p;
  });
}

void check_lse_correction(const HelperCall& c, HelperCallResult& r) {
  const FloatData& lse = c.tensor("lse");
  const FloatData& half = c.tensor("lse_half");
  const sim::LseShape full_shape = lse_shape(lse, c.packed);
  r.params = {{"cp_size", c.cp_size}, {"packed", c.packed ? 1 : 0}, {"B", c.batch()}, {"heads", full_shape.heads},
              {"S", full_shape.seqlen}};
  std::vector<float> expected = lse.values;
  sim::second_half_lse_correction(expected, full_shape, half.values, lse_shape(half, c.packed),
                                  sim::StepRows(c.cu_seqlens_padded, HalfSelect::second));
  compare_floats(r, expected, c.tensor("output").values,
                 [&](int64_t flat) { return lse_place(lse, c.packed, c.cu_seqlens_padded, 1, flat); });
}

void check_read_second_half_lse(const HelperCall& c, HelperCallResult& r) {
  const FloatData& lse = c.tensor("lse");
  const FloatData& out = c.tensor("output");
  const sim::LseShape full_shape = lse_shape(lse, c.packed), half_shape = lse_shape(out, c.packed);
  r.params = {{"cp_size", c.cp_size}, {"packed", c.packed ? 1 : 0}};
  if (c.packed) r.params.push_back({"second_half_lse_seqlen", c.second_half_lse_seqlen});
  r.params.insert(r.params.end(), {{"B", c.batch()}, {"heads", full_shape.heads}, {"S", full_shape.seqlen}});
  const std::vector<float> expected = sim::read_second_half_lse(
      lse.values, full_shape, half_shape, sim::StepRows(c.cu_seqlens_padded, HalfSelect::second));
  compare_floats(r, expected, out.values,
                 [&](int64_t flat) { return lse_place(out, c.packed, c.cu_seqlens_padded, 2, flat); });
}

void check_out_correction(const HelperCall& c, HelperCallResult& r) {
  const FloatData& out = c.tensor("out");
  r.params = {{"cp_size", c.cp_size}, {"only_second_half", c.only_second_half ? 1 : 0}, {"packed", c.packed ? 1 : 0},
              {"dtype", std::string(dtype_name(c.dtype))}, {"B", c.batch()}};
  add_row_params(r, out);
  const sim::StepRows rows(c.cu_seqlens_padded, c.only_second_half ? HalfSelect::second : HalfSelect::full);
  Tensor3<float> expected = tensor3(out);
  sim::out_correction(expected, tensor3(c.tensor("out_step"), rows.rows()), c.tensor("lse").values,
                      lse_shape(c.tensor("lse"), c.packed), c.tensor("lse_step").values,
                      lse_shape(c.tensor("lse_step"), c.packed), rows, c.dtype);
  compare_rank_local_rows(c, r, expected.values);
}

void check_grad_correction(const HelperCall& c, HelperCallResult& r) {
  const FloatData& grad = c.tensor("grad");
  r.params = {{"cp_size", c.cp_size}, {"first", std::string(sim::grad_op_name(c.first))},
              {"second", std::string(sim::grad_op_name(c.second))}, {"dtype", std::string(dtype_name(c.dtype))},
              {"B", c.batch()}};
  add_row_params(r, grad);
  const sim::StepRows rows(c.cu_seqlens_padded, sim::grad_step_rows(c.first, c.second));
  Tensor3<float> expected = tensor3(grad);
  sim::grad_correction(expected, tensor3(c.tensor("grad_step"), rows.rows()), rows, c.first, c.second, c.dtype);
  compare_rank_local_rows(c, r, expected.values);
}

void check_copy_valid_tokens(const HelperCall& c, HelperCallResult& r) {
  const FloatData& out = c.tensor("out");
  r.params = {{"B", c.batch()}};
  add_row_params(r, out);
  Tensor3<float> expected = tensor3(out);
  sim::copy_valid_rows(expected, tensor3(c.tensor("input")), c.cu_seqlens_padded_step, c.cu_seqlens_step);
  const FloatData& observed = c.tensor("output");
  compare_floats(r, expected.values, observed.values, [&](int64_t flat) {
    int64_t row = 0;
    ElementPlace p = row_place(observed, flat, row);
    place_row(p, c.cu_seqlens_padded_step, row);
    return p;
  });
}

std::string param_text(const ParamValue& v) {
  return std::holds_alternative<int64_t>(v) ? std::to_string(std::get<int64_t>(v)) : std::get<std::string>(v);
}

std::string float_text(float v) {
  char text[64];
  std::snprintf(text, sizeof text, "%.9g (0x%08x)", static_cast<double>(v), bits_of(v));
  return text;
}

std::string place_text(const HelperMismatch& m) {
  std::string out = "output[";
  for (size_t i = 0; i < m.place.index.size(); ++i)
    out += (i ? ", " : "") + m.place.index[i].first + " " + std::to_string(m.place.index[i].second);
  out += "] (";
  if (m.place.rank >= 0) out += "rank " + std::to_string(m.place.rank) + ", ";
  if (m.place.sequence < 0) out += "in no sequence";
  else if (m.place.row_in_sequence < 0) out += "sequence " + std::to_string(m.place.sequence) + ", past its rows";
  else
    out += "sequence " + std::to_string(m.place.sequence) + ", row " + std::to_string(m.place.row_in_sequence) +
           " of the sequence";
  return out + ")";
}

nlohmann::ordered_json float_json(float v) {
  nlohmann::ordered_json j;
  if (std::isnan(v)) j["value"] = "nan";
  else if (std::isinf(v)) j["value"] = v > 0 ? "inf" : "-inf";
  else j["value"] = static_cast<double>(v);
  char bits[16];
  std::snprintf(bits, sizeof bits, "0x%08x", bits_of(v));
  j["bits"] = bits;
  return j;
}

}  // namespace

std::optional<int64_t> ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::nullopt;
  auto key = [](float v) -> int64_t {
    const uint32_t u = bits_of(v);
    return (u & 0x80000000u) ? -static_cast<int64_t>(u & 0x7FFFFFFFu) - 1 : static_cast<int64_t>(u);
  };
  return std::abs(key(a) - key(b));
}

int HelpersReport::passed() const {
  return static_cast<int>(std::count_if(calls.begin(), calls.end(), [](const HelperCallResult& c) { return c.pass(); }));
}

HelperCallResult check_helper_call(const HelperCall& call) {
  HelperCallResult r;
  r.name = call.name;
  r.op = call.op;
  switch (call.op) {
    case HelperOp::partitioned_indices: check_partitioned_indices(call, r); break;
    case HelperOp::read_half: check_read_half(call, r); break;
    case HelperOp::sequence_to_rank_order:
    case HelperOp::rank_to_sequence_order: check_reorder(call, r); break;
    case HelperOp::second_half_lse_correction: check_lse_correction(call, r); break;
    case HelperOp::read_second_half_lse: check_read_second_half_lse(call, r); break;
    case HelperOp::out_correction: check_out_correction(call, r); break;
    case HelperOp::grad_correction: check_grad_correction(call, r); break;
    case HelperOp::copy_valid_tokens: check_copy_valid_tokens(call, r); break;
  }
  return r;
}

HelpersReport check_thd_helpers(const std::string& path) {
  const HelpersDump dump = read_helpers_dump(path);
  HelpersReport report;
  report.path = path;
  report.implementation = dump.implementation;
  for (const HelperCall& call : dump.calls) {
    try {
      report.calls.push_back(check_helper_call(call));
    } catch (const InputError& e) {
      // The reader validates what the twins need; this names the call if a twin still refuses it.
      fail_input(path + ":" + call.path, "the CPU twin refused the call: ", e.what());
    }
  }
  return report;
}

std::string render_text(const HelpersReport& report) {
  std::string out;
  for (const HelperCallResult& c : report.calls) {
    out += std::string(c.pass() ? "PASS " : "FAIL ") + c.name + " " + std::string(helper_op_name(c.op));
    for (const auto& [key, value] : c.params) out += " " + key + "=" + param_text(value);
    out += ": " + std::to_string(c.compared) + " elements compared";
    if (c.left_out > 0) out += ", " + std::to_string(c.left_out) + " left out (" + c.left_out_reason + ")";
    out += "\n";
    if (c.pass()) continue;
    out += "  " + std::to_string(c.mismatches) + " of " + std::to_string(c.compared) + " elements differ";
    if (c.max_ulp) out += " (at most " + std::to_string(*c.max_ulp) + " ulp apart)";
    const HelperMismatch& m = *c.first;
    out += "; first at " + place_text(m) + ": expected (twin) ";
    if (m.integer) out += std::to_string(m.expected_int) + ", observed " + std::to_string(m.observed_int);
    else out += float_text(m.expected) + ", observed " + float_text(m.observed);
    out += "\n";
  }
  out += "helpers-check: " + std::to_string(report.calls.size()) + " calls, " + std::to_string(report.passed()) +
         " passed, " + std::to_string(report.failed()) + " failed (" + report.implementation + ")\n";
  return out;
}

nlohmann::ordered_json to_json(const HelpersReport& report) {
  nlohmann::ordered_json j;
  j["format"] = std::string(kHelpersDumpFormat);
  j["version"] = kHelpersDumpVersion;
  j["file"] = report.path;
  j["implementation"] = report.implementation;
  j["calls"] = nlohmann::ordered_json::array();
  for (const HelperCallResult& c : report.calls) {
    nlohmann::ordered_json call;
    call["name"] = c.name;
    call["op"] = std::string(helper_op_name(c.op));
    call["params"] = nlohmann::ordered_json::object();
    for (const auto& [key, value] : c.params) {
      if (std::holds_alternative<int64_t>(value)) call["params"][key] = std::get<int64_t>(value);
      else call["params"][key] = std::get<std::string>(value);
    }
    call["verdict"] = c.pass() ? "PASS" : "FAIL";
    call["compared"] = c.compared;
    call["left_out"] = c.left_out;
    if (c.left_out > 0) call["left_out_reason"] = c.left_out_reason;
    call["mismatches"] = c.mismatches;
    call["max_ulp"] = c.max_ulp ? nlohmann::ordered_json(*c.max_ulp) : nlohmann::ordered_json(nullptr);
    if (c.first) {
      const HelperMismatch& m = *c.first;
      nlohmann::ordered_json f;
      f["flat_index"] = m.flat;
      f["index"] = nlohmann::ordered_json::object();
      for (const auto& [axis, value] : m.place.index) f["index"][axis] = value;
      f["rank"] = m.place.rank >= 0 ? nlohmann::ordered_json(m.place.rank) : nlohmann::ordered_json(nullptr);
      f["sequence"] = m.place.sequence >= 0 ? nlohmann::ordered_json(m.place.sequence) : nlohmann::ordered_json(nullptr);
      f["row_in_sequence"] =
          m.place.row_in_sequence >= 0 ? nlohmann::ordered_json(m.place.row_in_sequence) : nlohmann::ordered_json(nullptr);
      if (m.integer) {
        f["expected"] = {{"value", m.expected_int}};
        f["observed"] = {{"value", m.observed_int}};
      } else {
        f["expected"] = float_json(m.expected);
        f["observed"] = float_json(m.observed);
      }
      call["first_mismatch"] = f;
    } else {
      call["first_mismatch"] = nullptr;
    }
    j["calls"].push_back(call);
  }
  j["summary"] = {{"calls", report.calls.size()}, {"passed", report.passed()}, {"failed", report.failed()}};
  j["pass"] = report.pass();
  return j;
}

}  // namespace cpgold::fx
