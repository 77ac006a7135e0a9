// check_exchanges: coded values through the NCCL exchanges of every comm type (see the header).
#include "gpu/verify/nccl_exchange_check.hpp"

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>

#include <cuda_runtime.h>

#include "gpu/comm/case_agreement.hpp"
#include "reference/input_error.hpp"
#include "reference/thd_layout.hpp"
#include "sim/plan/partition.hpp"

namespace cpgold::gpu {
namespace {

constexpr int kHeads = 4;   // divisible by every a2a size of W <= 4 and by 2
constexpr int kDim = 16;
// Valid lengths with a zero-length sequence and lengths that are not multiples of 2W; padded to multiples of 16
// (2W for W up to 8). About 6k rows, 3 MiB per rank-local tensor of 64-bit codes at W = 2.
const std::vector<int32_t> kLengths = {977, 0, 3200, 7, 2048};
const std::vector<int32_t> kPadded = {992, 0, 3200, 16, 2048};

using Code = uint64_t;

// (origin rank, global row, head, dim) in 8 / 24 / 8 / 16 bits.
Code encode(int origin, int64_t global_row, int head, int dim) {
  return (static_cast<Code>(origin) << 48) | (static_cast<Code>(global_row) << 24) | (static_cast<Code>(head) << 16) |
         static_cast<Code>(dim);
}
std::string decode_text(Code code) {
  std::ostringstream out;
  out << "(rank " << (code >> 48) << ", global row " << ((code >> 24) & 0xffffff) << ", head " << ((code >> 16) & 0xff)
      << ", dim " << (code & 0xffff) << ")";
  return out.str();
}

class Device {
 public:
  explicit Device(size_t bytes) {
    if (const cudaError_t e = cudaMalloc(&ptr_, bytes == 0 ? 16 : bytes); e != cudaSuccess)
      throw std::runtime_error(std::string("cudaMalloc(") + std::to_string(bytes) + ") failed: " + cudaGetErrorString(e));
  }
  ~Device() { cudaFree(ptr_); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}

template <class T>
void upload(const Device& dst, const std::vector<T>& src) {
  cuda_check(cudaMemcpy(dst.get(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
template <class T>
std::vector<T> download(const Device& src, size_t count) {
  std::vector<T> out(count);
  cuda_check(cudaMemcpy(out.data(), src.get(), count * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  return out;
}

// [rows, head_count, kDim] codes of `origin` for the global rows `rows`, heads [head_begin, head_begin + head_count).
std::vector<Code> coded_rows(int origin, const std::vector<int64_t>& rows, int head_begin, int head_count) {
  std::vector<Code> out;
  out.reserve(rows.size() * static_cast<size_t>(head_count * kDim));
  for (int64_t row : rows)
    for (int h = head_begin; h < head_begin + head_count; ++h)
      for (int d = 0; d < kDim; ++d) out.push_back(encode(origin, row, h, d));
  return out;
}

// Compares what arrived with what must be there; the first difference is described by row, head and dim.
ExchangeResult compare(const std::string& exchange, const std::vector<Code>& got, const std::vector<Code>& expected,
                       int head_count) {
  ExchangeResult result{exchange, static_cast<int64_t>(expected.size()), 0, ""};
  if (got.size() != expected.size()) {
    result.wrong = result.elements;
    result.first_wrong = "received " + std::to_string(got.size()) + " elements, expected " + std::to_string(expected.size());
    return result;
  }
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected[i]) {
      if (result.wrong == 0) {
        const size_t per_row = static_cast<size_t>(head_count * kDim);
        std::ostringstream where;
        where << "row " << i / per_row << " head " << i % per_row / kDim << " dim " << i % kDim << ": got "
              << decode_text(got[i]) << ", expected " << decode_text(expected[i]);
        result.first_wrong = where.str();
      }
      ++result.wrong;
    }
  return result;
}

sim::SidePartition side_partition(int ways) {
  const PackedSequences sequences = make_packed_sequences(kLengths, kPadded, -1, "q");
  return sim::SidePartition(sequences, ways, "q");
}

template <class T>
std::vector<T> concat(const std::vector<std::vector<T>>& parts) {
  std::vector<T> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// A ring over `ring` (ring index = ring.rank()): `buffers` tensors per step travel to ring index + 1, W - 1 steps.
// Tensor t of ring member p starts as coded rows of member p's shard (global rank `origin_of(p)`), heads
// [head_begin, +head_count); after step s, member p must hold member (p - s - 1)'s.
void check_ring(Communicator& ring, const sim::SidePartition& shards, int buffers, int head_begin, int head_count,
                const std::function<int(int)>& origin_of, const std::string& name, std::vector<ExchangeResult>& results) {
  const int n = ring.size(), me = ring.rank();
  if (n < 2) return;
  const size_t count = static_cast<size_t>(shards.local_rows() * head_count * kDim);
  std::vector<std::unique_ptr<Device>> current, next;
  for (int t = 0; t < buffers; ++t) {
    current.push_back(std::make_unique<Device>(count * sizeof(Code)));
    next.push_back(std::make_unique<Device>(count * sizeof(Code)));
    // Tensor t carries a different origin code (origin + 16 t) so that KV and dKV cannot be swapped unnoticed.
    upload(*current.back(), coded_rows(origin_of(me) + 16 * t, shards.gather_indices(me), head_begin, head_count));
  }
  for (int step = 0; step + 1 < n; ++step) {
    std::vector<SendTo> sends;
    std::vector<RecvFrom> receives;
    for (int t = 0; t < buffers; ++t) {
      sends.push_back({(me + 1) % n, current[static_cast<size_t>(t)]->get(), count * sizeof(Code)});
      receives.push_back({(me + n - 1) % n, next[static_cast<size_t>(t)]->get(), count * sizeof(Code)});
    }
    const std::string operation = name + " step " + std::to_string(step);
    ring.send_recv(sends, receives);
    ring.synchronize();
    std::swap(current, next);
    const int owner = ((me - step - 1) % n + n) % n;
    for (int t = 0; t < buffers; ++t)
      results.push_back(compare(operation + (buffers > 1 ? (t == 0 ? " kv" : " dkv") : ""),
                                download<Code>(*current[static_cast<size_t>(t)], count),
                                coded_rows(origin_of(owner) + 16 * t, shards.gather_indices(owner), head_begin, head_count),
                                head_count));
  }
}

// Head-scatter / sequence-gather inside `group` (group member j gets heads slice j of every member's rows) and the
// reverse. Member m's rows: `shards` index `shard_of(m)`, origin = shard_of(m).
void check_a2a(Communicator& group, const sim::SidePartition& shards, const std::function<int(int)>& shard_of,
               const std::string& name, std::vector<ExchangeResult>& results) {
  const int n = group.size(), me = group.rank(), slice = kHeads / n;
  const std::vector<int64_t> my_rows = shards.gather_indices(shard_of(me));
  const size_t block = my_rows.size() * static_cast<size_t>(slice * kDim);
  // Send block j: my rows, heads slice j (the pack a helper kernel does before the exchange).
  std::vector<std::vector<Code>> blocks;
  for (int j = 0; j < n; ++j) blocks.push_back(coded_rows(shard_of(me), my_rows, j * slice, slice));
  Device send(n * block * sizeof(Code)), gathered(n * block * sizeof(Code)), back(n * block * sizeof(Code));
  upload(send, concat(blocks));
  group.all_to_all(send.get(), gathered.get(), block * sizeof(Code));
  group.synchronize();
  // Block i must be member i's rows, my heads slice.
  std::vector<std::vector<Code>> expected;
  for (int i = 0; i < n; ++i) expected.push_back(coded_rows(shard_of(i), shards.gather_indices(shard_of(i)), me * slice, slice));
  results.push_back(compare(name + " head scatter", download<Code>(gathered, n * block), concat(expected), slice));
  // Reverse: block i goes back to member i, which must get its own rows with heads slice j in block j.
  group.all_to_all(gathered.get(), back.get(), block * sizeof(Code));
  group.synchronize();
  results.push_back(compare(name + " reverse", download<Code>(back, n * block), concat(blocks), slice));
}

void check_all_gather(Communicator& world, const sim::SidePartition& shards, std::vector<ExchangeResult>& results) {
  const int n = world.size(), me = world.rank();
  const size_t count = static_cast<size_t>(shards.local_rows() * kHeads * kDim);
  Device mine(count * sizeof(Code)), all(n * count * sizeof(Code));
  upload(mine, coded_rows(me, shards.gather_indices(me), 0, kHeads));
  world.all_gather(mine.get(), all.get(), count * sizeof(Code));
  world.synchronize();
  std::vector<std::vector<Code>> expected;
  for (int j = 0; j < n; ++j) expected.push_back(coded_rows(j, shards.gather_indices(j), 0, kHeads));
  results.push_back(compare("all_gather kv", download<Code>(all, n * count), concat(expected), kHeads));
}

// Reduce-scatter of float32 sums: every rank holds a full-sequence dK-like partial [W x local_rows, h, d] (block j:
// rank j's rows), element = (rank + 1) x small code (an integer below 2^24 / (W (W + 1) / 2), so sums are exact).
void check_reduce_scatter(Communicator& world, const sim::SidePartition& shards, std::vector<ExchangeResult>& results) {
  const int n = world.size(), me = world.rank();
  const size_t count = static_cast<size_t>(shards.local_rows() * kHeads * kDim);
  auto small_code = [](int64_t row, int h, int d) { return static_cast<float>((row * kHeads + h) * kDim + d); };
  std::vector<float> contribution;
  for (int j = 0; j < n; ++j)
    for (int64_t row : shards.gather_indices(j))
      for (int h = 0; h < kHeads; ++h)
        for (int d = 0; d < kDim; ++d) contribution.push_back(static_cast<float>(me + 1) * small_code(row, h, d));
  Device send(n * count * sizeof(float)), recv(count * sizeof(float));
  upload(send, contribution);
  world.reduce_scatter_sum(static_cast<const float*>(send.get()), static_cast<float*>(recv.get()), count);
  world.synchronize();
  const std::vector<float> got = download<float>(recv, count);
  const float ranks_sum = static_cast<float>(n * (n + 1) / 2);
  ExchangeResult result{"reduce_scatter dkv (float32 sum)", static_cast<int64_t>(count), 0, ""};
  size_t i = 0;
  for (int64_t row : shards.gather_indices(me))
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d, ++i) {
        const float expected = ranks_sum * small_code(row, h, d);
        if (std::memcmp(&got[i], &expected, sizeof(float)) != 0) {
          if (result.wrong == 0)
            result.first_wrong = "global row " + std::to_string(row) + " head " + std::to_string(h) + " dim " +
                                 std::to_string(d) + ": got " + std::to_string(got[i]) + ", expected " + std::to_string(expected);
          ++result.wrong;
        }
      }
  results.push_back(result);
}

}  // namespace

ExchangeFault parse_exchange_fault(const std::string& text) {
  ExchangeFault fault;
  if (text.empty()) return fault;
  const size_t colon = text.find(':');
  try {
    fault.rank = std::stoi(text.substr(0, colon));
  } catch (const std::exception&) {
    fail_input("--inject-failure", "expected RANK:KIND (KIND exception, cuda or input), got \"", text, "\"");
  }
  fault.kind = colon == std::string::npos ? "exception" : text.substr(colon + 1);
  if (fault.kind != "exception" && fault.kind != "cuda" && fault.kind != "input")
    fail_input("--inject-failure", "kind \"", fault.kind, "\": expected exception, cuda or input");
  return fault;
}

void inject_fault(const ExchangeFault& fault, int rank) {
  if (fault.rank != rank) return;
  if (fault.kind == "exception")
    throw std::runtime_error("injected failure (--inject-failure " + std::to_string(rank) + ":exception)");
  if (fault.kind == "input") fail_input("--inject-failure", "injected bad input on rank ", rank);
  if (fault.kind == "cuda") {
    // A real CUDA error: a copy from an address that is no device allocation.
    int host_value = 0;
    const cudaError_t e = cudaMemcpy(&host_value, reinterpret_cast<void*>(0x10), sizeof(int), cudaMemcpyDeviceToHost);
    throw std::runtime_error(std::string("injected CUDA failure: cudaMemcpy from an invalid device address returned ") +
                             cudaGetErrorString(e));
  }
  fail_input("--inject-failure", "kind \"", fault.kind, "\": expected exception, cuda or input");
}

std::string exchange_layout_description(int world_size, int a2a_size) {
  std::ostringstream out;
  out << "exchange check v1: W " << world_size << " a2a " << a2a_size << " heads " << kHeads << " dim " << kDim << " lengths";
  for (int32_t l : kLengths) out << " " << l;
  out << " padded";
  for (int32_t p : kPadded) out << " " << p;
  return out.str();
}

std::vector<ExchangeResult> check_exchanges(Communicator& world, int a2a_size, const ExchangeFault& fault) {
  const int n = world.size(), me = world.rank();
  std::vector<ExchangeResult> results;
  const sim::SidePartition shards = side_partition(n);
  auto identity = [](int r) { return r; };
  // p2p: the forward KV ring and the backward KV + dKV ring.
  check_ring(world, shards, 1, 0, kHeads, identity, "p2p kv ring", results);
  check_ring(world, shards, 2, 0, kHeads, identity, "p2p kv+dkv ring", results);
  inject_fault(fault, me);  // a failing rank stops here; the others are inside the all-gather below
  check_all_gather(world, shards, results);
  check_reduce_scatter(world, shards, results);
  if (kHeads % n == 0) check_a2a(world, shards, identity, "a2a", results);
  if (a2a_size > 1 && a2a_size < n && n % a2a_size == 0 && kHeads % a2a_size == 0) {
    // a2a groups of consecutive ranks; the p2p ring joins the ranks with the same position in their group.
    const int group = me / a2a_size, member = me % a2a_size, rings = n / a2a_size;
    CpGroups groups = split_cp_groups(world, a2a_size);
    check_a2a(*groups.a2a, shards, [&](int m) { return group * a2a_size + m; }, "a2a+p2p: a2a", results);
    // After the a2a the ring runs on the P-way shards with the group's heads slice.
    const sim::SidePartition ring_shards = side_partition(rings);
    const int slice = kHeads / a2a_size;
    check_ring(*groups.p2p, ring_shards, 2, member * slice, slice, [](int p) { return p; }, "a2a+p2p: kv+dkv ring", results);
  }
  return results;
}

ExchangeVerdict run_exchange_check(RankContext& context, const ExchangeCheckRun& run) {
  RankChannel& channel = context.channel;
  const int world = channel.size(), me = channel.rank();
  const int described_a2a = me == run.mismatch_rank ? run.a2a_size + 1 : run.a2a_size;
  agree_on_case(channel, exchange_layout_description(world, described_a2a),
                "nccl-check W=" + std::to_string(world) + " a2a_size=" + std::to_string(described_a2a), context.timeout);
  CommOptions options;
  options.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(context.timeout);
  std::unique_ptr<NcclCommunicator> comm = NcclCommunicator::create(channel, context.device, options);
  const std::vector<ExchangeResult> mine = check_exchanges(*comm, run.a2a_size, run.fault);
  const std::vector<std::string> all = channel.all_gather(serialise(mine), "verdict gather", context.timeout);
  ExchangeVerdict verdict;
  for (int r = 0; r < world; ++r)
    for (const ExchangeResult& result : deserialise(all[static_cast<size_t>(r)])) {
      verdict.elements += result.elements;
      verdict.wrong += result.wrong;
      ++verdict.exchanges;
      char line[640];
      std::snprintf(line, sizeof(line), "%-4d %-40s %10lld %8lld  %s\n", r, result.exchange.c_str(),
                    static_cast<long long>(result.elements), static_cast<long long>(result.wrong),
                    result.wrong ? result.first_wrong.c_str() : "ok");
      verdict.table += line;
    }
  return verdict;
}

std::string serialise(const std::vector<ExchangeResult>& results) {
  std::ostringstream out;
  for (const ExchangeResult& r : results) out << r.exchange << '\t' << r.elements << '\t' << r.wrong << '\t' << r.first_wrong << '\n';
  return out.str();
}

std::vector<ExchangeResult> deserialise(const std::string& bytes) {
  std::vector<ExchangeResult> out;
  std::istringstream in(bytes);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    ExchangeResult r;
    std::string elements, wrong;
    std::getline(fields, r.exchange, '\t');
    std::getline(fields, elements, '\t');
    std::getline(fields, wrong, '\t');
    std::getline(fields, r.first_wrong);
    r.elements = std::stoll(elements);
    r.wrong = std::stoll(wrong);
    out.push_back(r);
  }
  return out;
}

}  // namespace cpgold::gpu
