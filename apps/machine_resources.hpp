#pragma once
// What this machine can give a command right now: memory available to this process (the smaller of the kernel's
// MemAvailable and the cgroup's limit minus its usage) and free disk space in a folder (statvfs, unprivileged bytes).
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace cpgold::app {

struct MachineResources {
  int64_t memory_available = std::numeric_limits<int64_t>::max();  // bytes
  std::string memory_source = "unknown";                            // where the number comes from
  int64_t disk_free = std::numeric_limits<int64_t>::max();          // bytes, in the folder asked for
};

namespace machine_detail {
// First number in a file ("max" or a missing file: -1).
inline int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return -1;
  }
}
}  // namespace machine_detail

inline MachineResources machine_resources(const std::string& folder) {
  MachineResources machine;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line))
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      int64_t kib = 0;
      if (fields >> kib) machine.memory_available = kib * 1024, machine.memory_source = "MemAvailable";
    }
  // cgroup v2, then v1: a limit below the machine's memory is what this process can really use.
  const int64_t limit_v2 = machine_detail::read_number("/sys/fs/cgroup/memory.max");
  const int64_t limit_v1 = machine_detail::read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  const int64_t limit = limit_v2 >= 0 ? limit_v2 : limit_v1;
  const int64_t usage = limit_v2 >= 0 ? machine_detail::read_number("/sys/fs/cgroup/memory.current")
                                      : machine_detail::read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  if (limit > 0 && usage >= 0 && limit - usage < machine.memory_available) {
    machine.memory_available = std::max<int64_t>(0, limit - usage);
    machine.memory_source = "cgroup memory limit minus usage";
  }
  struct statvfs disk {};
  if (::statvfs(folder.c_str(), &disk) == 0)
    machine.disk_free = static_cast<int64_t>(disk.f_bavail) * static_cast<int64_t>(disk.f_frsize);
  return machine;
}

}  // namespace cpgold::app
