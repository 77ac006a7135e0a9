#include "check/thd_helpers/helpers_dump.hpp"

#include <hdf5.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "fixtures/storage/hdf5_reader.hpp"
#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"

namespace cpgold::fx {

namespace {

constexpr std::pair<HelperOp, std::string_view> kOpNames[] = {
    {HelperOp::partitioned_indices, "partitioned_indices"}, {HelperOp::read_half, "read_half"},
    {HelperOp::sequence_to_rank_order, "sequence_to_rank_order"},
    {HelperOp::rank_to_sequence_order, "rank_to_sequence_order"},
    {HelperOp::second_half_lse_correction, "second_half_lse_correction"},
    {HelperOp::read_second_half_lse, "read_second_half_lse"}, {HelperOp::out_correction, "out_correction"},
    {HelperOp::grad_correction, "grad_correction"}, {HelperOp::copy_valid_tokens, "copy_valid_tokens"}};

std::string ops_list() {
  std::string out;
  for (const auto& [op, name] : kOpNames) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

// Attributes with their own shape and type checks: the dump comes from another program, and a list where one value
// is expected must be an error naming it, never a read past a one-value buffer. A second read-only handle on the file
// (HDF5 shares the open file between the two); h5::Reader serves the datasets.
class Attributes {
 public:
  explicit Attributes(const h5::Reader& reader)
      : reader_(reader), file_(H5Fopen(reader.path().c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose) {
    if (!file_.valid()) fail_input(reader.path(), "HDF5 cannot open the file to read its attributes");
  }

  bool has(const std::string& object, const std::string& name) const { return reader_.has_attribute(object, name); }
  std::vector<std::string> names(const std::string& object) const { return reader_.attribute_names(object); }

  // A signed or unsigned integer; with `flag`, also h5py's boolean (an enum FALSE / TRUE).
  int64_t integer(const std::string& object, const std::string& name, bool flag = false) const {
    h5::Id attribute = open(object, name);
    h5::Id type(H5Aget_type(attribute.get()), H5Tclose);
    const H5T_class_t type_class = H5Tget_class(type.get());
    if (type_class == H5T_INTEGER) {
      int64_t value = 0;
      if (H5Tget_sign(type.get()) == H5T_SGN_NONE && H5Tget_size(type.get()) >= 8) {
        uint64_t u = 0;
        if (H5Aread(attribute.get(), H5T_NATIVE_UINT64, &u) < 0) fail_read(object, name);
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail_input(reader_.where(object), "attribute '", name, "': value ", u, " is out of range");
        return static_cast<int64_t>(u);
      }
      if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0) fail_read(object, name);
      return value;
    }
    if (type_class == H5T_ENUM && flag && H5Tget_size(type.get()) <= 8) {
      unsigned char raw[8] = {};
      char member[16] = {};
      if (H5Aread(attribute.get(), type.get(), raw) < 0 || H5Tenum_nameof(type.get(), raw, member, sizeof member) < 0) {
        H5Eclear2(H5E_DEFAULT);
        fail_input(reader_.where(object), "attribute '", name, "': expected 0 or 1, found an enum value that is not ",
                   "h5py's FALSE or TRUE");
      }
      if (std::strcmp(member, "FALSE") == 0) return 0;
      if (std::strcmp(member, "TRUE") == 0) return 1;
      fail_input(reader_.where(object), "attribute '", name, "': expected 0 or 1, found the enum member ", member);
    }
    fail_input(reader_.where(object), "attribute '", name, "': expected an integer", flag ? " (0 or 1)" : "",
               ", found ", describe(object, name, attribute.get(), type.get()));
  }

  std::string text(const std::string& object, const std::string& name) const {
    h5::Id attribute = open(object, name);
    h5::Id type(H5Aget_type(attribute.get()), H5Tclose);
    if (H5Tget_class(type.get()) != H5T_STRING)
      fail_input(reader_.where(object), "attribute '", name, "': expected a string, found ",
                 describe(object, name, attribute.get(), type.get()));
    return read_string(object, name, attribute.get(), type.get());
  }

 private:
  h5::Id open(const std::string& object, const std::string& name) const {
    if (!has(object, name)) fail_input(reader_.where(object), "attribute '", name, "' missing");
    h5::Id attribute(H5Aopen_by_name(file_.get(), object.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!attribute.valid()) fail_read(object, name);
    h5::Id space(H5Aget_space(attribute.get()), H5Sclose);
    const hssize_t n = space.valid() ? H5Sget_simple_extent_npoints(space.get()) : -1;
    if (n != 1)
      fail_input(reader_.where(object), "attribute '", name, "': expected one value, found ", n < 0 ? 0 : n,
                 " values");
    return attribute;
  }

  [[noreturn]] void fail_read(const std::string& object, const std::string& name) const {
    const std::string detail = h5::hdf5_error_detail();
    H5Eclear2(H5E_DEFAULT);
    fail_input(reader_.where(object), "cannot read attribute '", name, "'", detail.empty() ? "" : " (HDF5: " + detail + ")");
  }

  std::string read_string(const std::string& object, const std::string& name, hid_t attribute, hid_t type) const {
    // Variable-length strings through h5::Reader, which validates the global heap object first (HDF5 1.10's own heap
    // reader crashes on a damaged one; docs/hostile-input.md).
    if (H5Tis_variable_str(type) > 0) {
      const std::vector<std::string> values = reader_.attr_strings(object, name);
      return values.empty() ? std::string() : values.front();
    }
    std::string value(H5Tget_size(type), '\0');
    if (H5Aread(attribute, type, value.data()) < 0) fail_read(object, name);
    value.erase(std::find(value.begin(), value.end(), '\0'), value.end());
    return value;
  }

  // What a value of another type is, for the error message: "the float 2.5", "the string \"2\"".
  std::string describe(const std::string& object, const std::string& name, hid_t attribute, hid_t type) const {
    const H5T_class_t type_class = H5Tget_class(type);
    if (type_class == H5T_FLOAT) {
      double value = 0;
      if (H5Aread(attribute, H5T_NATIVE_DOUBLE, &value) >= 0) {
        char text[64];
        std::snprintf(text, sizeof text, "the float %.17g", value);
        return text;
      }
      H5Eclear2(H5E_DEFAULT);
      return "a float";
    }
    if (type_class == H5T_STRING) return "the string \"" + read_string(object, name, attribute, type) + "\"";
    if (type_class == H5T_ENUM) return "an enum (h5py writes a numpy bool so)";
    if (type_class == H5T_INTEGER) return "an integer";
    return "a value of HDF5 type class " + std::to_string(static_cast<int>(type_class));
  }

  const h5::Reader& reader_;
  h5::Id file_;
};

// Validation of one call; every error names the call's group or one of its datasets.
class CallReader {
 public:
  CallReader(const h5::Reader& reader, const Attributes& attributes, HelperCall& call)
      : reader_(reader), attributes_(attributes), call_(call) {}

  void read() {
    const std::string op_text = attributes_.text(call_.path, "op");
    const std::optional<HelperOp> op = parse_helper_op(op_text);
    if (!op) fail_call("attribute 'op': unknown op \"", op_text, "\" (expected one of ", ops_list(), ")");
    call_.op = *op;
    expect_members();
    if (call_.op != HelperOp::copy_valid_tokens) {
      const int64_t w = attributes_.integer(call_.path, "cp_size");
      if (w < 1 || w > std::numeric_limits<int32_t>::max() / 2)
        fail_call("attribute 'cp_size': value ", w, " is out of range (expected 1 <= cp_size <= 2^30 - 1)");
      call_.cp_size = static_cast<int>(w);
    }
    switch (call_.op) {
      case HelperOp::partitioned_indices: return read_partitioned_indices();
      case HelperOp::read_half: return read_read_half();
      case HelperOp::sequence_to_rank_order:
      case HelperOp::rank_to_sequence_order: return read_reorder();
      case HelperOp::second_half_lse_correction: return read_lse_correction();
      case HelperOp::read_second_half_lse: return read_second_half_lse();
      case HelperOp::out_correction: return read_out_correction();
      case HelperOp::grad_correction: return read_grad_correction();
      case HelperOp::copy_valid_tokens: return read_copy_valid_tokens();
    }
  }

 private:
  template <class... Parts>
  [[noreturn]] void fail_call(const Parts&... parts) const {
    fail_input(reader_.where(call_.path), parts...);
  }
  template <class... Parts>
  [[noreturn]] void fail_dataset(const std::string& dataset, const Parts&... parts) const {
    fail_input(reader_.where(dataset_path(dataset)), parts...);
  }
  std::string dataset_path(const std::string& dataset) const { return call_.path + "/" + dataset; }

  // The attributes and datasets each op has; anything else in the group is refused (a misspelt name would otherwise
  // surface as a confusing "missing").
  void expect_members() const {
    std::set<std::string> attrs = {"op", "cp_size"}, datasets = {"cu_seqlens_padded", "output"};
    switch (call_.op) {
      case HelperOp::partitioned_indices: attrs.insert({"rank", "total_rows"}); break;
      case HelperOp::read_half: attrs.insert("half"); datasets.insert("input"); break;
      case HelperOp::sequence_to_rank_order:
      case HelperOp::rank_to_sequence_order: datasets.insert("input"); break;
      case HelperOp::second_half_lse_correction:
        attrs.insert("packed");
        datasets.insert({"lse", "lse_half"});
        break;
      case HelperOp::read_second_half_lse:
        attrs.insert({"packed", "second_half_lse_seqlen"});
        datasets.insert("lse");
        break;
      case HelperOp::out_correction:
        attrs.insert({"only_second_half", "packed", "dtype"});
        datasets.insert({"out", "out_step", "lse", "lse_step"});
        break;
      case HelperOp::grad_correction:
        attrs.insert({"first", "second", "dtype"});
        datasets.insert({"grad", "grad_step"});
        break;
      case HelperOp::copy_valid_tokens:
        attrs = {"op"};
        datasets = {"cu_seqlens_padded_step", "cu_seqlens_step", "out", "input", "output"};
        break;
    }
    for (const std::string& name : attributes_.names(call_.path))
      if (!attrs.count(name))
        fail_call("unexpected attribute '", name, "' for op ", helper_op_name(call_.op), " (its attributes: ",
                  join(attrs), ")");
    for (const std::string& name : reader_.children(call_.path))
      if (!datasets.count(name))
        fail_call("unexpected object '", name, "' for op ", helper_op_name(call_.op), " (its datasets: ",
                  join(datasets), ")");
    for (const std::string& name : datasets)
      if (!reader_.exists(dataset_path(name))) fail_dataset(name, "dataset missing (op ", helper_op_name(call_.op), ")");
  }

  static std::string join(const std::set<std::string>& names) {
    std::string out;
    for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  }

  // ---- attributes ----
  bool flag(const std::string& name) const {
    const int64_t v = attributes_.integer(call_.path, name, true);
    if (v != 0 && v != 1) fail_call("attribute '", name, "': value ", v, " is not 0 or 1");
    return v == 1;
  }
  DType dtype() const {
    const std::string text = attributes_.text(call_.path, "dtype");
    if (text == "bf16") return DType::bf16;
    if (text == "fp16") return DType::fp16;
    if (text == "fp32") return DType::fp32;
    fail_call("attribute 'dtype': value \"", text, "\" is not bf16, fp16 or fp32");
  }
  sim::GradOp grad_op(const std::string& name) const {
    const std::string text = attributes_.text(call_.path, name);
    if (text == "none") return sim::GradOp::none;
    if (text == "copy") return sim::GradOp::copy;
    if (text == "add") return sim::GradOp::add;
    fail_call("attribute '", name, "': value \"", text, "\" is not none, copy or add");
  }

  // ---- datasets ----
  h5::DatasetInfo info(const std::string& name) const { return reader_.info(dataset_path(name)); }

  FloatData float_dataset(const std::string& name, size_t rank, const char* shape_text) const {
    const h5::DatasetInfo i = info(name);
    if (i.element != h5::Element::fp32)
      fail_dataset(name, "expected float32 values, found ", i.type_text,
                   " (bits are compared: write the outputs' exact values as float32)");
    if (i.dims.size() != rank)
      fail_dataset(name, "expected ", rank, " dimensions ", shape_text, ", found shape ", h5::dims_text(i.dims));
    FloatData data;
    data.dims = i.dims;
    data.values = reader_.read_float(dataset_path(name));
    return data;
  }

  std::vector<int32_t> offsets(const std::string& name) const {
    const h5::DatasetInfo i = info(name);
    if (i.element != h5::Element::int32) fail_dataset(name, "expected int32 offsets, found ", i.type_text);
    if (i.dims.size() != 1 || i.dims[0] < 2)
      fail_dataset(name, "expected a 1-dimensional [B+1] array with B >= 1, found shape ", h5::dims_text(i.dims));
    return reader_.read_int32(dataset_path(name));
  }

  // Non-decreasing offsets; from_zero: entry 0 is 0, otherwise it is >= 0.
  void check_order(const std::string& name, const std::vector<int32_t>& cu, bool from_zero) const {
    if (from_zero && cu[0] != 0) fail_dataset(name, "entry [0] = ", cu[0], " must be 0");
    if (cu[0] < 0) fail_dataset(name, "entry [0] = ", cu[0], " is negative");
    for (size_t b = 1; b < cu.size(); ++b)
      if (cu[b] < cu[b - 1])
        fail_dataset(name, "entry [", b, "] = ", cu[b], " is below entry [", b - 1, "] = ", cu[b - 1]);
  }

  // Global padded offsets of a dual-chunk layout: every padded length a multiple of 2W.
  void read_global_offsets() {
    call_.cu_seqlens_padded = offsets("cu_seqlens_padded");
    const std::vector<int32_t>& cu = call_.cu_seqlens_padded;
    check_order("cu_seqlens_padded", cu, true);
    const int64_t unit = 2 * static_cast<int64_t>(call_.cp_size);
    for (size_t b = 0; b + 1 < cu.size(); ++b)
      if ((cu[b + 1] - cu[b]) % unit != 0)
        fail_dataset("cu_seqlens_padded", "sequence ", b, " has padded length ", cu[b + 1] - cu[b],
                     " (entries [", b, "] = ", cu[b], ", [", b + 1, "] = ", cu[b + 1], "), not a multiple of 2 * cp_size = ",
                     unit);
  }

  // Rank-local padded offsets cuP/W; halves: every local length even (two chunks of C_b rows).
  void read_local_offsets(bool halves) {
    call_.cu_seqlens_padded = offsets("cu_seqlens_padded");
    const std::vector<int32_t>& cu = call_.cu_seqlens_padded;
    check_order("cu_seqlens_padded", cu, true);
    if (halves)
      for (size_t b = 0; b + 1 < cu.size(); ++b)
        if ((cu[b + 1] - cu[b]) % 2 != 0)
          fail_dataset("cu_seqlens_padded", "sequence ", b, " has odd rank-local length ", cu[b + 1] - cu[b],
                       " (entries [", b, "] = ", cu[b], ", [", b + 1, "] = ", cu[b + 1],
                       "): rank-local offsets cuP/W hold two chunks of C_b rows per sequence");
  }

  int64_t local_total() const { return call_.cu_seqlens_padded.back(); }
  int64_t longest_local() const {
    int64_t longest = 0;
    for (size_t b = 0; b + 1 < call_.cu_seqlens_padded.size(); ++b)
      longest = std::max<int64_t>(longest, call_.cu_seqlens_padded[b + 1] - call_.cu_seqlens_padded[b]);
    return longest;
  }

  void expect_dims(const std::string& name, const std::vector<int64_t>& want, const std::string& why) const {
    const std::vector<int64_t>& got = call_.tensors.at(name).dims;
    if (got != want)
      fail_dataset(name, "shape ", h5::dims_text(got), " differs from the expected ", h5::dims_text(want), " (", why, ")");
  }

  // A row tensor [t, h, d] with t >= min_rows.
  void row_tensor(const std::string& name, int64_t min_rows, const std::string& why) {
    call_.tensors[name] = float_dataset(name, 3, "[t, h, d]");
    const int64_t t = call_.tensors[name].rows();
    if (t < min_rows) fail_dataset(name, "has ", t, " rows, fewer than ", min_rows, " (", why, ")");
  }

  // Values of the call's dtype only (the float32 dataset holds the exact values of the dtype the op worked in).
  void check_dtype_values(const std::string& name) const {
    if (call_.dtype == DType::fp32) return;
    const FloatData& data = call_.tensors.at(name);
    for (size_t i = 0; i < data.values.size(); ++i) {
      const float v = data.values[i];
      const uint32_t bits = std::bit_cast<uint32_t>(v);
      const bool ok = std::isnan(v) ? (bits & (call_.dtype == DType::bf16 ? 0xFFFFu : 0x1FFFu)) == 0
                                    : std::bit_cast<uint32_t>(round_to(call_.dtype, v)) == bits;
      if (!ok) {
        char text[64];
        std::snprintf(text, sizeof text, "%.9g (0x%08x)", static_cast<double>(v), bits);
        fail_dataset(name, "element ", i, " (flat index) holds ", text, ", not a ", dtype_name(call_.dtype),
                     " value (attribute dtype = \"", dtype_name(call_.dtype), "\")");
      }
    }
  }

  // The tensor a correction updates in place (`name`, [t, h, d], the rank-local rows) and the step's partial
  // (`name`_step: rows / `div`, the same heads and dim; `step_shape` and `step_why` for its messages).
  const FloatData& corrected_tensor(const std::string& name, int64_t div, const char* step_shape,
                                    const std::string& step_why) {
    row_tensor(name, local_total(), "cu_seqlens_padded[B] rank-local rows are corrected");
    const FloatData& x = call_.tensors[name];
    call_.tensors[name + "_step"] = float_dataset(name + "_step", 3, step_shape);
    expect_dims(name + "_step", {x.dims[0] / div, x.dims[1], x.dims[2]}, step_why);
    return x;
  }

  // The output of a correction (the shape of `name`); `name` and `name`_step hold values of the dtype.
  void corrected_output(const std::string& name) {
    call_.tensors["output"] = float_dataset("output", 3, "[t, h, d]");
    expect_dims("output", call_.tensors[name].dims, "the shape of " + name);
    check_dtype_values(name);
    check_dtype_values(name + "_step");
  }

  // LSE [h, S] (packed) or [B, h, S]; min_columns: what the indexing needs (packed: the rows indexed; unpacked: the
  // longest sequence).
  void lse_tensor(const std::string& name, int64_t heads, int64_t min_columns, const std::string& why) {
    const bool packed = call_.packed;
    call_.tensors[name] = float_dataset(name, packed ? 2 : 3, packed ? "[h, S] (packed = 1)" : "[B, h, S] (packed = 0)");
    const std::vector<int64_t>& d = call_.tensors[name].dims;
    if (!packed && d[0] != call_.batch())
      fail_dataset(name, "shape ", h5::dims_text(d), ": B = ", d[0], " differs from the ", call_.batch(),
                   " sequences of cu_seqlens_padded");
    const int64_t h = d[packed ? 0 : 1], s = d[packed ? 1 : 2];
    if (h < 1) fail_dataset(name, "shape ", h5::dims_text(d), ": no heads");
    if (heads >= 0 && h != heads) fail_dataset(name, "shape ", h5::dims_text(d), ": ", h, " heads, expected ", heads);
    if (s < min_columns)
      fail_dataset(name, "shape ", h5::dims_text(d), ": S = ", s, " is below ", min_columns, " (", why, ")");
  }
  int64_t lse_heads(const std::string& name) const { return call_.tensors.at(name).dims[call_.packed ? 0 : 1]; }
  int64_t lse_seqlen(const std::string& name) const { return call_.tensors.at(name).dims[call_.packed ? 1 : 2]; }

  // ---- ops ----
  void read_partitioned_indices() {
    const int64_t rank = attributes_.integer(call_.path, "rank");
    if (rank < 0 || rank >= call_.cp_size)
      fail_call("attribute 'rank': value ", rank, " is not in [0, cp_size = ", call_.cp_size, ")");
    call_.rank = static_cast<int>(rank);
    read_global_offsets();
    call_.total_rows = attributes_.integer(call_.path, "total_rows");
    if (call_.total_rows != call_.cu_seqlens_padded.back())
      fail_call("attribute 'total_rows': value ", call_.total_rows, " differs from cu_seqlens_padded[B] = ",
                call_.cu_seqlens_padded.back(), " (the kernel maps exactly the rows of the sequences)");
    const h5::DatasetInfo i = info("output");
    if (i.element != h5::Element::int32 && i.element != h5::Element::int64)
      fail_dataset("output", "expected int32 or int64 indices, found ", i.type_text);
    const std::vector<int64_t> want = {call_.total_rows / call_.cp_size};
    if (i.dims != want)
      fail_dataset("output", "shape ", h5::dims_text(i.dims), " differs from the expected ", h5::dims_text(want),
                   " (total_rows / cp_size)");
    call_.indices = reader_.read_int64(dataset_path("output"));
  }

  void read_read_half() {
    const int64_t half = attributes_.integer(call_.path, "half");
    if (half != 0 && half != 1) fail_call("attribute 'half': value ", half, " is not 0 or 1");
    call_.half = static_cast<int>(half);
    read_local_offsets(true);
    if (local_total() * call_.cp_size > std::numeric_limits<int32_t>::max())
      fail_dataset("cu_seqlens_padded", "entry [B] = ", local_total(), " times cp_size = ", call_.cp_size,
                   " exceeds the int32 range of global offsets");
    row_tensor("input", local_total(), "cu_seqlens_padded[B] rows are read");
    const FloatData& in = call_.tensors["input"];
    call_.tensors["output"] = float_dataset("output", 3, "[t/2, h, d]");
    expect_dims("output", {in.dims[0] / 2, in.dims[1], in.dims[2]}, "input rows / 2, input heads and dim");
  }

  void read_reorder() {
    read_global_offsets();
    row_tensor("input", 0, "");
    const FloatData& in = call_.tensors["input"];
    if (in.rows() != call_.cu_seqlens_padded.back())
      fail_dataset("input", "has ", in.rows(), " rows, expected cu_seqlens_padded[B] = ", call_.cu_seqlens_padded.back(),
                   " (the kernel moves exactly the rows of the sequences)");
    call_.tensors["output"] = float_dataset("output", 3, "[T, h, d]");
    expect_dims("output", in.dims, "the input's shape");
  }

  void read_lse_correction() {
    call_.packed = flag("packed");
    read_local_offsets(true);
    lse_tensor("lse", -1, call_.packed ? local_total() : longest_local(),
               call_.packed ? "cu_seqlens_padded[B] columns are indexed" : "the longest rank-local sequence");
    const int64_t heads = lse_heads("lse");
    if (call_.packed) {
      lse_tensor("lse_half", heads, local_total() / 2, "cu_seqlens_padded[B] / 2 half rows are indexed");
    } else {
      lse_tensor("lse_half", heads, 0, "");
      if (lse_seqlen("lse_half") != lse_seqlen("lse") / 2)
        fail_dataset("lse_half", "shape ", h5::dims_text(call_.tensors["lse_half"].dims), ": S = ",
                     lse_seqlen("lse_half"), " differs from lse's S / 2 = ", lse_seqlen("lse") / 2);
    }
    call_.tensors["output"] = float_dataset("output", call_.packed ? 2 : 3, "(the shape of lse)");
    expect_dims("output", call_.tensors["lse"].dims, "the shape of lse");
  }

  void read_second_half_lse() {
    call_.packed = flag("packed");
    read_local_offsets(true);
    lse_tensor("lse", -1, call_.packed ? local_total() : longest_local(),
               call_.packed ? "cu_seqlens_padded[B] columns are indexed" : "the longest rank-local sequence");
    const std::vector<int64_t>& d = call_.tensors["lse"].dims;
    const bool has_s2 = attributes_.has(call_.path, "second_half_lse_seqlen");
    if (call_.packed) {
      if (!has_s2) fail_call("attribute 'second_half_lse_seqlen' missing (required when packed = 1)");
      call_.second_half_lse_seqlen = attributes_.integer(call_.path, "second_half_lse_seqlen");
      if (call_.second_half_lse_seqlen < local_total() / 2 ||
          call_.second_half_lse_seqlen > std::numeric_limits<int32_t>::max())
        fail_call("attribute 'second_half_lse_seqlen': value ", call_.second_half_lse_seqlen,
                  " is below cu_seqlens_padded[B] / 2 = ", local_total() / 2, " (the half rows written) or above 2^31-1");
    } else {
      call_.second_half_lse_seqlen = d[2] / 2;
      if (has_s2 && attributes_.integer(call_.path, "second_half_lse_seqlen") != d[2] / 2)
        fail_call("attribute 'second_half_lse_seqlen': value ",
                  attributes_.integer(call_.path, "second_half_lse_seqlen"), " differs from lse's S / 2 = ", d[2] / 2,
                  " (unpacked: optional, and when given it must be S / 2)");
    }
    call_.tensors["output"] = float_dataset("output", call_.packed ? 2 : 3, call_.packed ? "[h, S2]" : "[B, h, S/2]");
    if (call_.packed)
      expect_dims("output", {d[0], call_.second_half_lse_seqlen}, "lse heads, second_half_lse_seqlen");
    else
      expect_dims("output", {d[0], d[1], d[2] / 2}, "lse's B and heads, S / 2");
  }

  void read_out_correction() {
    call_.only_second_half = flag("only_second_half");
    call_.packed = flag("packed");
    call_.dtype = dtype();
    read_local_offsets(call_.only_second_half);
    const int64_t div = call_.only_second_half ? 2 : 1;
    const FloatData& out = corrected_tensor("out", div, "[t / (1 + only_second_half), h, d]",
                                            call_.only_second_half ? "out rows / 2, out heads and dim" : "the shape of out");
    const int64_t heads = out.dims[1];
    lse_tensor("lse", heads, call_.packed ? local_total() : longest_local(),
               call_.packed ? "cu_seqlens_padded[B] columns are indexed" : "the longest rank-local sequence");
    lse_tensor("lse_step", heads, (call_.packed ? local_total() : longest_local()) / div,
               call_.packed ? "the step rows cu_seqlens_padded[B] / (1 + only_second_half) are indexed"
                            : "the longest step sequence");
    corrected_output("out");
  }

  void read_grad_correction() {
    call_.first = grad_op("first");
    call_.second = grad_op("second");
    const bool one_half = (call_.first == sim::GradOp::none) != (call_.second == sim::GradOp::none);
    const bool both = call_.first != sim::GradOp::none && call_.second != sim::GradOp::none && call_.first != call_.second;
    if (!one_half && !both)
      fail_call("attributes 'first' and 'second': (\"", sim::grad_op_name(call_.first), "\", \"", sim::grad_op_name(call_.second),
                "\") is not a mode of thd_grad_correction (expected one of (add|copy, none), (none, add|copy), "
                "(add, copy), (copy, add))");
    call_.dtype = dtype();
    read_local_offsets(true);
    corrected_tensor("grad", one_half ? 2 : 1, "[t or t/2, h, d]",
                     one_half ? "grad rows / 2 for a one-half mode, grad heads and dim"
                              : "the shape of grad for a two-half mode");
    corrected_output("grad");
  }

  void read_copy_valid_tokens() {
    call_.cu_seqlens_padded_step = offsets("cu_seqlens_padded_step");
    check_order("cu_seqlens_padded_step", call_.cu_seqlens_padded_step, false);
    call_.cu_seqlens_step = offsets("cu_seqlens_step");
    check_order("cu_seqlens_step", call_.cu_seqlens_step, true);
    if (call_.cu_seqlens_step.size() != call_.cu_seqlens_padded_step.size())
      fail_dataset("cu_seqlens_step", "has ", call_.cu_seqlens_step.size(), " entries, cu_seqlens_padded_step has ",
                   call_.cu_seqlens_padded_step.size());
    row_tensor("out", 0, "");
    const FloatData& out = call_.tensors["out"];
    call_.tensors["input"] = float_dataset("input", 3, "[t, h, d]");
    expect_dims("input", out.dims, "the shape of out");
    call_.tensors["output"] = float_dataset("output", 3, "[t, h, d]");
    expect_dims("output", out.dims, "the shape of out");
  }

  const h5::Reader& reader_;
  const Attributes& attributes_;
  HelperCall& call_;
};

}  // namespace

std::string_view helper_op_name(HelperOp op) { return name_in(kOpNames, op); }

std::optional<HelperOp> parse_helper_op(std::string_view text) { return parse_in(kOpNames, text); }

int HelperCall::batch() const {
  const std::vector<int32_t>& cu = op == HelperOp::copy_valid_tokens ? cu_seqlens_padded_step : cu_seqlens_padded;
  return static_cast<int>(cu.size()) - 1;
}

HelpersDump read_helpers_dump(const std::string& path) {
  const h5::Reader reader(path);
  const Attributes attributes(reader);
  HelpersDump dump;
  dump.path = path;
  const std::string format = attributes.text("/", "format");
  if (format != kHelpersDumpFormat)
    fail_input(reader.where("/"), "attribute 'format': value \"", format, "\" is not \"", kHelpersDumpFormat,
               "\" (not a THD helper dump)");
  const int64_t version = attributes.integer("/", "version");
  if (version != kHelpersDumpVersion)
    fail_input(reader.where("/"), "attribute 'version': value ", version, " is not supported (this cpgold reads version ",
               kHelpersDumpVersion, ")");
  dump.implementation = attributes.text("/", "implementation");
  for (const std::string& name : reader.children("/"))
    if (name != "calls") fail_input(reader.where("/" + name), "unexpected object at the root (a dump holds /calls only)");
  if (!reader.is_group("/calls"))
    fail_input(reader.where("/calls"), reader.exists("/calls") ? "expected a group of calls, found a dataset"
                                                                 : "group missing (one subgroup per call)");
  const std::vector<std::string> names = reader.children("/calls");
  if (names.empty()) fail_input(reader.where("/calls"), "holds no calls: nothing to check");
  for (const std::string& name : names) {
    HelperCall call;
    call.name = name;
    call.path = "/calls/" + name;
    if (!reader.is_group(call.path)) fail_input(reader.where(call.path), "expected a group (one call), found a dataset");
    CallReader(reader, attributes, call).read();
    dump.calls.push_back(std::move(call));
  }
  return dump;
}

}  // namespace cpgold::fx
