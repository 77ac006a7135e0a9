#include "gpu/verify/fixture_verify.hpp"

#include <set>
#include <stdexcept>

#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "fixtures/storage/hdf5_writer.hpp"
#include "gpu/kernels/attention/host_attention.hpp"
#include "reference/attention_call.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::gpu {
namespace {

// Writes a global candidate file (fixtures candidate layout: /o, /lse [h, t], /dq, /dk, /dv as float32).
void write_candidate(const std::string& path, const HostForward& fwd, const HostBackward& bwd) {
  fx::h5::Writer writer(path);
  writer.attribute("/", "scope", std::string("global"));
  writer.attribute("/", "producer", std::string("cpgold verify (GPU non-CP path)"));
  write_candidate_outputs(writer, "", fwd.o, fwd.lse, bwd.dq, bwd.dk, bwd.dv);
  writer.close();
}

// One candidate file of a local CP run: per-rank outputs, gathered outputs (the CP budget decides) and step partials.
void write_cp_candidate(const std::string& path, const sim::Plan& plan, const sim::CpRun<float>& run) {
  fx::h5::Writer writer(path);
  writer.attribute("/", "scope", std::string("cp_gathered"));
  writer.attribute("/", "producer", std::string("cpgold verify --backend local (GPU CP, one device)"));
  auto put = [&](const std::string& name, const Tensor3<float>& x) {
    writer.dataset(name, {x.rows, x.heads, x.dim}, x.values.data(), fx::h5::Element::fp32);
  };
  auto put_lse = [&](const std::string& name, const LseTensor<float>& x) {
    writer.dataset(name, {x.heads, x.rows}, x.values.data(), fx::h5::Element::fp32);
  };
  const sim::GlobalOutputs<float> global = sim::gather_outputs(plan, run.ranks);
  write_candidate_outputs(writer, "", global.o, global.lse, global.dq, global.dk, global.dv);
  writer.group("/ranks");
  for (int r = 0; r < plan.cp_size; ++r) {
    const std::string g = fx::rank_group(r);
    const sim::RankOutputs<float>& x = run.ranks[static_cast<size_t>(r)];
    writer.group(g);
    write_candidate_outputs(writer, g, x.o, x.lse, x.dq, x.dk, x.dv);
  }
  std::set<std::string> groups;
  auto step_group = [&](int rank, int step, sim::PassKind pass) {
    const std::string steps = fx::rank_group(rank) + "/steps";
    const std::string s = steps + "/" + std::to_string(step);
    const std::string g = fx::step_group(rank, step, pass);
    for (const std::string& x : {steps, s, g})
      if (groups.insert(x).second) writer.group(x);
    return g;
  };
  for (const auto& t : run.trace.forward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::forward);
    put(g + "/o", t.o);
    put_lse(g + "/lse", t.lse);
  }
  for (const auto& t : run.trace.backward) {
    const std::string g = step_group(t.rank, t.step, sim::PassKind::backward);
    put(g + "/dq", t.dq);
    put(g + "/dk", t.dk);
    put(g + "/dv", t.dv);
  }
  writer.close();
}

Tensor3<float> read_input(const fx::h5::Reader& reader, const char* name) {
  const std::string dataset = std::string("/inputs/") + name;
  const fx::h5::DatasetInfo info = reader.info(dataset);
  if (info.dims.size() != 3)
    fail_input(reader.where(dataset), "expected a [t, h, d] tensor, found ", fx::h5::dims_text(info.dims));
  Tensor3<float> t(info.dims[0], info.dims[1], info.dims[2]);
  t.values = reader.read_float(dataset);
  return t;
}

}  // namespace

void write_candidate_outputs(fx::h5::Writer& writer, const std::string& group, const Tensor3<float>& o,
                             const LseTensor<float>& lse, const Tensor3<float>& dq, const Tensor3<float>& dk,
                             const Tensor3<float>& dv) {
  auto put = [&](const char* name, const Tensor3<float>& x) {
    writer.dataset(group + "/" + name, {x.rows, x.heads, x.dim}, x.values.data(), fx::h5::Element::fp32);
  };
  put("o", o);
  writer.dataset(group + "/lse", {lse.heads, lse.rows}, lse.values.data(), fx::h5::Element::fp32);
  put("dq", dq);
  put("dk", dk);
  put("dv", dv);
}

