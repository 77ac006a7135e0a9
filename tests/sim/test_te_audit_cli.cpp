// `cpgold explain --te-audit` run as a user runs it: the exit code is the audit's verdict (1 with a finding, 0 when
// exact, 2 for unusable input), the text labels where cpgold's plan and TE's replay differ, the JSON carries the
// replayed calls, the SVG outlines the cells with findings, and explain without the flag is unchanged.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "../fixtures/cli.hpp"
#include "../fixtures/temp_folder.hpp"

namespace {
const std::string kGeometry =
    "explain --seqlens-q 5,0,13 --padded-q 8,0,24 --padded-kv 8,0,16 --cp-size 2 --comm p2p --mask causal";
bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("explain --te-audit: exit 1 with findings, both sides of a difference labelled") {
  const CliResult r = run_cli(kGeometry + " --te-audit");
  CHECK(r.code == 1);
  CHECK(has(r.output, "TransformerEngine 2.20"));
  CHECK(has(r.output, "q_input               cpgold first_half | TE full"));
  CHECK(has(r.output, "cu_seqlens_kv         cpgold [0,2,2,6] | TE [0,2,2,7]"));
  CHECK(has(r.output, "query row 8 sequence 2 position 4: expected keys 0..3; computed 0..3, 12"));
  CHECK(has(r.output, "TE audit verdict (pad_between_seqs=True): not exact"));
  // Without the flag explain keeps its output and exit code.
  const CliResult plain = run_cli(kGeometry);
  CHECK(plain.code == 0);
  CHECK_FALSE(has(plain.output, "TransformerEngine replay"));
}

TEST_CASE("explain --te-audit: exit 0 when exact, and --te-pad-between-seqs false judges the shortcut") {
  const std::string c = "explain --seqlens-q 5,8,30 --cp-size 2 --comm p2p --mask causal --te-audit";
  const CliResult exact = run_cli(c);
  CHECK(exact.code == 0);
  CHECK(has(exact.output, "every tile agrees"));
  CHECK(has(exact.output, "TE audit verdict (pad_between_seqs=True): exact"));
  const CliResult shortcut = run_cli(c + " --te-pad-between-seqs false");
  CHECK(shortcut.code == 1);
  CHECK(has(shortcut.output, "TE audit verdict (pad_between_seqs=False): not exact"));
}

TEST_CASE("explain --te-audit: refusals, and unusable input") {
  const CliResult refused = run_cli("explain --seqlens-q 9 --cp-size 2 --comm p2p --mask causal --window 2,0 --te-audit");
  CHECK(refused.code == 1);
  CHECK(has(refused.output, "[context_parallel.py:5054-5061]"));
  CHECK(has(refused.output, "every backend refuses the case"));
  CHECK(run_cli("explain --seqlens-q 9 --te-audit").code == 2);
  CHECK(run_cli("explain --seqlens-q 9 --cp-size 2 --te-audit --summary").code == 2);
  CHECK(run_cli("explain --seqlens-q 9 --cp-size 2 --te-audit --te-pad-between-seqs maybe").code == 2);
}

TEST_CASE("explain --te-audit: JSON keys and SVG marks") {
  TempFolder tmp;
  const CliResult r = run_cli(kGeometry + " --te-audit --format json --svg " + tmp.file("map.svg"));
  CHECK(r.code == 1);
  const nlohmann::json j = nlohmann::json::parse(r.output);
  const nlohmann::json& te = j.at("te_audit");
  CHECK(te.at("exact") == false);
  CHECK(te.at("pad_between_seqs") == true);
  CHECK(te.at("user_arguments").at("attn_mask_type") == "padding_causal");
  const nlohmann::json& fused = te.at("replays").at(0);
  CHECK(fused.at("backend") == "fused");
  CHECK(fused.at("calls").at("forward").at(0).at("cu_seqlens_kv") == nlohmann::json({0, 2, 2, 7}));
  CHECK(fused.at("wrong_pairs") == 38);
  CHECK(fused.at("findings").at(0).at("computed_keys").size() == 2);
  CHECK(te.at("replays").at(1).at("calls").at("forward").at(0).at("seqused_k") == nlohmann::json({2, 0, 5}));
  CHECK(te.at("other_pad_between_seqs").at("replays").at(1).at("misread").is_object());
  CHECK(te.at("plan_differences").at("backend") == "fused");
  CHECK(j.contains("warnings"));  // the shortcut warnings stay
  std::ifstream svg(tmp.file("map.svg"));
  std::stringstream text;
  text << svg.rdbuf();
  CHECK(has(text.str(), "stroke=\"#d00\""));
  CHECK(has(text.str(), "fused rank 0 sequence 2: 2 wrong pairs"));
}
