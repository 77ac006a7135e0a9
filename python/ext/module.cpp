// cpgold._core: cpgold's C++ core inside Python. Case parsing and validation, suites, `explain`, fixture generation
// (to a file or to the bytes of an HDF5 file in memory), fixture validation and the check engine, on files or on
// arrays, without a subprocess and without writing a candidate. Every function here calls the code the `cpgold`
// command calls (fixtures::check, fixtures::generate, sim::explain_json, ...), so the two cannot disagree.
// The Python package (python/cpgold) wraps these in its documented API; this module is its private engine.
#include <cmath>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "check/check_request.hpp"
#include "check/engine.hpp"
#include "fixtures/schema/fixture_reader.hpp"
#include "fixtures/schema/fixture_schema.hpp"
#include "fixtures/golden/fixture_part.hpp"
#include "fixtures/golden/fixture_writer.hpp"
#include "fixtures/golden/gen_job.hpp"
#include "fixtures/golden/generate_admission.hpp"
#include "fixtures/golden/golden_run.hpp"
#include "fixtures/storage/hdf5_reader.hpp"
#include "fixtures/schema/inputs_digest.hpp"
#include "fixtures/storage/output_file.hpp"
#include "check/shrink.hpp"
#include "fixtures/golden/suites.hpp"
#include "reference/attention_engine.hpp"
#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"
#include "sim/case/given_inputs.hpp"
#include "sim/explain/explain.hpp"
#include "sim/explain/explain_request.hpp"
#include "sim/explain/explain_summary.hpp"
#include "sim/plan/plan.hpp"

namespace py = pybind11;
using namespace pybind11::literals;  // "name"_a = value: the items of a py::dict
using namespace cpgold;

namespace {

// A temporary output file held by Python until release() (its destructor removes the file unless committed).
struct PartialOutput {
  std::optional<fx::PartialFile> file;
};

// A fixture given from Python: a path, or the bytes of an HDF5 file (a fixture generated in memory).
using FixtureSource = std::variant<py::bytes, std::string>;

struct OpenGolden {
  std::vector<uint8_t> image;  // kept alive while the reader uses it
  std::optional<fx::h5::Reader> reader;
};

// What opening a golden needs, taken from the Python object while the GIL is held; the file itself is then opened and
// read with the GIL released. h5py holds the GIL while it waits for HDF5's lock, so code here that held the GIL
// while in HDF5 could deadlock with another thread reading through h5py (ranks of cpgold.thread_ranks do both).
struct GoldenSource {
  std::string path;             // a file
  std::vector<uint8_t> image;   // or the bytes of one (a fixture in memory)
  bool in_memory = false;
};

GoldenSource golden_source(const FixtureSource& source) {
  GoldenSource out;
  if (const auto* path = std::get_if<std::string>(&source)) {
    out.path = *path;
    return out;
  }
  const std::string bytes = std::get<py::bytes>(source);
  out.image.assign(bytes.begin(), bytes.end());
  out.in_memory = true;
  return out;
}

// No Python object is touched: call it with the GIL released.
void open_golden(GoldenSource source, OpenGolden& out) {
  if (!source.in_memory) {
    out.reader.emplace(source.path);
    return;
  }
  out.image = std::move(source.image);
  out.reader.emplace("<fixture in memory>", out.image, fx::h5::InMemory{});
}

sim::CaseSpec parse_case(const std::string& json_text) { return sim::parse_case_text(json_text); }

// tensors and ranks as `cpgold check --tensors/--ranks` take them ("o,lse", "0,2"; "" for all): one parser.
fx::CheckOptions check_options(const std::string& tensors, const std::string& empty_row_lse, const std::string& ranks,
                               bool allow_same_file, bool diagnose, const std::string& pad_rows = "zero",
                               double diagnosis_budget = 30) {
  return fx::check_options({tensors, ranks, empty_row_lse, pad_rows, allow_same_file, diagnose, diagnosis_budget},
                           fx::kPythonFields);
}

// A C++ error raised while a signal was pending in Python (SIGINT during a write: cpgold's handler removed the file
// and ran Python's, which only noted the signal): Python's exception for that signal (KeyboardInterrupt) instead.
template <class F>
auto signals_first(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const InputError&) {
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    throw;
  }
}

