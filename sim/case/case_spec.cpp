#include "sim/case/case_spec.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "reference/enum_names.hpp"
#include "reference/input_error.hpp"

namespace cpgold::sim {

namespace {

using json = nlohmann::json;

// Documented key order (docs/case-spec.md); also the set of accepted keys.
const std::vector<std::string>& case_keys() {
  static const std::vector<std::string> keys = {
      "seqlens_q", "seqlens_kv", "padded_q", "padded_kv", "total_tokens_q", "total_tokens_kv",
      "heads_q",   "heads_kv",   "dim_qk",   "dim_v",     "dtype",          "mask",
      "window",    "cp_size",    "comm",     "a2a_size",  "seed",           "pad_fill",
      "softmax_scale"};
  return keys;
}

// A value in a message: its JSON text, cut (parse_json bounds the depth, so dump() stays shallow).
std::string show(const json& value) { return excerpt(value.dump(-1, ' ', false, json::error_handler_t::replace)); }

// `why`: the reason for the range, appended to the message.
int64_t get_int(const json& value, const std::string& field, int64_t lo, int64_t hi, const char* why = "") {
  if (!value.is_number_integer())
    fail_input(field, "must be an integer, got ", show(value));
  const bool past_int64 = value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
  const int64_t x = past_int64 ? 0 : value.get<int64_t>();
  if (past_int64 || x < lo || x > hi) fail_input(field, "value ", show(value), " outside [", lo, ", ", hi, "]", why);
  return x;
}

template <class Json>
Json parse_bounded(std::string_view text, const std::string& field) {
  if (text.size() > kMaxJsonBytes)
    fail_input(field, "JSON of ", text.size(), " bytes, more than the ", kMaxJsonBytes, " accepted: ", excerpt(text));
  int level = 0;
  std::vector<std::set<std::string>> keys;  // keys of each open object
  typename Json::parser_callback_t check = [&](int, typename Json::parse_event_t event, Json& parsed) -> bool {
    using Event = typename Json::parse_event_t;
    switch (event) {
      case Event::object_start:
        keys.emplace_back();
        [[fallthrough]];
      case Event::array_start:
        if (++level > kMaxJsonDepth)
          throw InputError(field, "JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels: " + excerpt(text));
        break;
      case Event::object_end:
        if (!keys.empty()) keys.pop_back();
        [[fallthrough]];
      case Event::array_end:
        --level;
        break;
      case Event::key:
        if (!keys.empty() && !keys.back().insert(parsed.template get<std::string>()).second)
          throw InputError(field, "key \"" + excerpt(parsed.template get<std::string>(), 64) + "\" appears twice in one "
                           "object (JSON would keep the last silently): give each key once: " + excerpt(text));
        break;
      case Event::value: break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), check);
  } catch (const InputError&) {
    throw;
  } catch (const std::exception& e) {  // parse errors and number overflow (1e400)
    fail_input(field, "is not valid JSON (", excerpt(e.what(), 240), "): ", excerpt(text));
  }
}

std::vector<int32_t> get_lengths(const json& value, const std::string& field) {
  if (!value.is_array()) fail_input(field, "must be a list of integers, got ", show(value));
  std::vector<int32_t> out;
  for (size_t i = 0; i < value.size(); ++i)
    out.push_back(static_cast<int32_t>(get_int(value[i], field + "[" + std::to_string(i) + "]", 0, INT32_MAX)));
  return out;
}

std::string get_string(const json& value, const std::string& field) {
  if (!value.is_string()) fail_input(field, "must be a string, got ", show(value));
  return value.get<std::string>();
}

json lengths_json(const std::vector<int32_t>& v) { return json(v); }

}  // namespace

std::string excerpt(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  return std::string(text.substr(0, max_bytes)) + "... (" + std::to_string(text.size() - max_bytes) + " more bytes)";
}

json parse_json(std::string_view text, const std::string& field) { return parse_bounded<json>(text, field); }
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& field) {
  return parse_bounded<nlohmann::ordered_json>(text, field);
}

constexpr std::pair<CommType, std::string_view> kCommNames[] = {
    {CommType::p2p, "p2p"},
    {CommType::a2a, "a2a"},
    {CommType::all_gather, "all_gather"},
    {CommType::a2a_p2p, "a2a+p2p"}};
