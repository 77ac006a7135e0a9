#pragma once
// Before any collective, the ranks of a multi-GPU run agree on what they run: each rank's description of its case
// and layout (the fixture's case JSON, comm type, W, a2a size, backward mode, ...) is hashed and the hashes are
// compared across ranks. Ranks that were handed different fixtures or options would otherwise exchange buffers of
// different shapes and hang or produce garbage.
#include <string>

#include "gpu/comm/rank_channel.hpp"

namespace cpgold::gpu {

// description: everything that must match; label: what a person recognises the case by (the fixture path).
// Every rank throws InputError("case", ...) listing each rank's label and hash when they differ; RankFailure when a
// rank does not take part within `timeout`.
void agree_on_case(RankChannel& channel, const std::string& description, const std::string& label, Seconds timeout);

}  // namespace cpgold::gpu
