// RankChannel over files in a shared folder: one process per rank under any launcher, across nodes where the folder
// is on a shared file system. Exchange n of rank r is the file "x<n>.r<r>", a fault posted by rank r is "fault.r<r>"
// (first line: the failing rank; then its message). Files are written under a temporary name and renamed, so a
// reader never sees half a message.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "gpu/comm/rank_channel.hpp"
#include "gpu/comm/rank_fault_order.hpp"
#include "reference/input_error.hpp"

namespace cpgold::gpu {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void write_atomically(const fs::path& path, const std::string& bytes) {
  const fs::path temporary = path.string() + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("rendezvous folder: cannot write " + temporary.string());
  }
  fs::rename(temporary, path);
}

std::optional<std::string> read_if_present(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

class FolderChannel final : public RankChannel {
 public:
  FolderChannel(fs::path folder, int rank, int size) : folder_(std::move(folder)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "folder"; }

  std::vector<std::string> all_gather(const std::string& mine, const std::string& what, Seconds timeout) override {
    const long number = next_exchange_++;
    auto file = [&](int r) {
      std::ostringstream name;
      name << "x" << number << ".r" << r;
      return folder_ / name.str();
    };
    write_atomically(file(rank_), mine);
    std::vector<std::optional<std::string>> slots(static_cast<size_t>(size_));
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
    for (;;) {
      bool complete = true;
      for (int r = 0; r < size_; ++r)
        if (!slots[static_cast<size_t>(r)]) {
          slots[static_cast<size_t>(r)] = read_if_present(file(r));
          complete = complete && slots[static_cast<size_t>(r)].has_value();
        }
      if (complete) break;
      throw_if_peer_failed(*this, what);
      if (Clock::now() > deadline) {
        std::ostringstream silent;
        int first_silent = -1;
        for (int r = 0; r < size_; ++r)
          if (!slots[static_cast<size_t>(r)]) {
            silent << (first_silent < 0 ? "" : ",") << r;
            if (first_silent < 0) first_silent = r;
          }
        throw RankFailure(first_silent, "rank " + std::to_string(rank_) + ": " + what + " timed out after " +
                                            seconds_text(timeout) + " waiting for rank(s) " + silent.str() +
                                            " (folder " + folder_.string() + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::vector<std::string> out;
    for (auto& s : slots) out.push_back(std::move(*s));
    return out;
  }

  void post_fault(const RankFault& fault) override {
    if (posted_) return;
    posted_ = true;
    write_atomically(fault_file(rank_), std::to_string(fault.rank) + "\n" + fault.message);
  }

  std::optional<RankFault> poll_fault() override {
    // A directory scan per call would dominate a tight NCCL wait loop: look at most every 5 ms.
    const auto now = Clock::now();
    if (now - last_scan_ < std::chrono::milliseconds(5)) return cached_;
    last_scan_ = now;
    std::vector<std::pair<int, RankFault>> posted;
    for (int r = 0; r < size_; ++r)
      if (r != rank_)
        if (const std::optional<std::string> bytes = read_if_present(fault_file(r))) posted.emplace_back(r, parse(*bytes));
    cached_ = prefer_own_failures(posted, rank_);
    return cached_;
  }

  std::vector<int> wait_for_all_faults(Seconds timeout) override {
    // Files stay after the process exits: nobody needs to be waited for.
    return {};
  }

 private:
  fs::path fault_file(int r) const { return folder_ / ("fault.r" + std::to_string(r)); }
  static RankFault parse(const std::string& bytes) {
    const size_t newline = bytes.find('\n');
    RankFault fault;
    try {
      fault.rank = std::stoi(bytes.substr(0, newline));
    } catch (const std::exception&) {
      fault.rank = -1;
    }
    fault.message = newline == std::string::npos ? std::string() : bytes.substr(newline + 1);
    return fault;
  }

  fs::path folder_;
  int rank_, size_;
  long next_exchange_ = 0;
  bool posted_ = false;
  Clock::time_point last_scan_{};
  std::optional<RankFault> cached_;
};

}  // namespace

std::unique_ptr<RankChannel> make_folder_channel(const std::string& folder, int rank, int size) {
  if (size < 1) fail_input("--world-size", "expected at least 1 rank, got ", size);
  if (rank < 0 || rank >= size) fail_input("--rank", "expected 0..", size - 1, ", got ", rank);
  if (folder.empty()) fail_input("--rendezvous", "a shared folder is needed to start ranks without MPI");
  std::error_code error;
  fs::create_directories(folder, error);
  if (!fs::is_directory(folder)) fail_input("--rendezvous", "\"", folder, "\" is not a folder that can be created");
  // A file of this rank from an earlier run would be read as this run's message.
  for (const char* stale : {"x0.r", "fault.r"})
    if (fs::exists(fs::path(folder) / (stale + std::to_string(rank))))
      fail_input("--rendezvous", "\"", folder, "\" holds files of an earlier run (", stale, rank,
                 "); give every run a new, empty folder");
  return std::make_unique<FolderChannel>(folder, rank, size);
}

}  // namespace cpgold::gpu
