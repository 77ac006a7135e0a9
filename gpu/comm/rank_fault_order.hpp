#pragma once
// Which of the faults posted so far a rank reports: a poster's own failure (fault.rank == poster) before re-posts
// of it, never the rank's own posts. Shared by the RankChannel transports.
#include <optional>
#include <utility>
#include <vector>

#include "gpu/comm/rank_channel.hpp"

namespace cpgold::gpu {

// posted: (posting rank, fault) in arrival order; self: the asking rank.
inline std::optional<RankFault> prefer_own_failures(const std::vector<std::pair<int, RankFault>>& posted, int self) {
  std::optional<RankFault> repost;
  for (const auto& [poster, fault] : posted) {
    if (poster == self) continue;
    if (fault.rank == poster) return fault;
    if (!repost && fault.rank != self) repost = fault;
  }
  return repost;
}

}  // namespace cpgold::gpu
