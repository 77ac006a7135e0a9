#pragma once
// The visible-pairs audit of a TransformerEngine replay (sim/te/te_replay.hpp). For every replayed call, the (query,
// key) pairs the backend's kernel computes from the call's arguments (sim/te/te_kernel_mask.hpp), with every row of
// the call's tensors mapped to its sequence and global position, are compared with the true mask of the case
// (global positions, the case's normalised mask and window, docs/numerics.md): over one pass and one head group, every
// visible pair of valid tokens must be computed exactly once and nothing else. Each difference is attributed to a
// call: a pair that is not visible (or involves a pad row, a row of another sequence or a row holding no token) to
// the call that computes it; a visible pair computed twice to the call that is not the one whose shards hold it; a
// visible pair computed by none to the call whose shards hold its query and key. A finding is one call and one
// sequence: the count of wrong pairs and one query row with its expected and computed key sets. The audit
// describes TE; it never changes cpgold's Plan, fixtures or checks.
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sim/case/case_spec.hpp"
#include "sim/te/te_replay.hpp"

namespace cpgold::sim {

// Keys of one query row.
struct TeKeyRun {
  int sequence = -1;     // -1: rows of the call's K/V tensor that hold no token (then first/last are rows)
  int64_t first = 0;     // positions within the sequence (>= its length: pad rows)
  int64_t last = -1;
  bool operator==(const TeKeyRun&) const = default;
};
using TeKeySet = std::vector<TeKeyRun>;

struct TeFinding {
  PassKind pass = PassKind::forward;
  int call = 0;            // index in replay.calls(pass)
  int sequence = 0;        // the query's sequence (the call's sequence slot for rows holding no token)
  int64_t extra_pairs = 0;      // computed pairs that are not visible, or that involve pad or foreign rows
  int64_t missing_pairs = 0;    // visible pairs no call of the pass computes, whose query and key this call's shards hold
  int64_t duplicate_pairs = 0;  // visible pairs this call computes although another call computes them as well
  int64_t wrong_pairs() const { return extra_pairs + missing_pairs + duplicate_pairs; }
  std::string argument;    // a broken argument contract (a count above max_seqlen), else empty
  // One query row with wrong pairs: its row in the call's Q tensor (-1: the call does not compute it), its
  // sequence (-1: a row holding no token) and position, the keys the true mask gives it among the keys this call's
  // shards hold, and the keys the call computes for it.
  int64_t query_row = -1;
  int query_sequence = -1;
  int64_t query_position = 0;
  TeKeySet expected, computed;
  std::set<std::pair<int, int>> cells;  // (q chunk, k chunk) holding wrong pairs, in explain's SVG grid
};

struct TeAudit {
  TeBackend backend = TeBackend::fused;
  bool pad_between_seqs = true;
  bool refused = false;                // TE makes no call (replay.refusal): nothing to audit
  std::optional<TeNote> misread;       // TE reads rows at offsets that are not the layout's (replay.misread)
  bool exact = false;                  // not refused, not misread, and no finding
  int64_t wrong_pairs = 0;             // over all findings
  std::vector<TeFinding> findings;     // ordered by pass, call, sequence
  std::vector<int64_t> call_wrong_pairs[2];  // [pass][call]
};

TeAudit audit_te(const CaseSpec& spec, const TeReplay& replay);

// The true key set of query `position` of `sequence`: positions the case's mask allows (empty for pad positions).
TeKeySet te_true_keys(const CaseSpec& spec, int sequence, int64_t position);

// "0..3, 12 (pad), s1:0..1": positions of the query's sequence plain, of other sequences prefixed, pad rows marked.
std::string te_key_set_text(const TeKeySet& keys, const ThdLayout& layout, int query_sequence);

}  // namespace cpgold::sim