constexpr std::pair<PadFill, std::string_view> kPadFillNames[] = {
    {PadFill::zero, "zero"}, {PadFill::random, "random"}, {PadFill::nan, "nan"}, {PadFill::inf, "inf"}};

std::string_view comm_name(CommType comm) { return name_in(kCommNames, comm); }

CommType parse_comm(std::string_view text) {
  if (auto comm = parse_in(kCommNames, text)) return *comm;
  fail_input("comm", "value \"", text, "\" is not one of p2p, a2a, all_gather, a2a+p2p");
}

std::string_view pad_fill_name(PadFill fill) { return name_in(kPadFillNames, fill); }

PadFill parse_pad_fill(std::string_view text) {
  if (auto fill = parse_in(kPadFillNames, text)) return *fill;
  fail_input("pad_fill", "value \"", text, "\" is not one of zero, random, nan, inf");
}

std::vector<int32_t> pad_lengths_for_cp(const std::vector<int32_t>& lengths, int cp_size) {
  if (cp_size < 1) fail_input("cp_size", "must be >= 1, got ", cp_size);
  const int64_t m = 2 * static_cast<int64_t>(cp_size);
  std::vector<int32_t> out;
  out.reserve(lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0) fail_input("seqlens[" + std::to_string(b) + "]", "must be >= 0, got ", lengths[b]);
    const int64_t p = (lengths[b] + m - 1) / m * m;
    if (p > INT32_MAX) fail_input("seqlens[" + std::to_string(b) + "]", "value ", lengths[b], " padded to ", p, " exceeds int32");
    out.push_back(static_cast<int32_t>(p));
  }
  return out;
}

std::vector<int32_t> seqlens_kv(const CaseSpec& s) { return s.seqlens_kv.empty() ? s.seqlens_q : s.seqlens_kv; }
std::vector<int32_t> padded_q(const CaseSpec& s) {
  return s.padded_q.empty() ? pad_lengths_for_cp(s.seqlens_q, s.cp_size) : s.padded_q;
}
// Self-attention (seqlens_kv absent or equal to seqlens_q): K/V are laid out as Q unless padded_kv says otherwise, so
// that a padded_q alone pads both sides alike (a ring that assumes equal Q and K/V chunks works on it).
std::vector<int32_t> padded_kv(const CaseSpec& s) {
  if (!s.padded_kv.empty()) return s.padded_kv;
  if (!s.padded_q.empty() && seqlens_kv(s) == s.seqlens_q) return s.padded_q;
  return pad_lengths_for_cp(seqlens_kv(s), s.cp_size);
}
namespace {
// total_tokens_kv: as given; else total_tokens_q where K/V are laid out as Q (same lengths, same padding); else -1
// (the sum of padded_kv).
int64_t total_tokens_kv(const CaseSpec& s) {
  if (s.total_tokens_kv >= 0) return s.total_tokens_kv;
  if (s.total_tokens_q >= 0 && seqlens_kv(s) == s.seqlens_q && padded_kv(s) == padded_q(s)) return s.total_tokens_q;
  return -1;
}
}  // namespace
int heads_kv(const CaseSpec& s) { return s.heads_kv < 0 ? s.heads_q : s.heads_kv; }
int dim_v(const CaseSpec& s) { return s.dim_v < 0 ? s.dim_qk : s.dim_v; }
int a2a_size(const CaseSpec& s) { return s.a2a_size < 0 ? 2 : s.a2a_size; }
double softmax_scale(const CaseSpec& s) {
  return s.softmax_scale ? *s.softmax_scale : 1.0 / std::sqrt(static_cast<double>(s.dim_qk));
}
Window mask_window(const CaseSpec& s) { return normalize_window(s.causal, s.window); }

ThdLayout layout(const CaseSpec& s) {
  ThdLayout l;
  l.q = make_packed_sequences(s.seqlens_q, padded_q(s), s.total_tokens_q, "q");
  l.kv = make_packed_sequences(seqlens_kv(s), padded_kv(s), total_tokens_kv(s), "kv");
  l.validate();
  return l;
}

