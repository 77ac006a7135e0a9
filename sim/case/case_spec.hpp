#pragma once
// A case: one JSON object whose keys are also the CLI flags (seqlens_q is --seqlens-q). docs/case-spec.md lists
// every key, its default and its validation. Extra keys are an error; missing keys take the defaults.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "reference/dtype.hpp"
#include "reference/mask.hpp"
#include "reference/thd_layout.hpp"

namespace cpgold::sim {

enum class CommType { p2p, a2a, all_gather, a2a_p2p };

// The supported softmax_scale range, for flags and JSON alike. Above 64 the float32 rounding of the scores (which
// grows with scale x |q.k|) makes an independent CPU path fail the fixture's own mean budget on LSE (check --self);
// the default 1/sqrt(dim_qk) is far inside.
inline constexpr double kMinSoftmaxScale = 1e-6;
inline constexpr double kMaxSoftmaxScale = 64.0;
// The largest CP size. A plan holds W x W tiles per pass, each with per-sequence metadata; up to 128 ranks `explain`
// answers in well under a second for short layouts (256 took 18 s and JSON 1.7 GB), and real CP groups are smaller.
inline constexpr int kMaxCpSize = 128;
enum class PadFill { zero, random, nan, inf };

struct CaseSpec {
  std::vector<int32_t> seqlens_q;
  std::vector<int32_t> seqlens_kv;  // empty: = seqlens_q
  std::vector<int32_t> padded_q;    // empty: each length padded up to a multiple of 2 * cp_size
  std::vector<int32_t> padded_kv;   // empty: same rule on seqlens_kv
  int64_t total_tokens_q = -1;      // -1: sum of padded_q
  int64_t total_tokens_kv = -1;     // -1: sum of padded_kv
  int heads_q = 4;
  int heads_kv = -1;                // -1: = heads_q
  int dim_qk = 64;
  int dim_v = -1;                   // -1: = dim_qk
  DType dtype = DType::bf16;
  bool causal = false;              // "mask": "none" | "causal"
  Window window;                    // normalised on parse (causal forces right = 0)
  int cp_size = 1;
  CommType comm = CommType::p2p;
  int a2a_size = -1;                // a2a+p2p only; -1: 2
  uint64_t seed = 0;
  PadFill pad_fill = PadFill::random;
  std::optional<double> softmax_scale;  // default 1/sqrt(dim_qk)

  bool operator==(const CaseSpec&) const = default;
};

}  // namespace cpgold::sim

namespace cpgold::sim {

std::string_view comm_name(CommType comm);          // "p2p", "a2a", "all_gather", "a2a+p2p"
CommType parse_comm(std::string_view text);         // InputError naming "comm"
std::string_view pad_fill_name(PadFill fill);       // "zero", "random", "nan", "inf"
PadFill parse_pad_fill(std::string_view text);      // InputError naming "pad_fill"

// JSON as cpgold reads it (a case, a fixture's case_json, a manifest): at most kMaxJsonBytes of text, containers
// nested at most kMaxJsonDepth deep, no key twice in one object (JSON allows it, and a silent "last one wins" would
// hide a typo). InputError naming `field` otherwise, with an excerpt of the text, never all of it.
inline constexpr size_t kMaxJsonBytes = size_t{64} << 20;
inline constexpr int kMaxJsonDepth = 32;
nlohmann::json parse_json(std::string_view text, const std::string& field);
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& field);
// At most `max_bytes` of `text` for a message: "{\"seqlens_q\":[[[[... (999,987 more bytes)".
std::string excerpt(std::string_view text, size_t max_bytes = 160);

// Parses a case object. Unknown keys, wrong types and bad values are InputErrors naming the key and the value.
// The result is validated (validate_case) and its window normalised.
CaseSpec parse_case(const nlohmann::json& object);
CaseSpec parse_case_text(std::string_view json_text);  // parse_json, then parse_case

