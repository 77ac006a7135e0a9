#pragma once
// The instruction-set level a build targets, and the check that the CPU it runs on has it (fixtures/SCHEMA.md,
// "Determinism"). The level decides which instructions carry the arithmetic (AVX2 + FMA at x86-64-v3, SSE2 at
// x86-64), and so the bits of every float result: fixtures are byte-identical on any machine of the same level.
// Every program linking cpgold checks the CPU before anything else runs (a constructor in a file compiled for plain
// x86-64): on a CPU below the build's level it prints which features are missing and exits with code 2, instead of
// dying on an illegal instruction somewhere later.
#include <string>
#include <vector>

namespace cpgold {

// "x86-64-v3" (the default build), "x86-64" (SSE2 only), "native" (-march=native: the building host, outside the
// determinism scope), or the processor name on another architecture.
const char* isa_level();

// The features of the build's level this CPU lacks (lowercase names as in /proc/cpuinfo, "avx2", "fma", ...); empty
// when it has them all, and always for "native" and other architectures.
std::vector<std::string> isa_missing_features();

// The message printed on a CPU below the level (empty when nothing is missing).
std::string isa_problem();

}  // namespace cpgold
