#pragma once
// Where the attention of a fixture is computed: the oracle (float64) and the peer (float32 accumulation, rounding to
// the dtype) of reference/attention.hpp behind one interface, so that the golden run (fixtures/golden/golden_run.hpp)
// and the CP simulator (sim/program/executor.hpp) take another implementation of the same arithmetic without knowing
// what runs it. The CPU reference (cpu_engine) is the reference of record and the default; another engine (the GPU
// engine, gpu/engine/) registers a factory under its name, and a command asks for it by that name.
// Contract of every engine: the results of reference/attention.hpp (shapes, rows outside the call's segments, -inf
// LSE of rows without a visible key, rounding points of the peer), the same bits on every rerun of the same call,
// and thread-safe calls (the CP simulator's ranks call it from their threads).
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "reference/attention.hpp"

namespace cpgold {

class AttentionEngine {
 public:
  virtual ~AttentionEngine() = default;
  // "cpu", "gpu": what a fixture records (fixtures/SCHEMA.md, "/case" attribute engine).
  virtual std::string name() const = 0;
  // The versions the results depend on, one line (device, driver, libraries); "" for the CPU reference, whose
  // fixtures record the generator and the instruction-set level instead.
  virtual std::string versions() const = 0;

  // Oracle (float64).
  virtual ForwardResult<double> forward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                        const Tensor3<double>& v, const KernelOptions& options) const = 0;
  virtual BackwardResult<double> backward(const AttentionCall& call, const Tensor3<double>& q,
                                          const Tensor3<double>& k, const Tensor3<double>& v,
                                          const Tensor3<double>& o, const LseTensor<double>& lse,
                                          const Tensor3<double>& dout, const KernelOptions& options) const = 0;
  // Peer (float32 accumulation, rounding to `dtype`).
  virtual ForwardResult<float> forward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                       const Tensor3<float>& v, DType dtype, const KernelOptions& options) const = 0;
  virtual BackwardResult<float> backward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                         const Tensor3<float>& v, const Tensor3<float>& o,
                                         const LseTensor<float>& lse, const Tensor3<float>& dout, DType dtype,
                                         const KernelOptions& options) const = 0;
};

// The CPU reference (reference/attention.hpp).
const AttentionEngine& cpu_engine();

// An engine by name, made on request (the factory may fail: no device). Factories register once per process, from
// the library that implements them (gpu/engine/register_engine.cpp); "cpu" is always there.
using EngineFactory = std::unique_ptr<AttentionEngine> (*)();
void register_engine(std::string_view name, EngineFactory factory);
// The registered factory, or nullptr when this program has no such engine (built without its layer).
EngineFactory find_engine(std::string_view name);
// Names of the registered engines, "cpu" first.
std::vector<std::string> engine_names();

// The engine a command names (`gen --engine`, Python's generate(engine=)): "cpu" (the reference, the default), "gpu"
// (InputError naming `field` when this program has no GPU engine or no device can be used: never a silent fallback),
// or "auto" (gpu where a device can be used, else cpu). `holder` keeps a made engine alive; `chosen` says which engine
// and why ("gpu (versions)", "cpu (auto: why)"), for the caller to show.
const AttentionEngine* choose_engine(const std::string& name, const std::string& field,
                                     std::unique_ptr<AttentionEngine>& holder, std::string& chosen);

}  // namespace cpgold