void validate_case(const CaseSpec& s) {
  if (s.cp_size < 1) fail_input("cp_size", "must be >= 1, got ", s.cp_size);
  if (s.cp_size > kMaxCpSize) fail_input("cp_size", "value ", s.cp_size, " is above the supported maximum ", kMaxCpSize);
  if (s.seqlens_q.empty()) fail_input("seqlens_q", "must list at least one sequence, got []");
  if (s.heads_q < 1) fail_input("heads_q", "must be >= 1, got ", s.heads_q);
  const int hkv = heads_kv(s);
  if (hkv < 1) fail_input("heads_kv", "must be >= 1, got ", hkv);
  if (s.heads_q % hkv != 0)
    fail_input("heads_kv", "value ", hkv, " does not divide heads_q = ", s.heads_q, " (GQA needs heads_q = g * heads_kv)");
  if (s.dim_qk < 1) fail_input("dim_qk", "must be >= 1, got ", s.dim_qk);
  if (dim_v(s) < 1) fail_input("dim_v", "must be >= 1, got ", dim_v(s));
  if (s.softmax_scale && !(*s.softmax_scale >= kMinSoftmaxScale && *s.softmax_scale <= kMaxSoftmaxScale))
    fail_input("softmax_scale", "value ", *s.softmax_scale, " outside the supported range [", kMinSoftmaxScale, ", ",
               kMaxSoftmaxScale, "]");
  if (!s.seqlens_kv.empty() && s.seqlens_kv.size() != s.seqlens_q.size())
    fail_input("seqlens_kv", "has ", s.seqlens_kv.size(), " entries but seqlens_q has ", s.seqlens_q.size());
  const Window w = mask_window(s);
  const ThdLayout l = layout(s);
  const int W = s.cp_size;
  for (int side = 0; side < 2; ++side) {
    const PackedSequences& p = side == 0 ? l.q : l.kv;
    const std::string name = side == 0 ? "padded_q" : "padded_kv";
    for (int b = 0; b < p.batch(); ++b)
      if (p.padded_length(b) % (2 * W) != 0)
        fail_input(name + "[" + std::to_string(b) + "]", "value ", p.padded_length(b), " is not a multiple of 2 * cp_size = ",
                   2 * W, " (dual-chunk CP split)");
  }
  // (-1, 0) is causal even under mask none (FlashAttention-3's normalisation): it needs self-attention as well.
  if (W > 1 && (s.causal || is_causal(w) || has_window(w))) {
    for (int b = 0; b < l.batch(); ++b)
      if (l.q.length(b) != l.kv.length(b))
        fail_input("seqlens_kv[" + std::to_string(b) + "]", "value ", l.kv.length(b), " differs from seqlens_q[", b,
                   "] = ", l.q.length(b), ": causal or windowed CP (cp_size = ", W, ") needs L_q == L_kv per sequence");
  }
  if (W > 1 && (s.comm == CommType::a2a || s.comm == CommType::a2a_p2p)) {
    const int a = s.comm == CommType::a2a ? W : a2a_size(s);
    const std::string who = s.comm == CommType::a2a ? "cp_size" : "a2a_size";
    if (s.comm == CommType::a2a_p2p) {
      if (a < 1) fail_input("a2a_size", "must be >= 1, got ", a);
      if (W % a != 0) fail_input("a2a_size", "value ", a, " does not divide cp_size = ", W);
    }
    if (s.heads_q % a != 0)
      fail_input("heads_q", "value ", s.heads_q, " is not divisible by ", who, " = ", a, " (", comm_name(s.comm),
                 " splits heads over the a2a group)");
    if (hkv % a != 0)
      fail_input("heads_kv", "value ", hkv, " is not divisible by ", who, " = ", a, " (", comm_name(s.comm),
                 " splits heads over the a2a group)");
  }
  if (W > 1 && s.comm != CommType::p2p) {
    if (l.q.total_rows != l.q.cu_seqlens_padded.back())
      fail_input("total_tokens_q", "value ", l.q.total_rows, " leaves tail rows past the last sequence (",
                 l.q.cu_seqlens_padded.back(), "); only comm p2p supports tail rows under CP");
    if (l.kv.total_rows != l.kv.cu_seqlens_padded.back())
      fail_input("total_tokens_kv", "value ", l.kv.total_rows, " leaves tail rows past the last sequence (",
                 l.kv.cu_seqlens_padded.back(), "); only comm p2p supports tail rows under CP");
  }
  for (int side = 0; side < 2; ++side) {
    const PackedSequences& p = side == 0 ? l.q : l.kv;
    const int64_t tail = p.total_rows - p.cu_seqlens_padded.back();
    if (tail % W != 0)
      fail_input(side == 0 ? "total_tokens_q" : "total_tokens_kv", "value ", p.total_rows, " leaves ", tail,
                 " tail rows, not a multiple of cp_size = ", W);
  }
}

