#include "reference/attention_engine.hpp"

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

}  // namespace cpgold
