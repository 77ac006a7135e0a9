// Heavier random sweeps (label `slow`): more layouts per comm type, W and mask, larger sequences.
#include <doctest/doctest.h>

#include "cp_check.hpp"

using namespace cpgold;
using namespace cpgold::sim;
using namespace cpgold::sim::testing;

TEST_CASE("random sweep: float64 CP vs non-CP reference and coverage") {
  TestRng rng{2026};
  for (CommType comm : {CommType::p2p, CommType::a2a, CommType::all_gather, CommType::a2a_p2p})
    for (int W : {1, 2, 3, 4, 8})
      for (int m = 0; m < 5; ++m)
        for (int rep = 0; rep < 4; ++rep) {
          if (comm == CommType::a2a_p2p && W % 2 != 0 && W != 1) continue;
          CaseSpec s;
          s.comm = comm;
          s.cp_size = W;
          s.causal = m == 0 || m == 2;
          const Window w = m == 2 ? Window{static_cast<int32_t>(rng.below(3 * W)), 0}
                           : m == 3 ? Window{static_cast<int32_t>(rng.below(3 * W)), static_cast<int32_t>(rng.below(3 * W))}
                           : m == 4 ? Window{-1, static_cast<int32_t>(rng.below(2 * W))}
                                    : Window{};
          s.window = normalize_window(s.causal, w);
          const int split = comm == CommType::a2a ? W : (comm == CommType::a2a_p2p ? std::min(W, 2) : 1);
          s.heads_kv = split;
          s.heads_q = split * (1 + rng.below(2));
          s.a2a_size = W >= 2 ? 2 : 1;
          s.dim_qk = 4 + 4 * rng.below(3);
          s.dim_v = 4 + 4 * rng.below(2);
          s.pad_fill = rng.below(2) ? PadFill::nan : PadFill::random;
          s.seed = rng.next();
          s.seqlens_q = random_lengths(rng, W, 1 + rng.below(5), 12 * W);
          if (!s.causal && m != 2 && m != 3 && m != 4 && rng.below(2)) s.seqlens_kv = random_lengths(rng, W, static_cast<int>(s.seqlens_q.size()), 12 * W);
          check_case(s);
        }
}