CaseSpec parse_case(const json& object) {
  if (!object.is_object()) fail_input("case", "must be a JSON object, got ", show(object));
  const auto& keys = case_keys();
  for (auto it = object.begin(); it != object.end(); ++it)
    if (std::find(keys.begin(), keys.end(), it.key()) == keys.end())
      fail_input(excerpt(it.key(), 64), "unknown case key (value ", show(it.value()), "); known keys: seqlens_q, seqlens_kv, padded_q, "
                 "padded_kv, total_tokens_q, total_tokens_kv, heads_q, heads_kv, dim_qk, dim_v, dtype, mask, window, "
                 "cp_size, comm, a2a_size, seed, pad_fill, softmax_scale");
  CaseSpec s;
  if (!object.contains("seqlens_q")) fail_input("seqlens_q", "is required");
  s.seqlens_q = get_lengths(object["seqlens_q"], "seqlens_q");
  if (s.seqlens_q.empty()) fail_input("seqlens_q", "must list at least one sequence, got []");
  if (object.contains("seqlens_kv")) s.seqlens_kv = get_lengths(object["seqlens_kv"], "seqlens_kv");
  if (object.contains("padded_q")) s.padded_q = get_lengths(object["padded_q"], "padded_q");
  if (object.contains("padded_kv")) s.padded_kv = get_lengths(object["padded_kv"], "padded_kv");
  if (object.contains("total_tokens_q")) s.total_tokens_q = get_int(object["total_tokens_q"], "total_tokens_q", 0, INT32_MAX);
  if (object.contains("total_tokens_kv")) s.total_tokens_kv = get_int(object["total_tokens_kv"], "total_tokens_kv", 0, INT32_MAX);
  if (object.contains("heads_q")) s.heads_q = static_cast<int>(get_int(object["heads_q"], "heads_q", 1, 1 << 16));
  if (object.contains("heads_kv")) s.heads_kv = static_cast<int>(get_int(object["heads_kv"], "heads_kv", 1, 1 << 16));
  if (object.contains("dim_qk")) s.dim_qk = static_cast<int>(get_int(object["dim_qk"], "dim_qk", 1, 1 << 16));
  if (object.contains("dim_v")) s.dim_v = static_cast<int>(get_int(object["dim_v"], "dim_v", 1, 1 << 16));
  if (object.contains("dtype")) s.dtype = parse_dtype(get_string(object["dtype"], "dtype"), "dtype");
  if (object.contains("mask")) {
    const std::string m = get_string(object["mask"], "mask");
    if (m == "causal") s.causal = true;
    else if (m == "none") s.causal = false;
    else fail_input("mask", "value \"", m, "\" is not one of none, causal");
  }
  if (object.contains("window")) {
    const json& w = object["window"];
    if (!w.is_array() || w.size() != 2) fail_input("window", "must be [wl, wr], got ", show(w));
    s.window.left = static_cast<int32_t>(get_int(w[0], "window[0]", -1, INT32_MAX));
    s.window.right = static_cast<int32_t>(get_int(w[1], "window[1]", -1, INT32_MAX));
  }
  s.window = normalize_window(s.causal, s.window);
  // FlashAttention-3's normalisation: the window (-1, 0) is causal, so the stored form says mask "causal" and every
  // layer (TE metadata, sections) sees one spelling of it.
  if (is_causal(s.window)) s.causal = true;
  if (object.contains("cp_size")) {
    const json& w = object["cp_size"];
    if (w.is_number_integer() && !w.is_number_unsigned() && w.get<int64_t>() < 1)
      fail_input("cp_size", "must be >= 1, got ", show(w));
    s.cp_size = static_cast<int>(get_int(w, "cp_size", 1, kMaxCpSize,
                                         " (the supported maximum: a plan has W x W tiles per pass; docs/case-spec.md)"));
  }
  if (object.contains("comm")) s.comm = parse_comm(get_string(object["comm"], "comm"));
  if (object.contains("a2a_size")) {
    s.a2a_size = static_cast<int>(get_int(object["a2a_size"], "a2a_size", 1, kMaxCpSize, " (ranks of an a2a group)"));
    // The normalised form stores a2a_size for every comm type (1 for p2p and all_gather, cp_size for a2a): any other
    // value there would be ignored, so it is refused.
    const int implied = s.comm == CommType::a2a ? s.cp_size : 1;
    if (s.comm != CommType::a2a_p2p && s.a2a_size != implied)
      fail_input("a2a_size", "value ", s.a2a_size, " does not apply to comm ", comm_name(s.comm), " (it is ", implied,
                 " there; a2a_size chooses the a2a groups of comm a2a+p2p)");
  }
  if (object.contains("seed")) {
    // Stored as an int64 attribute: the range ends at INT64_MAX.
    s.seed = static_cast<uint64_t>(get_int(object["seed"], "seed", 0, INT64_MAX));
  }
  if (object.contains("pad_fill")) s.pad_fill = parse_pad_fill(get_string(object["pad_fill"], "pad_fill"));
  if (object.contains("softmax_scale")) {
    const json& v = object["softmax_scale"];
    if (!v.is_number()) fail_input("softmax_scale", "must be a number, got ", show(v));
    const double scale = v.get<double>();
    if (!(scale >= kMinSoftmaxScale && scale <= kMaxSoftmaxScale))
      fail_input("softmax_scale", "value ", show(v), " outside the supported range [", kMinSoftmaxScale, ", ",
                 kMaxSoftmaxScale, "] (docs/case-spec.md: past it the float32 rounding of the scores outgrows the "
                 "fixture's error budget)");
    s.softmax_scale = scale;
  }
  validate_case(s);
  return s;
}