// An array of the Python door as the engine's candidate tensor: its declared shape first (against the golden's, by
// the rule of candidate files; nothing copied for one that does not fit), then its element type by the rule of
// candidate files (float32, fp16 and bf16 widened exactly; float64 refused rather than rounded), then its values.
// element: "bfloat16" for 16-bit words holding bf16 (torch's bfloat16 handed over as int16), else "" (the dtype's).
// layout: "ht", "th" or "" for an LSE: "" takes [t, h, 1] as [t, h], a 2-D LSE as [h, t] unless only [t, h] fits
// the fixture's heads (the rule of candidate files: [h, t] unless stated).
fx::CandidateTensor array_shape(const py::array& array, const std::string& layout, const fx::CandidateSet::Key& key,
                                const std::string& where, int64_t heads_q) {
  const fx::Quantity q = std::get<3>(key);
  fx::CandidateTensor t;
  t.where = where;
  for (py::ssize_t i = 0; i < array.ndim(); ++i) t.dims.push_back(array.shape(i));
  if (q == fx::Quantity::lse) {
    if (!layout.empty() && layout != "ht" && layout != "th")
      fail_input("lse_layout", "expected \"ht\" or \"th\", got \"", layout, "\"");
    if (t.dims.size() == 3 && t.dims[2] == 1) {
      if (layout == "ht") fail_input("lse_layout", "\"ht\" does not fit a [t, h, 1] LSE (", where, ")");
      t.dims.pop_back();
      t.lse_row_major = true;
    } else if (t.dims.size() == 2) {
      t.lse_row_major = layout == "th" || (layout.empty() && t.dims[1] == heads_q && t.dims[0] != heads_q);
    }
  }
  return t;
}

void require_expected_shape(const fx::CandidateTensor& t, const fx::CandidateSet::Key& key,
                            const fx::ExpectedShape& expected_shape) {
  const auto [expected, from] = expected_shape(key, t);
  if (t.dims != expected)
    fail_input(t.where, "expected shape ", fx::h5::dims_text(expected), " (from ", from, "), found ",
               t.dims.empty() ? std::string("a 0-d array (a scalar)") : fx::h5::dims_text(t.dims));
}

void array_values(const py::array& array, const std::string& element, fx::CandidateTensor& t) {
  const std::string& where = t.where;
  const py::dtype dtype = array.dtype();
  const std::string type_name = py::str(dtype.attr("name"));
  const size_t n = static_cast<size_t>(array.size());
  t.values.resize(n);
  if (element == "bfloat16" || type_name == "bfloat16") {
    if (dtype.itemsize() != 2) fail_input(where, "bfloat16 values must be 16-bit words, found ", type_name);
    const auto words = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>::ensure(array.attr("view")(py::dtype("uint16")));
    if (!words) throw py::error_already_set();
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(words.data()[i]) << 16;
      std::memcpy(&t.values[i], &bits, sizeof bits);
    }
  } else if (dtype.kind() == 'f' && dtype.itemsize() == 4) {
    const auto values = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(array);
    if (!values) throw py::error_already_set();
    std::copy(values.data(), values.data() + n, t.values.begin());
  } else if (dtype.kind() == 'f' && dtype.itemsize() == 2) {
    const auto values = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(array);  // exact
    if (!values) throw py::error_already_set();
    std::copy(values.data(), values.data() + n, t.values.begin());
  } else {
    fail_input(where, "expected float32, bf16 or fp16 values, found ", type_name,
               dtype.kind() == 'f' ? " (refused rather than rounded to float32, as in candidate files: convert it "
                                     "yourself if the rounding is what you mean)"
                                   : "");
  }
}

