#pragma once
// The one CP orchestration: what ONE rank does (shard exchange, per-step attention, merge, reverse exchange) for every
// comm type, over a backend that supplies storage, the attention call and the exchange (the backend contract is
// sim/program/cp_program_types.hpp). The ring family (p2p, a2a, a2a+p2p) is sim/program/ring_program.hpp, all_gather
// sim/program/all_gather_program.hpp. The CPU simulator (sim/program/executor.cpp) and the GPU executor (gpu/cp/)
// instantiate it; every rank runs it on its own thread (run_rank_threads) or process.
#include <exception>
#include <thread>
#include <vector>

#include "sim/program/all_gather_program.hpp"
#include "sim/program/cp_program_types.hpp"
#include "sim/program/rendezvous.hpp"
#include "sim/program/ring_program.hpp"

namespace cpgold::sim {

template <class B>
RankResult<B> run_rank(const Plan& plan, B& b, bool with_backward) {
  if (plan.comm == CommType::all_gather) return run_all_gather_rank(plan, b, with_backward);
  return run_ring_rank(plan, b, with_backward);
}

// The trace of a run: concatenates per-rank records and orders them by (step, rank) (stable: each rank's records
// are in step order).
template <class Record>
std::vector<Record> by_step_then_rank(std::vector<std::vector<Record>>& per_rank) {
  std::vector<Record> all;
  for (auto& records : per_rank)
    for (auto& rec : records) all.push_back(std::move(rec));
  std::stable_sort(all.begin(), all.end(), [](const Record& a, const Record& b) { return a.step < b.step; });
  return all;
}

// Runs body(rank) for every rank on its own thread (W = 1: on the caller's). When a rank fails, abort() is called
// so that the others leave their exchanges at once; the error rethrown is the lowest rank's own fault (an abort
// caused by another rank's fault is reported only when nothing else is).
template <class Body, class Abort>
void run_rank_threads(int W, Body&& body, Abort&& abort) {
  if (W == 1) {
    body(0);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<size_t>(W));
  std::vector<int> secondary(static_cast<size_t>(W), 0);
  {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(W));
    for (int g = 0; g < W; ++g)
      threads.emplace_back([&, g] {
        try {
          body(g);
        } catch (const ExchangeError& e) {
          errors[static_cast<size_t>(g)] = std::current_exception();
          secondary[static_cast<size_t>(g)] = e.fault() == ExchangeFault::aborted;
          abort();
        } catch (...) {
          errors[static_cast<size_t>(g)] = std::current_exception();
          abort();
        }
      });
    for (std::thread& t : threads) t.join();
  }
  for (int g = 0; g < W; ++g)
    if (errors[static_cast<size_t>(g)] && !secondary[static_cast<size_t>(g)]) std::rethrow_exception(errors[static_cast<size_t>(g)]);
  for (int g = 0; g < W; ++g)
    if (errors[static_cast<size_t>(g)]) std::rethrow_exception(errors[static_cast<size_t>(g)]);
}

}  // namespace cpgold::sim