CaseSpec parse_case_text(std::string_view text) { return parse_case(parse_json(text, "case")); }

nlohmann::ordered_json case_to_json(const CaseSpec& s) {
  const ThdLayout l = layout(s);
  const Window w = mask_window(s);
  nlohmann::ordered_json j;
  j["seqlens_q"] = lengths_json(s.seqlens_q);
  j["seqlens_kv"] = lengths_json(seqlens_kv(s));
  j["padded_q"] = lengths_json(padded_q(s));
  j["padded_kv"] = lengths_json(padded_kv(s));
  j["total_tokens_q"] = l.q.total_rows;
  j["total_tokens_kv"] = l.kv.total_rows;
  j["heads_q"] = s.heads_q;
  j["heads_kv"] = heads_kv(s);
  j["dim_qk"] = s.dim_qk;
  j["dim_v"] = dim_v(s);
  j["dtype"] = std::string(dtype_name(s.dtype));
  j["mask"] = s.causal ? "causal" : "none";
  j["window"] = {w.left, w.right};
  j["cp_size"] = s.cp_size;
  j["comm"] = std::string(comm_name(s.comm));
  j["a2a_size"] = s.comm == CommType::a2a_p2p ? a2a_size(s) : (s.comm == CommType::a2a ? s.cp_size : 1);
  j["seed"] = s.seed;
  j["pad_fill"] = std::string(pad_fill_name(s.pad_fill));
  j["softmax_scale"] = softmax_scale(s);
  return j;
}

std::string normalized_json(const CaseSpec& spec) { return case_to_json(spec).dump(); }

int kernel_passes(bool trace) { return 3 * (trace ? 4 : 3); }

