#pragma once
// Clocks shared by the benchmark programs: wall time, process CPU time, and the load average to print beside them
// (the development machines are shared, so CPU time and load say how much a wall time can be trusted).
#include <sys/resource.h>

#include <chrono>
#include <fstream>
#include <string>

namespace cpgold::bench {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// User + system seconds of the process, all threads.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// "0.52 0.61 0.70" from /proc/loadavg (empty where it does not exist).
inline std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a.empty() ? std::string() : a + " " + b + " " + c;
}

}  // namespace cpgold::bench