py::dict suite_case_dict(const fx::SuiteCase& c) {
  return py::dict("name"_a = c.name, "json"_a = c.json, "cpu_only"_a = c.cpu_only, "trace"_a = c.trace,
                  "note"_a = c.note);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "cpgold's C++ core (private: use the cpgold package)";

  // cpgold::InputError -> cpgold.InputError (a ValueError with .field), raised from Python's side of the package.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InputError& e) {
      py::object cls = py::module_::import("cpgold.errors").attr("InputError");
      // Names from files need not be UTF-8 (a dataset named b"\xff"): escaped as the command's JSON does.
      auto text = [](const std::string& bytes) {
        return py::reinterpret_steal<py::object>(
            PyUnicode_DecodeUTF8(bytes.data(), static_cast<py::ssize_t>(bytes.size()), "backslashreplace"));
      };
      py::object error = cls(text(e.what()), text(e.field()));
      PyErr_SetObject(cls.ptr(), error.ptr());
    }
  });

  m.def("generator_version", &fx::generator_version, "\"cpgold X.Y.Z\", stored in every fixture");
  m.attr("schema_version") = fx::kSchemaVersion;

  m.def(
      "normalize_case", [](const std::string& json_text) { return sim::normalized_json(parse_case(json_text)); },
      py::arg("case_json"), "the case with every key and its default, validated (InputError names the key)");
  m.def("suite_names", &fx::suite_names);
  m.def(
      "suite_cases",
      [](const std::string& suite) {
        py::list out;
        for (const fx::SuiteCase& c : fx::suite_cases(suite)) out.append(suite_case_dict(c));
        return out;
      },
      py::arg("suite"));
  m.def(
      "random_cases",
      [](int count, uint64_t seed) {
        if (count < 1) fail_input("count", "expected a number of cases >= 1, got ", count);
        py::list out;
        for (const fx::SuiteCase& c : fx::random_cases(count, seed)) out.append(suite_case_dict(c));
        return out;
      },
      py::arg("count"), py::arg("seed"));
  m.def("inside_gpu_table", [](const std::string& json_text) { return fx::inside_gpu_table(parse_case(json_text)); });

  m.def(
      "explain",
      [](const std::string& json_text, bool summary, bool te) {
        const sim::ExplainRequest request{parse_case(json_text), summary, false, te};
        const sim::Explanation explanation = sim::explain(request);
        return py::make_tuple(sim::explanation_json(request, explanation).dump(),
                              sim::explanation_text(request, explanation));
      },
      py::arg("case_json"), py::arg("summary") = false, py::arg("te") = false,
      "(JSON text, text) of `cpgold explain` (te: `explain --te`)");

  // The global row of every rank-local row (TransformerEngine's thd_get_partitioned_indices) of both sides of a case:
  // how rank-local shards of a captured run become the case's global tensors (cpgold.capture).
  m.def(
      "rank_rows",
      [](const std::string& json_text) {
        const sim::CaseSpec spec = parse_case(json_text);
        const sim::Partition partition =
            sim::make_partition(sim::layout(spec), spec.cp_size,
                                spec.causal || is_causal(sim::mask_window(spec)) || has_window(sim::mask_window(spec)));
        py::dict out;
        for (auto [name, side] : {std::pair{"q", &partition.q}, std::pair{"kv", &partition.kv}}) {
          py::list ranks;
          for (int r = 0; r < spec.cp_size; ++r) {
            const std::vector<int64_t> rows = side->gather_indices(r);
            py::array_t<int64_t> a(static_cast<py::ssize_t>(rows.size()));
            std::copy(rows.begin(), rows.end(), a.mutable_data());
            ranks.append(a);
          }
          out[name] = ranks;
        }
        return out;
      },
      py::arg("case_json"), "{'q': [rows of rank r], 'kv': [...]}: the global row of every rank-local row");

  m.def(
      "generate",
      [](const std::string& json_text, std::optional<std::string> path, bool trace, bool force, bool yes,
         std::optional<py::dict> inputs, bool allow_nonfinite, std::optional<std::pair<int, int>> shard,
         const std::string& engine_name) -> py::object {
        std::vector<fx::GenJob> jobs{{"case", path.value_or(""), parse_case(json_text), trace}};
        if (shard) {  // `gen --shard I/N`: the part file of KV-head group I of N (fx::shard_heads checks N)
          if (!path) fail_input("shard", "a part is written to a file: give a path (cpgold.merge puts the parts together)");
          if (shard->second < 1 || shard->first < 1 || shard->first > shard->second)
            fail_input("shard", "(", shard->first, ", ", shard->second, "): give (I, N) with 1 <= I <= N (shards count "
                       "from 1)");
          fx::GenJob& job = jobs.front();
          job.heads = fx::shard_heads(job.spec, shard->first, shard->second);
          job.shard_index = shard->first;
          job.shard_count = shard->second;
        }
        if (path) fx::check_destination(*path, force);  // before any compute, as `cpgold gen`
        // `gen --engine`: cpu, gpu (refused where this extension has no GPU engine or no device) or auto.
        std::unique_ptr<AttentionEngine> engine_holder;
        std::string engine_chosen;
        const AttentionEngine* engine = choose_engine(engine_name, "engine", engine_holder, engine_chosen);
        // Given inputs (float32 or float64 arrays, C order, from cpgold.generate): the checks of `gen --inputs`.
        std::shared_ptr<sim::CaseInputs> given;
        sim::GivenInputsSummary given_summary;
        if (inputs) {
          given = std::make_shared<sim::CaseInputs>();
          for (sim::InputTensor which : {sim::InputTensor::q, sim::InputTensor::k, sim::InputTensor::v, sim::InputTensor::dout}) {
            const char* name = sim::input_tensor_name(which);
            if (!inputs->contains(name))
              fail_input("inputs", "missing tensor '", name, "': give q, k, v and dout");
            const py::array array = py::reinterpret_borrow<py::array>((*inputs)[name]);
            std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
            Tensor3<float>& t = which == sim::InputTensor::q   ? given->q
                                : which == sim::InputTensor::k ? given->k
                                : which == sim::InputTensor::v ? given->v
                                                               : given->dout;
            if (py::isinstance<py::array_t<float, py::array::c_style>>(array))
              t = sim::given_tensor(jobs.front().spec, which, dims, static_cast<const float*>(array.data()));
            else if (py::isinstance<py::array_t<double, py::array::c_style>>(array))
              t = sim::given_tensor(jobs.front().spec, which, dims, static_cast<const double*>(array.data()));
            else
              fail_input(std::string("inputs.") + name, "expected a C-ordered float32 or float64 array, got ",
                         std::string(py::str(array.dtype())));
          }
          given_summary = sim::check_given_inputs(jobs.front().spec, *given, allow_nonfinite);
          jobs.front().given_inputs = true;
        }
        // The memory (with its margin) and disk estimates of `cpgold gen`, before any work.
        const std::string folder = path ? std::filesystem::absolute(*path).parent_path().string() : std::string(".");
        (void)fx::admit_gen_jobs(jobs, folder, yes, "yes=True");
        fx::GenerateOptions options;
        options.trace = trace;
        options.given_inputs = given;
        options.nonfinite_valid = given_summary.nonfinite_valid;
        options.heads = jobs.front().heads;
        options.engine = engine;
        fx::GoldenRun run;
        {
          py::gil_scoped_release release;
          run = fx::generate(jobs.front(), options);
        }
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // Ctrl-C during the compute
        if (shard) {
          fx::WriteOptions write;
          write.force = force;
          const fx::WriteSummary summary =
              signals_first([&] { return fx::write_part(run, shard->first, shard->second, *path, write); });
          py::dict d;
          d["path"] = summary.path;
          d["bytes"] = summary.bytes;
          d["datasets"] = summary.datasets;
          d["shard"] = py::make_tuple(shard->first, shard->second);
          const fx::HeadSlice& h = jobs.front().heads;
          d["kv_heads"] = py::make_tuple(h.kv_begin, h.kv_end);
          d["q_heads"] = py::make_tuple(h.q_begin, h.q_end);
          return d;
        }
        if (path) {
          fx::WriteOptions write;
          write.force = force;
          const fx::WriteSummary summary = signals_first([&] { return fx::write_fixture(std::move(run), *path, write); });
          py::dict d;
          d["path"] = summary.path;
          d["bytes"] = summary.bytes;
          d["datasets"] = summary.datasets;
          return d;
        }
        const std::vector<uint8_t> image = fx::write_fixture_image(run);
        return py::bytes(reinterpret_cast<const char*>(image.data()), image.size());
      },
      py::arg("case_json"), py::arg("path") = py::none(), py::arg("trace") = false, py::arg("force") = false,
      py::arg("yes") = false, py::arg("inputs") = py::none(), py::arg("allow_nonfinite") = false,
      py::arg("shard") = py::none(), py::arg("engine") = "cpu",
      "a fixture of the case: written to `path` as `cpgold gen` writes it, or (path None) the bytes of the same file; "
      "shard (I, N): the part file of `gen --shard I/N`; engine: cpu, gpu or auto (`gen --engine`)");

  m.def(
      "merge",
      [](const std::vector<std::string>& parts, const std::string& output, bool force, bool yes) {
        fx::MergeOptions options;
        options.force = force;
        options.yes = yes;
        const fx::MergeSummary summary = signals_first([&] {
          py::gil_scoped_release release;
          return fx::merge_parts(parts, output, options);
        });
        return py::dict("path"_a = summary.written.path, "bytes"_a = summary.written.bytes,
                        "datasets"_a = summary.written.datasets, "parts"_a = summary.parts);
      },
      py::arg("parts"), py::arg("output"), py::arg("force") = false, py::arg("yes") = false,
      "`cpgold merge PARTS -o OUTPUT`: the fixture of the parts, bit for bit the one gen writes without --shard");

  // The destination rules of every file cpgold writes, for the Python candidate writers: check_destination before
  // any work, a hidden temporary file (removed on error, on SIGINT/SIGTERM/SIGHUP, and by release()), a no-replace
  // move into place (with force: replacing a regular file only, never through a symlink).
  py::class_<PartialOutput>(m, "PartialFile")
      .def(py::init([](const std::string& destination, bool force) {
             auto out = std::make_unique<PartialOutput>();
             out->file.emplace(destination, force);
             return out;
           }),
           py::arg("destination"), py::arg("force"))
      .def_property_readonly("path", [](const PartialOutput& p) { return p.file ? p.file->path() : std::string(); })
      .def("commit", [](PartialOutput& p) { signals_first([&] { p.file->commit(); }); })
      .def("release", [](PartialOutput& p) { p.file.reset(); }, "removes the temporary file unless committed");

  // A candidate file's tensors as `cpgold check` reads them (the same reader and rules): {name: float32 array} of
  // the root (rank -1) or of /ranks/<rank>; LSE as stored (dims of [t, h, 1] without the 1).
  m.def(
      "read_candidate",
      [](const std::string& path, int rank) {
        fx::CandidateSet set;
        {
          py::gil_scoped_release release;  // HDF5 without the GIL (golden_source says why)
          set = fx::read_candidate_files({path});
        }
        if (rank >= 0 && !set.fixture_candidate.empty())
          fail_input(path, "is a cpgold fixture: it holds no per-rank candidate outputs");
        // The root's tensors (rank < 0), or those of /ranks/<rank>/ (step partials aside), by where they were read.
        const std::string group = rank < 0 ? std::string("/") : "/ranks/" + std::to_string(rank) + "/";
        py::dict out;
        bool rank_found = false;
        for (const auto& [key, tensor] : set.tensors) {
          const fx::Quantity q = std::get<3>(key);
          if (tensor.where != set.sources.front() + ":" + group + std::string(quantity_name(q))) continue;
          rank_found = true;
          py::array_t<float> a(tensor.dims);
          std::copy(tensor.values.begin(), tensor.values.end(), a.mutable_data());
          out[py::str(std::string(quantity_name(q)))] = a;
        }
        if (rank >= 0 && !rank_found) fail_input(path, "has no outputs of rank ", rank, " (/ranks/", rank, ")");
        return out;
      },
      py::arg("path"), py::arg("rank") = -1);

  m.def(
      "open_fixture",
      [](const FixtureSource& source, bool verify) {
        GoldenSource bytes = golden_source(source);
        OpenGolden golden;
        std::optional<fx::FixtureFile> opened;
        std::string digest;
        {
          py::gil_scoped_release release;  // HDF5 without the GIL (golden_source says why)
          open_golden(std::move(bytes), golden);
          opened.emplace(fx::open_fixture(*golden.reader, fx::OpenOptions{verify}));
          digest = opened->inputs_sha256.empty() ? fx::inputs_sha256(*golden.reader) : opened->inputs_sha256;
        }
        const fx::FixtureFile& f = *opened;
        return py::dict("schema_version"_a = f.schema_version, "generator"_a = f.generator, "case_json"_a = f.case_json,
                        "traced"_a = f.traced, "datasets"_a = f.datasets, "inputs_sha256"_a = digest,
                        "inputs_sha256_stored"_a = !f.inputs_sha256.empty(), "inputs_source"_a = f.inputs_source,
                        "inputs_nonfinite_valid"_a = f.inputs_nonfinite_valid);
      },
      py::arg("fixture"), py::arg("verify") = false,
      "validates a fixture against the schema (verify: also every checksum and the inputs digest)");

  // tensors= and ranks= of the Python door read by the parsers of `cpgold check --tensors/--ranks` (None: not given).
  m.def(
      "check_options_text",
      // The options of a check as text, validated by the parsers both doors use, with Python's field names; an option
      // given as None is not checked.
      [](std::optional<std::string> tensors, std::optional<std::string> ranks, std::optional<std::string> empty_row_lse,
         std::optional<std::string> pad_rows) {
        if (tensors) (void)fx::parse_tensor_list(*tensors, fx::kPythonFields.tensors);
        if (ranks) (void)fx::parse_rank_list(*ranks, fx::kPythonFields.ranks);
        if (empty_row_lse || pad_rows)
          (void)check_options("", empty_row_lse.value_or("neg-inf"), "", false, true, pad_rows.value_or("zero"));
      },
      py::arg("tensors"), py::arg("ranks"), py::arg("empty_row_lse") = py::none(), py::arg("pad_rows") = py::none());

  m.def(
      "check_files",
      [](const FixtureSource& golden_source_arg, const std::vector<std::string>& candidates, const std::string& tensors,
         const std::string& empty_row_lse, const std::string& ranks, bool allow_same_file, bool diagnose,
         const std::string& pad_rows, double diagnosis_budget) {
        const fx::CheckOptions options =
            check_options(tensors, empty_row_lse, ranks, allow_same_file, diagnose, pad_rows, diagnosis_budget);
        GoldenSource source = golden_source(golden_source_arg);
        py::gil_scoped_release release;
        OpenGolden golden;
        open_golden(std::move(source), golden);
        const fx::FixtureFile fixture = fx::open_fixture(*golden.reader, fx::OpenOptions{false, true});
        return fx::check(*golden.reader, fixture, candidates, options);
      },
      py::arg("golden"), py::arg("candidates"), py::arg("tensors"), py::arg("empty_row_lse"), py::arg("ranks"),
      py::arg("allow_same_file"), py::arg("diagnose") = true, py::arg("pad_rows") = "zero",
      py::arg("diagnosis_budget") = 30.0);

  // arrays: (rank or -1, name, array of any dtype, element, lse layout): see array_shape. Shapes are compared with
  // the fixture's before any array is copied.
  m.def(
      "check_arrays",
      [](const FixtureSource& golden_source_arg,
         const std::vector<std::tuple<int, std::string, py::array, std::string, std::string>>& arrays,
         const std::string& scope, const std::string& source, const std::string& inputs_sha256,
         const std::string& tensors, const std::string& empty_row_lse, const std::string& ranks, bool diagnose,
         const std::string& pad_rows, double diagnosis_budget) {
        const fx::CheckOptions options =
            check_options(tensors, empty_row_lse, ranks, false, diagnose, pad_rows, diagnosis_budget);
        fx::CandidateSet cands;
        cands.sources = {source};
        if (scope == "cp_gathered") cands.global_scope = fx::CandidateScope::cp_output;
        else if (scope != "global") fail_input("scope", "expected \"global\" or \"cp_gathered\", got \"", scope, "\"");
        if (!inputs_sha256.empty()) cands.inputs.push_back({source, inputs_sha256, "", true});
        GoldenSource golden_bytes = golden_source(golden_source_arg);
        OpenGolden golden;
        std::optional<fx::FixtureFile> fixture;
        {
          py::gil_scoped_release release;  // HDF5 without the GIL (golden_source says why)
          open_golden(std::move(golden_bytes), golden);
          fixture.emplace(fx::open_fixture(*golden.reader, fx::OpenOptions{false, true}));
        }
        // Shapes first (the arrays' own, then the fixture's), values only once every shape fits.
        std::vector<std::pair<fx::CandidateSet::Key, fx::CandidateTensor>> items;
        for (const auto& [rank, name, array, element, layout] : arrays) {
          const auto quantity = fx::parse_quantity(name);
          if (!quantity) fail_input("outputs", "tensor \"", name, "\" is not one of o, lse, dq, dk, dv");
          const fx::CandidateSet::Key key{rank, -1, 0, *quantity};
          const std::string where = "array " + name + (rank >= 0 ? "@r" + std::to_string(rank) : std::string());
          items.emplace_back(key, array_shape(array, layout, key, where, fixture->spec.heads_q));
        }
        {
          py::gil_scoped_release release;
          const fx::ExpectedShape expected_shape = fx::expected_shapes(*golden.reader, *fixture);
          for (const auto& [key, t] : items) require_expected_shape(t, key, expected_shape);
        }
        for (size_t i = 0; i < items.size(); ++i) {
          const auto& [rank, name, array, element, layout] = arrays[i];
          array_values(array, element, items[i].second);
          cands.add(items[i].first, std::move(items[i].second));
        }
        py::gil_scoped_release release;
        return fx::check(*golden.reader, *fixture, cands, options);
      },
      py::arg("golden"), py::arg("arrays"), py::arg("scope"), py::arg("source"), py::arg("inputs_sha256"),
      py::arg("tensors"), py::arg("empty_row_lse"), py::arg("ranks"), py::arg("diagnose") = true,
      py::arg("pad_rows") = "zero", py::arg("diagnosis_budget") = 30.0);

  m.def(
      "self_check",
      [](const std::string& golden, const std::string& tensors, const std::string& empty_row_lse, bool diagnose) {
        const fx::CheckOptions options = check_options(tensors, empty_row_lse, "", false, diagnose);
        py::gil_scoped_release release;
        return fx::self_check(golden, options);
      },
      py::arg("golden"), py::arg("tensors"), py::arg("empty_row_lse"), py::arg("diagnose") = true);

  // The search of `cpgold shrink` (check/shrink.hpp) over a Python runner: runner(case_json, run) returns
  // (status "fails" | "passes" | "no_candidate", diagnosis kinds, detail); progress(dict) after every run.
  m.def(
      "shrink",
      [](const std::string& case_json, const py::function& runner, const std::vector<std::string>& kinds,
         bool any_failure, double budget, int64_t max_runs, int reseed, uint64_t seed, const std::vector<int>& dims,
         const py::object& progress, bool same_tensors) {
        auto verdict_dict = [](const fx::ShrinkVerdict& v) {
          return py::dict("status"_a = v.status == fx::ShrinkStatus::no_candidate
                                           ? "no_candidate"
                                           : std::string(fx::shrink_status_name(v.status)),
                          "kinds"_a = v.kinds, "detail"_a = v.detail, "tensors"_a = v.tensors);
        };
        std::function<void(const fx::ShrinkProgress&)> report_progress;
        if (!progress.is_none())
          report_progress = [&](const fx::ShrinkProgress& p) {
            progress(py::dict("run"_a = p.run, "seconds"_a = p.seconds, "change"_a = p.change,
                              "case"_a = fx::compact_case_json(p.spec), "verdict"_a = verdict_dict(p.verdict),
                              "kept"_a = p.kept, "smallest"_a = fx::compact_case_json(p.smallest)));
          };
        const fx::ShrinkOptions options{.kinds = kinds, .any_failure = any_failure, .same_tensors = same_tensors,
                                        .budget_seconds = budget, .max_runs = max_runs, .reseed = reseed, .seed = seed,
                                        .dims = dims, .progress = report_progress,
                                        .estimate_seconds = nullptr};  // the search's own time model
        const fx::ShrinkResult r = fx::shrink(
            parse_case(case_json),
            [&](const sim::CaseSpec& spec, int64_t run) {
              const py::tuple t = runner(fx::compact_case_json(spec), run);
              if (t.size() != 3 && t.size() != 4)
                fail_input("runner", "expected (status, kinds, detail[, failing tensors]), got ", t.size(), " items");
              const std::string status = t[0].cast<std::string>();
              fx::ShrinkVerdict v;
              if (status == "fails") v.status = fx::ShrinkStatus::fails;
              else if (status == "passes") v.status = fx::ShrinkStatus::passes;
              else if (status == "no_candidate") v.status = fx::ShrinkStatus::no_candidate;
              else fail_input("runner", "status \"", status, "\" is not fails, passes or no_candidate");
              v.kinds = t[1].cast<std::vector<std::string>>();
              v.detail = t[2].cast<std::string>();
              if (t.size() == 4) v.tensors = t[3].cast<std::vector<std::string>>();
              return v;
            },
            options);
        return py::dict("original"_a = fx::compact_case_json(r.original),
                        "original_verdict"_a = verdict_dict(r.original_verdict), "original_fails"_a = r.original_fails,
                        "kinds"_a = r.kinds, "same_tensors"_a = r.same_tensors,
                        "smallest"_a = fx::compact_case_json(r.smallest),
                        "smallest_verdict"_a = verdict_dict(r.smallest_verdict), "steps"_a = r.steps, "runs"_a = r.runs,
                        "passed"_a = r.passed, "failed_otherwise"_a = r.failed_otherwise,
                        "no_candidate"_a = r.no_candidate, "seconds"_a = r.seconds, "stopped"_a = r.stopped,
                        "rows_q"_a = fx::case_rows_q(r.smallest), "tokens_q"_a = fx::case_tokens_q(r.smallest),
                        "original_rows_q"_a = fx::case_rows_q(r.original));
      },
      py::arg("case_json"), py::arg("runner"), py::arg("kinds"), py::arg("any_failure"), py::arg("budget"),
      py::arg("max_runs"), py::arg("reseed"), py::arg("seed"), py::arg("dims"), py::arg("progress"),
      py::arg("same_tensors") = false);

  // Reports cross into Python as (JSON text, the text report of `cpgold check`).
  py::class_<fx::CheckReport>(m, "CheckReport")
      .def("json", [](const fx::CheckReport& r) { return fx::to_json(r).dump(); })
      .def("text", [](const fx::CheckReport& r) { return fx::render_text(r); })
      .def_property_readonly("passed", &fx::CheckReport::pass);
}
