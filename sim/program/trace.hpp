#pragma once
// What a CP run produces per rank and step: the forward partials O_i / LSE_i of every computed tile and the backward
// partials dQ_i, dK_i, dV_i, each in the row space of its tile's tensors (Tile::call.q_rows / kv_rows), plus the dKV
// a p2p ring rank holds after adding its contribution at that step (the partial sum in flight to the next rank).
// Filled by the CPU executor, stored by fixtures, compared step by step with GPU executors.
#include <cstddef>  // size_t, used by reference/tensor.hpp
#include <vector>

#include "reference/tensor.hpp"

namespace cpgold::sim {

template <class T>
struct ForwardStepTrace {
  int rank = 0, step = 0;
  Tensor3<T> o;      // [tile q_rows, tile heads, d_v]
  LseTensor<T> lse;  // [tile heads, tile q_rows]
};

template <class T>
struct BackwardStepTrace {
  int rank = 0, step = 0;
  Tensor3<T> dq;             // [tile q_rows, tile heads, d_qk]
  Tensor3<T> dk, dv;         // [tile kv_rows, tile kv heads, d]
  Tensor3<T> dk_in_flight;   // p2p / a2a+p2p ring: the dK buffer after this step's add ([kv shard rows, ...]); empty otherwise
  Tensor3<T> dv_in_flight;
};

template <class T>
struct Trace {
  std::vector<ForwardStepTrace<T>> forward;    // computed tiles only, in (step, rank) order
  std::vector<BackwardStepTrace<T>> backward;
};

}  // namespace cpgold::sim