// Every key with its default filled in, in the documented order (docs/case-spec.md). Fixtures store this.
nlohmann::ordered_json case_to_json(const CaseSpec& spec);
std::string normalized_json(const CaseSpec& spec);  // case_to_json(spec).dump() on one line

// Checks the case as a whole (layout, heads, dims, CP constraints: padded lengths multiples of 2W, W >= 1,
// heads divisible for a2a / a2a+p2p, L_q == L_kv per sequence for causal or windowed CP). InputError otherwise.
void validate_case(const CaseSpec& spec);

// Resolved values (defaults applied).
std::vector<int32_t> seqlens_kv(const CaseSpec& spec);
std::vector<int32_t> padded_q(const CaseSpec& spec);
std::vector<int32_t> padded_kv(const CaseSpec& spec);
int heads_kv(const CaseSpec& spec);
int dim_v(const CaseSpec& spec);
int a2a_size(const CaseSpec& spec);
double softmax_scale(const CaseSpec& spec);
Window mask_window(const CaseSpec& spec);  // normalised (causal -> right = 0); (-1,-1) for mask none
ThdLayout layout(const CaseSpec& spec);    // validated global THD layout

// What a case costs, before anything is built (lab/records/perf.md, "gen estimates"): gen checks memory against it before any
// Plan is built (its disk bound, fx::fixture_size_bound, and its peak memory, fx::generate_memory, need the Plan),
// and the fixture reader refuses a fixture whose case would not fit in memory before it builds the case's Plan. The
// time is for an idle machine, from rates per thread measured on a 2-core x86-64-v3 box (HDF5 1.10).
struct CaseCost {
  int64_t tiles = 0;               // tiles of one pass: W^2 (p2p), W (a2a), 2W (all_gather), W^2 / a2a_size (a2a+p2p)
  int64_t step_groups = 0;         // forward and backward step groups of a fixture (2 x tiles)
  int64_t datasets = 0;            // datasets every fixture of the case holds (step partials not counted)
  double pairs = 0;                // score-tile elements of one pass: visible (q, k) pairs x heads_q
  double tensor_bytes = 0;         // uncompressed inputs, goldens, peer and rank shards
  double trace_bytes = 0;          // uncompressed step partials (with trace; an upper bound)
  double plan_bytes = 0;           // memory of the Plan: per tile, metadata per sequence
  double memory_bytes = 0;         // what gen certainly holds: the inputs (float), the float64 oracle, the Plan and
                                   // the step partials (a lower bound; fx::generate_memory gives the peak from the Plan)
  double seconds = 0;              // gen on an idle machine with `threads` threads (rates per thread measured on one)
};
// threads: the OpenMP threads gen runs with (0: omp_get_max_threads()).
CaseCost case_cost(const CaseSpec& spec, bool trace, int threads = 0);
// The cost of one shard of a case (`gen --shard`) computing `kv_heads` of its KV heads (and their query heads): its
// share of the kernels' work and of the data (a part holds its heads' inputs, oracle and peers; no rank shards), the
// whole inputs in memory (the CP simulator reads every head), and the simulator's per-tile work, which does not shrink.
CaseCost shard_cost(const CaseCost& whole, const CaseSpec& spec, int kv_heads, bool trace, int threads = 0);
// Runs over the tiles: forward, dQ and dK/dV passes of the oracle, the non-CP peer and the CP peer; with trace also
// of the float64 CP oracle.
int kernel_passes(bool trace);
// Every dataset takes at least this many bytes of a file (its object header and the link to it): a file smaller
// than datasets x this cannot hold the fixture its case_json describes.
inline constexpr double kMinBytesPerDataset = 64;

// Each length rounded up to a multiple of 2 * cp_size (the CP padding rule); InputError if cp_size < 1.
std::vector<int32_t> pad_lengths_for_cp(const std::vector<int32_t>& lengths, int cp_size);

}  // namespace cpgold::sim
