#include "gpu/fixture_verify.hpp"

#include <stdexcept>

#include "fixtures/fixture_reader.hpp"
#include "fixtures/hdf5_file.hpp"
#include "gpu/host_attention.hpp"
#include "reference/attention_call.hpp"
#include "reference/input_error.hpp"
#include "sim/case_spec.hpp"

namespace cpgold::gpu {
namespace {

// Writes a global candidate file (fixtures candidate layout: /o, /lse [h, t], /dq, /dk, /dv as float32).
void write_candidate(const std::string& path, const HostForward& fwd, const HostBackward& bwd) {
  fx::h5::Writer writer(path);
  writer.attribute("/", "scope", std::string("global"));
  writer.attribute("/", "producer", std::string("cpgold verify (GPU non-CP path)"));
  auto put = [&](const char* name, const Tensor3<float>& x) {
    writer.dataset(std::string("/") + name, {x.rows, x.heads, x.dim}, x.values.data(), fx::h5::Element::fp32);
  };
  put("o", fwd.o);
  writer.dataset("/lse", {fwd.lse.heads, fwd.lse.rows}, fwd.lse.values.data(), fx::h5::Element::fp32);
  put("dq", bwd.dq);
  put("dk", bwd.dk);
  put("dv", bwd.dv);
  writer.close();
}

}  // namespace

FixtureVerification verify_fixture(const std::string& fixture_path, BackwardMode mode,
                                   const std::string& candidate_path) {
  const fx::h5::Reader reader(fixture_path);
  const fx::FixtureFile fixture = fx::open_fixture(reader, fx::OpenOptions{false});
  auto input = [&](const char* name) {
    const std::string dataset = std::string("/inputs/") + name;
    const fx::h5::DatasetInfo info = reader.info(dataset);
    if (info.dims.size() != 3)
      fail_input(reader.where(dataset), "expected a [t, h, d] tensor, found ", fx::h5::dims_text(info.dims));
    Tensor3<float> t(info.dims[0], info.dims[1], info.dims[2]);
    t.values = reader.read_float(dataset);
    return t;
  };
  const sim::CaseSpec& spec = fixture.spec;
  FixtureVerification result;
  AttentionShape shape;
  shape.dtype = spec.dtype;
  shape.heads_q = spec.heads_q;
  shape.heads_kv = sim::heads_kv(spec);
  shape.dim_qk = spec.dim_qk;
  shape.dim_v = sim::dim_v(spec);
  if (const Outcome cap = check_capability(shape); !cap.ok()) {
    result.unsupported_reason = std::string(status_name(cap.status)) + ": " + cap.message;
    return result;
  }
  const Tensor3<float> q = input("q"), k = input("k"), v = input("v"), dout = input("dout");
  const AttentionCall call = non_cp_call(fixture.layout, sim::mask_window(spec), sim::softmax_scale(spec));
  HostForward fwd;
  HostBackward bwd;
  Outcome run = forward_on_device(call, spec.dtype, q, k, v, fwd);
  if (run.ok()) run = backward_on_device(call, spec.dtype, q, k, v, fwd.o, fwd.lse, dout, mode, bwd);
  if (run.status == Status::unsupported) {
    result.unsupported_reason = run.message;
    return result;
  }
  if (!run.ok())
    throw std::runtime_error("GPU run on " + fixture_path + ": " + std::string(status_name(run.status)) + ": " +
                             run.message);
  write_candidate(candidate_path, fwd, bwd);
  result.report = fx::check(fixture_path, {candidate_path});
  result.verdict = result.report->pass() ? FixtureVerdict::pass : FixtureVerdict::fail;
  return result;
}

}  // namespace cpgold::gpu
