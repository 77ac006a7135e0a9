#pragma once
// A case: one JSON object whose keys are also the CLI flags (seqlens_q is --seqlens-q). docs/case-spec.md lists
// every key, its default and its validation. Extra keys are an error; missing keys take the defaults.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reference/dtype.hpp"
#include "reference/mask.hpp"
#include "reference/thd_layout.hpp"

namespace cpgold::sim {

enum class CommType { p2p, a2a, all_gather, a2a_p2p };
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
