#pragma once
// Progress of long kernel runs, reported without any I/O in the reference: the kernels add the score-tile elements
// they have computed (query rows x keys of each tile, per head) to a sink the caller supplies; the command line
// turns that count into a bar or periodic lines.
#include <cstdint>

namespace cpgold {

class ProgressSink {
 public:
  virtual ~ProgressSink() = default;
  // Called from OpenMP worker threads: must be thread-safe and cheap. Never changes a result.
  virtual void advance(int64_t score_elements) = 0;
};

}  // namespace cpgold
