// `cpgold check --identical A B`: two files compared bit for bit, attributes included (all but the provenance string
// /case generator), for every dataset type a file can hold: fixed-size types by their stored bytes, read in blocks
// of rows (bounded memory whatever the declared shape), variable-length strings and sequences by the bytes each
// element holds in the global heap. The walk is the Reader's catalogue: each object once.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "check/identical.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::fx {

namespace {

constexpr size_t kBlockBytes = size_t{16} << 20;  // raw bytes read at a time from each file
constexpr int64_t kVariableBlock = 4096;          // variable-length elements read at a time

const char* kind_name(h5::ObjectKind kind) {
  switch (kind) {
    case h5::ObjectKind::group: return "group";
    case h5::ObjectKind::dataset: return "dataset";
    case h5::ObjectKind::named_type: return "named datatype";
    case h5::ObjectKind::other: return "object";
  }
  return "object";
}

std::vector<std::string> compared_attributes(const h5::Reader& reader, const std::string& object) {
  std::vector<std::string> names = reader.attribute_names(object);
  if (object == "/case") names.erase(std::remove(names.begin(), names.end(), "generator"), names.end());  // provenance
  return names;
}

void compare_attributes(const h5::Reader& a, const h5::Reader& b, const std::string& object,
                        std::vector<std::string>& differences) {
  const std::vector<std::string> in_a = compared_attributes(a, object), in_b = compared_attributes(b, object);
  for (const std::string& name : in_a) {
    if (!std::binary_search(in_b.begin(), in_b.end(), name)) {
      differences.push_back(object + ": attribute '" + name + "' only in " + a.path());
      continue;
    }
    const std::string type_a = a.attr_type_text(object, name), type_b = b.attr_type_text(object, name);
    if (type_a != type_b) {
      differences.push_back(object + ": attribute '" + name + "' is " + type_a + " vs " + type_b);
      continue;
    }
    const std::string va = a.attr_text(object, name), vb = b.attr_text(object, name);
    if (va != vb)
      differences.push_back(object + ": attribute '" + name + "' differs (" + sim::excerpt(va, 80) + " vs " +
                            sim::excerpt(vb, 80) + ")");
  }
  for (const std::string& name : in_b)
    if (!std::binary_search(in_a.begin(), in_a.end(), name))
      differences.push_back(object + ": attribute '" + name + "' only in " + b.path());
}

void compare_dataset(const h5::Reader& a, const h5::Reader& b, const std::string& path,
                     std::vector<std::string>& differences) {
  const h5::DatasetInfo ia = a.info(path), ib = b.info(path);
  if (ia.type_text != ib.type_text || ia.dims != ib.dims) {
    differences.push_back(path + ": " + ia.type_text + " " + h5::dims_text(ia.dims) + " vs " + ib.type_text + " " +
                          h5::dims_text(ib.dims));
    return;
  }
  const int64_t rows = ia.dims.empty() ? 1 : ia.dims[0];
  int64_t inner = 1;
  for (size_t i = 1; i < ia.dims.size(); ++i) inner *= ia.dims[i];
  int64_t count = 0, first = -1;
  if (a.is_variable_length(path)) {
    const int64_t block = std::max<int64_t>(1, kVariableBlock / std::max<int64_t>(inner, 1));
    for (int64_t row = 0; row < rows && inner > 0; row += block) {
      const int64_t n = std::min(block, rows - row);
      const std::vector<std::string> va = a.read_variable_rows(path, row, n), vb = b.read_variable_rows(path, row, n);
      for (size_t i = 0; i < va.size(); ++i)
        if (va[i] != vb[i] && count++ == 0) first = row * inner + static_cast<int64_t>(i);
    }
  } else {
    a.check_readable(path);
    b.check_readable(path);
    const std::vector<uint8_t> probe = a.read_raw_rows(path, 0, rows > 0 ? std::min<int64_t>(rows, 1) : 0);
    const size_t row_bytes = rows > 0 ? probe.size() : 0;
    const size_t element = inner > 0 && row_bytes > 0 ? row_bytes / static_cast<size_t>(inner) : 1;
    const int64_t block = std::max<int64_t>(1, static_cast<int64_t>(kBlockBytes / std::max<size_t>(row_bytes, 1)));
    for (int64_t row = 0; row < rows && row_bytes > 0; row += block) {
      const int64_t n = std::min(block, rows - row);
      const std::vector<uint8_t> ra = a.read_raw_rows(path, row, n), rb = b.read_raw_rows(path, row, n);
      if (ra == rb) continue;
      for (size_t at = 0; at + element <= ra.size(); at += element)
        if (std::memcmp(&ra[at], &rb[at], element) != 0 && count++ == 0)
          first = row * inner + static_cast<int64_t>(at / element);
    }
  }
  if (count == 0) return;
  std::ostringstream line;
  line << path << ": " << count << " element(s) differ; first at flat index " << first << " ("
       << sim::excerpt(a.element_text(path, first), 80) << " vs " << sim::excerpt(b.element_text(path, first), 80) << ")";
  differences.push_back(line.str());
}

}  // namespace

IdenticalReport identical(const std::string& first, const std::string& second) {
  const h5::Reader a(first), b(second);
  IdenticalReport report;
  compare_attributes(a, b, "/", report.differences);
  for (const std::string& path : a.objects()) {
    const h5::ObjectKind kind = a.kind(path);
    if (kind == h5::ObjectKind::dataset) ++report.datasets;
    if (!b.exists(path)) {
      report.differences.push_back(path + ": only in " + first);
      continue;
    }
    if (b.kind(path) != kind) {
      report.differences.push_back(path + ": a " + kind_name(kind) + " vs a " + kind_name(b.kind(path)));
      continue;
    }
    compare_attributes(a, b, path, report.differences);
    if (kind == h5::ObjectKind::dataset) compare_dataset(a, b, path, report.differences);
  }
  for (const std::string& path : b.objects())
    if (!a.exists(path)) report.differences.push_back(path + ": only in " + second);
  return report;
}

std::string render_text(const IdenticalReport& report) {
  std::ostringstream out;
  out << report.datasets << " dataset(s) and every attribute compared bit for bit (/case generator excepted)\n";
  for (const std::string& d : report.differences) out << "  differs: " << d << "\n";
  out << "verdict: " << (report.pass() ? "IDENTICAL" : "DIFFERENT") << "\n";
  return out.str();
}

}  // namespace cpgold::fx