namespace {
// Score-tile elements of one pass over a case: sum over sequences and query heads of the (q, k) pairs inside the
// mask (causal, window), counted row by row: O(total tokens).
double case_pairs(const CaseSpec& spec) {
  const std::vector<int32_t> kv = seqlens_kv(spec);
  const Window w = mask_window(spec);
  double pairs = 0;
  for (size_t b = 0; b < spec.seqlens_q.size(); ++b) {
    const int64_t lq = spec.seqlens_q[b], lk = kv[b], delta = lk - lq;
    if (w.left < 0 && w.right < 0) {
      pairs += double(lq) * double(lk);
      continue;
    }
    for (int64_t i = 0; i < lq; ++i) {
      const int64_t lo = w.left >= 0 ? std::max<int64_t>(0, i + delta - w.left) : 0;
      const int64_t hi = w.right >= 0 ? std::min<int64_t>(lk - 1, i + delta + w.right) : lk - 1;
      if (hi >= lo) pairs += double(hi - lo + 1);
    }
  }
  return pairs * spec.heads_q;
}

// Calibration (lab/records/perf.md, "gen estimates: the time model"), CPU time per thread on the 2-core x86-64-v3 box:
// - the kernels, per score element (visible (q, k) pair x query head) of one run of the three passes (forward, dQ,
//   dK/dV): a part that does not depend on the head dims (exp, masks, rounding, the tile's row bookkeeping) and one per
//   unit of d_qk + d_v (the products); float64 runs (the oracle, the traced CP oracle) and runs in the dtype (the
//   non-CP peer, the CP peer) apart. Fitted on one sequence of 2048..16384 tokens, d 1, 8, 64, 128 (bench_gen): the
//   fixed part is what made the estimate 36-39x low at d = 1 (it was 0);
// - the CP simulator: the peer's rate x 1.1 (its W ranks' copies, merges and smaller tiles; W = 8 measured 1.0-1.1);
// - per output element (oracle and peer of O, LSE, dQ, dK, dV) the budgets (each peer globally and per rank), the
//   gathers and copies; per input element the inputs drawn from the seed and their digest;
// - 28 MB/s of payload per thread through the chunk filters (shuffle + deflate(1) + Fletcher32), HDF5 and the
//   read-back of the written file by the reader's rules (45 MB/s before the read-back existed);
// - per step group 0.7 ms and 0.6 us per sequence (the Plan's tile, four datasets and ~20 attributes, written by one
//   thread); 0.05 s for the process, the Plan and the files.
// Memory: a Plan 80 bytes per tile and sequence, 160 more for a sequence with rows (its row segments); the step
// partials of a traced run 8 bytes of memory per stored byte.
constexpr double kOracleNsPerElement = 16.4, kOracleNsPerElementDim = 0.364;
constexpr double kPeerNsPerElement = 7.2, kPeerNsPerElementDim = 0.171;
constexpr double kSimulatorFactor = 1.1;
constexpr double kNsPerOutputElement = 80, kNsPerInputElement = 20;
constexpr double kBytesPerSecondPerThread = 28e6;
constexpr double kStepGroupSeconds = 0.7e-3, kStepSequenceSeconds = 0.6e-6, kFixedSeconds = 0.05;
constexpr double kPlanBytesPerSequence = 80, kPlanBytesPerRows = 160, kPlanBytesPerTile = 2048;
constexpr double kTraceMemoryPerByte = 8;

// CPU seconds (one thread) of the kernels of a gen run over `pairs` score elements per pass.
double kernel_cpu_seconds(double pairs, double dims, bool trace) {
  const double oracle = kOracleNsPerElement + kOracleNsPerElementDim * dims;
  const double peer = kPeerNsPerElement + kPeerNsPerElementDim * dims;
  return 1e-9 * pairs * (oracle + peer + kSimulatorFactor * peer + (trace ? kSimulatorFactor * oracle : 0));
}
}  // namespace

