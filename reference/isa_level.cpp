// Compiled for plain x86-64 whatever the build's level (reference/CMakeLists.txt), so that the check below runs on any
// x86-64 CPU. Its constructor has priority 101: it runs before the static initialisers of the program's own files,
// which are compiled for the build's level and may already use its instructions. The constructor's path uses only C
// library calls and this file's own plain functions: an inline C++ library function could be merged by the linker
// with a copy compiled for the build's level.
#include "reference/isa_level.hpp"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef CPGOLD_ISA_LEVEL
#error "CPGOLD_ISA_LEVEL must name the build's instruction-set level (reference/CMakeLists.txt)"
#endif

namespace cpgold {

const char* isa_level() { return CPGOLD_ISA_LEVEL; }

namespace {

// CPGOLD_TEST_CPU_LACKS (comma-separated feature names) pretends the CPU lacks them: the test of the error.
bool lacks_for_test(const char* name) {
  const char* list = ::getenv("CPGOLD_TEST_CPU_LACKS");
  if (!list) return false;
  const size_t n = ::strlen(name);
  for (const char* at = list; (at = ::strstr(at, name)) != nullptr; at += n)
    if ((at == list || at[-1] == ',') && (at[n] == '\0' || at[n] == ',')) return true;
  return false;
}

// Appends `text` to the buffer (always terminated, truncated at its end).
void append(char* out, size_t capacity, const char* text) {
  const size_t used = ::strlen(out);
  if (used + 1 >= capacity) return;
  ::strncat(out, text, capacity - used - 1);
}

// The features x86-64-v3 adds to plain x86-64, by the names /proc/cpuinfo uses, that this CPU lacks: comma-separated
// into `out` (empty when none). x86-64-v2: cx16, lahf_lm, popcnt, sse3, sse4_1, sse4_2, ssse3; v3: avx, avx2, bmi1,
// bmi2, f16c, fma, lzcnt (abm), movbe and the OS saving the AVX registers (__builtin_cpu_supports("avx") checks XCR0).
void missing_names(char* out, size_t capacity) {
  out[0] = '\0';
#if defined(__x86_64__) && defined(CPGOLD_ISA_CHECK_V3)
  __builtin_cpu_init();
  struct Feature {
    const char* name;
    int present;
  };
  const Feature features[] = {
      {"sse3", __builtin_cpu_supports("sse3")},     {"ssse3", __builtin_cpu_supports("ssse3")},
      {"sse4_1", __builtin_cpu_supports("sse4.1")}, {"sse4_2", __builtin_cpu_supports("sse4.2")},
      {"popcnt", __builtin_cpu_supports("popcnt")}, {"avx", __builtin_cpu_supports("avx")},
      {"avx2", __builtin_cpu_supports("avx2")},     {"fma", __builtin_cpu_supports("fma")},
      {"bmi1", __builtin_cpu_supports("bmi")},      {"bmi2", __builtin_cpu_supports("bmi2")},
      {"f16c", __builtin_cpu_supports("f16c")},     {"movbe", __builtin_cpu_supports("movbe")},
      {"lzcnt", __builtin_cpu_supports("abm")},
  };
  for (const Feature& f : features) {
    if (f.present && !lacks_for_test(f.name)) continue;
    if (out[0] != '\0') append(out, capacity, ", ");
    append(out, capacity, f.name);
  }
#else
  (void)capacity;
  (void)lacks_for_test;
#endif
}

// The whole message into `out` (empty when nothing is missing).
void problem_text(char* out, size_t capacity) {
  char names[256];
  missing_names(names, sizeof names);
  out[0] = '\0';
  if (names[0] == '\0') return;
  append(out, capacity, "cpgold: this build targets the instruction-set level ");
  append(out, capacity, CPGOLD_ISA_LEVEL);
  append(out, capacity, " (AVX2, FMA, BMI1/2, F16C, MOVBE, LZCNT) and this CPU lacks ");
  append(out, capacity, names);
  append(out, capacity,
         ". Build for this CPU with `cmake --preset default -DCPGOLD_ISA=x86-64` (SSE2 only, slower): fixtures "
         "generated there are bit-for-bit identical among builds of that level only (fixtures/SCHEMA.md, "
         "Determinism), and `cpgold check` works the same at every level.\n");
}

__attribute__((constructor(101))) void refuse_cpu_below_level() {
  char problem[1024];
  problem_text(problem, sizeof problem);
  if (problem[0] == '\0') return;
  const ssize_t written = ::write(STDERR_FILENO, problem, ::strlen(problem));
  (void)written;
  ::_exit(2);
}

}  // namespace

std::vector<std::string> isa_missing_features() {
  char names[256];
  missing_names(names, sizeof names);
  std::vector<std::string> out;
  for (const char* at = names; *at != '\0';) {
    const char* end = ::strstr(at, ", ");
    out.emplace_back(at, end ? static_cast<size_t>(end - at) : ::strlen(at));
    at = end ? end + 2 : at + ::strlen(at);
  }
  return out;
}

std::string isa_problem() {
  char problem[1024];
  problem_text(problem, sizeof problem);
  return problem;
}

}  // namespace cpgold
