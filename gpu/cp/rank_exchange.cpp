// RankExchange: one rank's exchanges on the communication stream (see the header).
#include "gpu/cp/rank_exchange.hpp"

namespace cpgold::gpu {

RankExchange::Pending RankExchange::start(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs) {
  Pending p;
  // A sent tensor the accumulation stream wrote last: the communication stream waits for that accumulation, not the
  // compute stream (the next step's attention runs meanwhile); finish hands it back.
  for (const Transfer& x : sends) {
    const auto& m = x.tensor ? x.tensor->mem : x.lse->mem;
    if (m && m->side_use)
      streams_.check(cudaStreamWaitEvent(streams_.comm(), m->side_use->event, 0),
                     "cudaStreamWaitEvent (accumulation sent)");
    else if (x.tensor)
      memory_.fill_pending_zeros(*x.tensor);
    p.in_flight.push_back(m);
  }
  for (const Transfer& x : recvs) {
    if (x.tensor) memory_.own(x.tensor->mem);
    if (x.tensor && x.tensor->mem) x.tensor->mem->pending_zero = false;
    p.in_flight.push_back(x.tensor ? x.tensor->mem : x.lse->mem);
  }
  streams_.check(cudaStreamWaitEvent(streams_.comm(), streams_.record(streams_.compute())->event, 0),
                 "cudaStreamWaitEvent (exchange start)");
  const EventRef begin = timing_.spans() ? streams_.record(streams_.comm()) : nullptr;
  double bytes = 0;  // for the phase table
  for (const Transfer& x : recvs) bytes += 2.0 * static_cast<double>(x.tensor ? x.tensor->bytes() : x.lse->bytes());
  timing_.timed_exchange(bytes, [&] { send_recv(sends, recvs); });
  p.done = streams_.record(streams_.comm());
  if (begin) timing_.exchange_span(begin, p.done);
  return p;
}

void RankExchange::finish(Pending& p) {
  const EventRef before = timing_.spans() ? streams_.record(streams_.compute()) : nullptr;
  streams_.check(cudaStreamWaitEvent(streams_.compute(), p.done->event, 0), "cudaStreamWaitEvent (exchange finish)");
  if (before) timing_.wait_span(before, streams_.record(streams_.compute()));
  for (const auto& m : p.in_flight)
    if (m) m->side_use.reset();
  p.in_flight.clear();
}

void RankExchange::send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs) {
  std::vector<SendTo> s;
  std::vector<RecvFrom> r;
  for (const Transfer& x : sends)
    s.push_back(x.tensor ? SendTo{x.peer, x.tensor->data(), x.tensor->bytes()}
                         : SendTo{x.peer, x.lse->data(), x.lse->bytes()});
  for (const Transfer& x : recvs)
    r.push_back(x.tensor ? RecvFrom{x.peer, x.tensor->data(), x.tensor->bytes()}
                         : RecvFrom{x.peer, x.lse->data(), x.lse->bytes()});
  comm_.send_recv(s, r);
}

}  // namespace cpgold::gpu