sim::CaseInputs read_fixture_inputs(const fx::h5::Reader& reader) {
  return {read_input(reader, "q"), read_input(reader, "k"), read_input(reader, "v"), read_input(reader, "dout")};
}

FixtureVerification verify_fixture_local(const std::string& fixture_path, BackwardMode mode,
                                         const std::string& candidate_path, std::optional<StepRef> inject) {
  const fx::h5::Reader reader(fixture_path);
  const fx::FixtureFile fixture = fx::open_fixture(reader, fx::OpenOptions{false});
  const sim::CaseInputs inputs = read_fixture_inputs(reader);
  FixtureVerification result;
  if (const Outcome cap = cp_capability(fixture.plan, fixture.spec.dtype, inputs); !cap.ok()) {
    result.unsupported_reason = std::string(status_name(cap.status)) + ": " + cap.message;
    return result;
  }
  if (inject && (inject->rank < 0 || inject->rank >= fixture.plan.cp_size || inject->step < 0 ||
                 inject->step >= fixture.plan.forward.steps))
    fail_input("--inject", "rank,step ", inject->rank, ",", inject->step, " outside W = ", fixture.plan.cp_size,
               ", ", fixture.plan.forward.steps, " forward steps of ", fixture_path);
  CpGpuOptions options;
  options.mode = mode;
  options.record_trace = fixture.traced;
  options.sum_in_backward = true;  // the faster schedule on one GPU (lab/records/perf.md); the same bits as without
  options.inject = inject;
  {
    AttentionShape shape;
    shape.dtype = fixture.spec.dtype;
    shape.heads_q = fixture.spec.heads_q;
    shape.heads_kv = sim::heads_kv(fixture.spec);
    shape.dim_qk = fixture.spec.dim_qk;
    shape.dim_v = sim::dim_v(fixture.spec);
    result.forward_kernel = forward_kernel_description(shape);
    result.backward_kernel = backward_kernel_description(shape);
  }
  const sim::CpRun<float> run = run_cp_local(fixture.plan, inputs, fixture.spec.dtype, options);
  write_cp_candidate(candidate_path, fixture.plan, run);
  result.report = fx::check(reader, fixture, {candidate_path});  // the version the inputs came from
  result.verdict = verdict_of(*result.report);
  return result;
}

FixtureVerification verify_fixture(const std::string& fixture_path, BackwardMode mode,
                                   const std::string& candidate_path) {
  const fx::h5::Reader reader(fixture_path);
  const fx::FixtureFile fixture = fx::open_fixture(reader, fx::OpenOptions{false});
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
  const sim::CaseInputs inputs = read_fixture_inputs(reader);
  const Tensor3<float>&q = inputs.q, &k = inputs.k, &v = inputs.v, &dout = inputs.dout;
  const AttentionCall call = non_cp_call(fixture.layout, sim::mask_window(spec), sim::softmax_scale(spec));
  HostForward fwd;
  HostBackward bwd;
  result.forward_kernel = forward_kernel_description(shape);
  result.backward_kernel = backward_kernel_description(shape);
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
  result.report = fx::check(reader, fixture, {candidate_path});  // the version the inputs came from
  result.verdict = verdict_of(*result.report);
  return result;
}

FixtureVerdict verdict_of(const fx::CheckReport& report) {
  return report.pass() ? FixtureVerdict::pass : report.undecided() ? FixtureVerdict::undecided : FixtureVerdict::fail;
}

void VerdictCounts::add(FixtureVerdict verdict) {
  switch (verdict) {
    case FixtureVerdict::pass: ++passed; break;
    case FixtureVerdict::fail: ++failed; break;
    case FixtureVerdict::undecided: ++undecided; break;
    case FixtureVerdict::unsupported: ++unsupported; break;
  }
}

std::string VerdictCounts::summary(size_t fixtures) const {
  return std::to_string(passed) + " passed, " + std::to_string(failed) + " failed, " +
         (undecided ? std::to_string(undecided) + " undecided (a fixture of another engine than the CPU reference), " : "") +
         std::to_string(unsupported) + " unsupported (of " + std::to_string(fixtures) + " fixtures";
}

int VerdictCounts::exit_code() const { return failed > 0 || unsupported > 0 ? 1 : undecided > 0 ? 5 : 0; }

}  // namespace cpgold::gpu