CaseCost case_cost(const CaseSpec& spec, bool trace, int threads) {
  CaseCost cost;
  const double thread_count = threads > 0 ? threads : std::max(1, omp_get_max_threads());
  const ThdLayout l = layout(spec);
  const double W = spec.cp_size, B = static_cast<double>(spec.seqlens_q.size());
  const double tq = double(l.q.total_rows), tkv = double(l.kv.total_rows);
  const double hq = spec.heads_q, hkv = heads_kv(spec), dqk = spec.dim_qk, dv = dim_v(spec);
  const double in = dtype_bytes(spec.dtype);
  // Uncompressed bytes: inputs, goldens + peer, per-rank copies of both.
  const double inputs = (tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv)) * in;
  const double outputs = tq * hq * (dv + dqk + 1) + tkv * hkv * (dqk + dv);
  cost.tensor_bytes = 2 * inputs + outputs * (4 + in) + outputs * 4;
  // Tiles per pass and what one tile reads (rows and heads), per comm type (sim/plan/plan.cpp).
  double q_rows = tq / W, kv_rows = tkv / W, heads = hq, kv_heads = hkv;
  switch (spec.comm) {
    case CommType::p2p: cost.tiles = spec.cp_size * int64_t{spec.cp_size}; break;
    case CommType::a2a:
      cost.tiles = spec.cp_size;
      q_rows = tq, kv_rows = tkv, heads = hq / W, kv_heads = hkv / W;
      break;
    case CommType::all_gather:
      cost.tiles = 2 * int64_t{spec.cp_size};
      kv_rows = tkv;
      break;
    case CommType::a2a_p2p: {
      const double a = spec.cp_size == 1 ? 1 : std::max(1, a2a_size(spec)), p = std::max(1.0, W / a);
      cost.tiles = spec.cp_size * static_cast<int64_t>(p);
      q_rows = tq / p, kv_rows = tkv / p, heads = hq / a, kv_heads = hkv / a;
      break;
    }
  }
  cost.step_groups = 2 * cost.tiles;
  cost.pairs = case_pairs(spec);
  if (trace)
    cost.trace_bytes = double(cost.tiles) * 4 * (q_rows * heads * (dv + 1 + dqk) + kv_rows * kv_heads * (dqk + dv));
  double with_rows = 0;
  const std::vector<int32_t> kv = seqlens_kv(spec);
  for (size_t b = 0; b < spec.seqlens_q.size(); ++b) with_rows += spec.seqlens_q[b] > 0 || kv[b] > 0;
  cost.plan_bytes = double(cost.step_groups) * (kPlanBytesPerSequence * B + kPlanBytesPerRows * with_rows + kPlanBytesPerTile);
  cost.datasets = 10 + 4 + 5 + 5 + 9 * int64_t{spec.cp_size} + 4 * cost.step_groups;
  const double inputs_float = (tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv)) * 4;
  const double oracle_float64 = (tq * hq * (dv + dqk + 1) + tkv * hkv * (dqk + dv)) * 8;
  cost.memory_bytes = inputs_float + oracle_float64 + cost.plan_bytes + kTraceMemoryPerByte * cost.trace_bytes;
  const double input_elements = tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv);
  cost.seconds = (kernel_cpu_seconds(cost.pairs, dqk + dv, trace) + 1e-9 * kNsPerOutputElement * outputs +
                  1e-9 * kNsPerInputElement * input_elements) / thread_count +
                 (cost.tensor_bytes + cost.trace_bytes) / (kBytesPerSecondPerThread * thread_count) +
                 double(cost.step_groups) * (kStepGroupSeconds + kStepSequenceSeconds * B) + kFixedSeconds;
  return cost;
}

CaseCost shard_cost(const CaseCost& whole, const CaseSpec& spec, int kv_heads, bool trace, int threads) {
  CaseCost cost = whole;
  const double thread_count = threads > 0 ? threads : std::max(1, omp_get_max_threads());
  const ThdLayout l = layout(spec);
  const double tq = double(l.q.total_rows), tkv = double(l.kv.total_rows);
  const double hq = spec.heads_q, hkv = heads_kv(spec), dqk = spec.dim_qk, dv = dim_v(spec);
  const double f = double(kv_heads) / hkv;
  const double in = dtype_bytes(spec.dtype);
  const double inputs = (tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv)) * in;
  const double outputs = tq * hq * (dv + dqk + 1) + tkv * hkv * (dqk + dv);
  cost.pairs = whole.pairs * f;
  cost.tensor_bytes = f * (inputs + outputs * (4 + in));
  cost.trace_bytes = f * whole.trace_bytes;
  cost.datasets = 4 + 15 + 30 * (1 + int64_t{spec.cp_size});
  const double inputs_float = (tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv)) * 4;
  cost.memory_bytes = inputs_float * (1 + f) + f * outputs * 8 + cost.plan_bytes + kTraceMemoryPerByte * cost.trace_bytes;
  // The oracle and the peers compute the shard's heads; on a2a and a2a+p2p the simulator still moves every head (its
  // copies and merges stay, a share of its time the kernels' model leaves out: counted as 10% of the whole
  // simulator's on top); on p2p and all_gather it runs on the shard's heads alone.
  const double input_elements = tq * hq * (dqk + dv) + tkv * hkv * (dqk + dv);
  const bool moves_all = spec.comm == CommType::a2a || spec.comm == CommType::a2a_p2p;
  const double simulator_moves =
      moves_all ? 0.1 * 1e-9 * (kPeerNsPerElement + kPeerNsPerElementDim * (dqk + dv)) * whole.pairs * (1 - f) : 0.0;
  cost.seconds = (kernel_cpu_seconds(cost.pairs, dqk + dv, trace) + simulator_moves +
                  1e-9 * kNsPerOutputElement * f * outputs + 1e-9 * kNsPerInputElement * input_elements) / thread_count +
                 (cost.tensor_bytes + cost.trace_bytes) / (kBytesPerSecondPerThread * thread_count) + kFixedSeconds;
  return cost;
}

}  // namespace cpgold::sim
