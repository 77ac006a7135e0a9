// Compiled into every program that links cpgold_gpu (an INTERFACE source of that target, gpu/CMakeLists.txt): makes
// the GPU engine known by the name "gpu" before main (reference/attention_engine.hpp, register_engine).
#include "gpu/engine/gpu_attention_engine.hpp"

namespace {
const bool registered = [] {
  cpgold::register_engine("gpu", &cpgold::gpu_engine::make_gpu_engine);
  return true;
}();
}  // namespace
