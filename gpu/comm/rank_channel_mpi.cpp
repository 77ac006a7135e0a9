// RankChannel over MPI_COMM_WORLD: one process per rank started by mpirun. Exchanges are non-blocking collectives
// polled against a deadline (a blocking MPI call could wait forever on a rank that failed); faults are small
// point-to-point messages with their own tag, probed in every wait. Without MPI in the build, the factory raises
// InputError and the other entry points say so.
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "gpu/comm/rank_channel.hpp"
#include "gpu/comm/rank_fault_order.hpp"
#include "reference/input_error.hpp"

#if CPGOLD_HAVE_MPI
// The C API only: OpenMPI's and MPICH's headers pull in the deprecated C++ bindings (a second library) otherwise.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace cpgold::gpu {

bool started_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_RANK") != nullptr;
}

#if CPGOLD_HAVE_MPI

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kFaultTag = 7301;

class MpiChannel final : public RankChannel {
 public:
  MpiChannel() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "mpi"; }

  std::vector<std::string> all_gather(const std::string& mine, const std::string& what, Seconds timeout) override {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
    int my_size = static_cast<int>(mine.size());
    std::vector<int> sizes(static_cast<size_t>(size_));
    MPI_Request request;
    MPI_Iallgather(&my_size, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD, &request);
    wait(request, what + " (sizes)", deadline, timeout);
    std::vector<int> offsets(static_cast<size_t>(size_), 0);
    for (int r = 1; r < size_; ++r) offsets[static_cast<size_t>(r)] = offsets[static_cast<size_t>(r - 1)] + sizes[static_cast<size_t>(r - 1)];
    std::string all(static_cast<size_t>(offsets.back() + sizes.back()), '\0');
    MPI_Iallgatherv(mine.data(), my_size, MPI_CHAR, all.data(), sizes.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD,
                    &request);
    wait(request, what, deadline, timeout);
    std::vector<std::string> out;
    for (int r = 0; r < size_; ++r) out.push_back(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]), static_cast<size_t>(sizes[static_cast<size_t>(r)])));
    return out;
  }

  void post_fault(const RankFault& fault) override {
    if (posted_) return;
    posted_ = true;
    // One message per peer; small enough for the eager protocol, so the sends complete without a matching receive.
    fault_bytes_ = std::to_string(fault.rank) + "\n" + fault.message.substr(0, 2000);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      MPI_Request request;
      MPI_Isend(fault_bytes_.data(), static_cast<int>(fault_bytes_.size()), MPI_CHAR, r, kFaultTag, MPI_COMM_WORLD, &request);
      MPI_Request_free(&request);
    }
  }

  std::optional<RankFault> poll_fault() override {
    for (;;) {
      int waiting = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, kFaultTag, MPI_COMM_WORLD, &waiting, &status);
      if (!waiting) break;
      int count = 0;
      MPI_Get_count(&status, MPI_CHAR, &count);
      std::string bytes(static_cast<size_t>(count), '\0');
      MPI_Recv(bytes.data(), count, MPI_CHAR, status.MPI_SOURCE, kFaultTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      const size_t newline = bytes.find('\n');
      RankFault fault;
      fault.rank = std::atoi(bytes.substr(0, newline).c_str());
      fault.message = newline == std::string::npos ? std::string() : bytes.substr(newline + 1);
      received_.emplace_back(status.MPI_SOURCE, fault);
    }
    return prefer_own_failures(received_, rank_);
  }

  std::vector<int> wait_for_all_faults(Seconds timeout) override {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
    for (;;) {
      poll_fault();
      std::vector<bool> heard(static_cast<size_t>(size_), false);
      heard[static_cast<size_t>(rank_)] = true;
      for (const auto& entry : received_) heard[static_cast<size_t>(entry.first)] = true;
      std::vector<int> silent;
      for (int r = 0; r < size_; ++r)
        if (!heard[static_cast<size_t>(r)]) silent.push_back(r);
      if (silent.empty() || Clock::now() > deadline) return silent;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  void wait(MPI_Request& request, const std::string& what, Clock::time_point deadline, Seconds timeout) {
    for (;;) {
      int done = 0;
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) return;
      throw_if_peer_failed(*this, what);
      if (Clock::now() > deadline)
        throw RankFailure(-1, "rank " + std::to_string(rank_) + ": " + what + " timed out after " +
                                  seconds_text(timeout) + " (MPI): a rank did not take part");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  int rank_ = 0, size_ = 1;
  bool posted_ = false;
  std::string fault_bytes_;  // kept alive for the freed sends
  std::vector<std::pair<int, RankFault>> received_;
};

}  // namespace

bool mpi_available() { return true; }

std::unique_ptr<RankChannel> make_mpi_channel() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  return std::make_unique<MpiChannel>();
}

void finalize_mpi() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (initialised && !finalised) MPI_Finalize();
}

void abort_mpi(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

#else

bool mpi_available() { return false; }
std::unique_ptr<RankChannel> make_mpi_channel() {
  fail_input("--launch", "mpi: this cpgold was built without MPI (install OpenMPI's development files and reconfigure)");
}
void finalize_mpi() {}
void abort_mpi(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

#endif

}  // namespace cpgold::gpu
