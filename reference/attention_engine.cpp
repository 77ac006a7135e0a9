#include "reference/attention_engine.hpp"

#include "reference/input_error.hpp"

#include <mutex>
#include <utility>

namespace cpgold {

namespace {

class CpuEngine final : public AttentionEngine {
 public:
  std::string name() const override { return "cpu"; }
  std::string versions() const override { return ""; }
  ForwardResult<double> forward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                const Tensor3<double>& v, const KernelOptions& options) const override {
    return attention_forward(call, q, k, v, options);
  }
  BackwardResult<double> backward(const AttentionCall& call, const Tensor3<double>& q, const Tensor3<double>& k,
                                  const Tensor3<double>& v, const Tensor3<double>& o, const LseTensor<double>& lse,
                                  const Tensor3<double>& dout, const KernelOptions& options) const override {
    return attention_backward(call, q, k, v, o, lse, dout, options);
  }
  ForwardResult<float> forward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                               const Tensor3<float>& v, DType dtype, const KernelOptions& options) const override {
    return attention_forward(call, q, k, v, dtype, options);
  }
  BackwardResult<float> backward(const AttentionCall& call, const Tensor3<float>& q, const Tensor3<float>& k,
                                 const Tensor3<float>& v, const Tensor3<float>& o, const LseTensor<float>& lse,
                                 const Tensor3<float>& dout, DType dtype, const KernelOptions& options) const override {
    return attention_backward(call, q, k, v, o, lse, dout, dtype, options);
  }
};

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<std::string, EngineFactory>> factories;
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

const AttentionEngine& cpu_engine() {
  static const CpuEngine engine;
  return engine;
}

void register_engine(std::string_view name, EngineFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& [n, f] : r.factories)
    if (n == name) {
      f = factory;
      return;
    }
  r.factories.emplace_back(std::string(name), factory);
}

EngineFactory find_engine(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [n, f] : r.factories)
    if (n == name) return f;
  return nullptr;
}

std::vector<std::string> engine_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names{"cpu"};
  for (const auto& [n, f] : r.factories)
    if (n != "cpu") names.push_back(n);
  return names;
}

const AttentionEngine* choose_engine(const std::string& name, const std::string& field,
                                     std::unique_ptr<AttentionEngine>& holder, std::string& chosen) {
  if (name == "cpu") {
    chosen = "cpu";
    return &cpu_engine();
  }
  if (name != "gpu" && name != "auto")
    fail_input(field, "value \"", name.size() > 40 ? name.substr(0, 40) + "..." : name, "\" is not cpu, gpu or auto");
  const EngineFactory factory = find_engine("gpu");
  std::string why;
  if (!factory) {
    why = "this cpgold is built without the GPU engine (a build with CUDA and cuBLAS found has it: cpgold on a machine "
          "with a GPU at configure time, or cpgold-gpu)";
    if (name == "gpu") fail_input(field, "gpu: ", why, "; the engine cpu computes the same fixture on the CPU");
  } else {
    try {
      holder = factory();
    } catch (const InputError& e) {
      if (name == "gpu") throw;
      why = e.what();
      const std::string prefix = e.field() + ": ";
      if (why.starts_with(prefix)) why = why.substr(prefix.size());
    }
  }
  if (holder) {
    chosen = "gpu" + std::string(name == "auto" ? " (auto: a CUDA device is there)" : "") + " (" + holder->versions() + ")";
    return holder.get();
  }
  chosen = "cpu (auto: " + why + ")";
  return &cpu_engine();
}

}  // namespace cpgold
