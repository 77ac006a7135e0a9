#pragma once
// CLI glue for a case: `--case JSON` and one flag per case key (seqlens_q is --seqlens-q), usable by every subcommand.
// Flags given next to --case override its keys; the merged object goes through sim::parse_case, so every error names
// the key and the value.
#include <CLI/CLI.hpp>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "reference/input_error.hpp"
#include "sim/case/case_spec.hpp"

namespace cpgold::app {

struct CaseFlags {
  std::string case_json;                     // --case
  std::map<std::string, std::string> values;  // case key -> flag text, only flags given
};

namespace case_flags_detail {
enum class Kind { int_list, integer, number, text, pair };
struct Key {
  const char* name;
  Kind kind;
  const char* help;
};
inline const Key kKeys[] = {
    {"seqlens_q", Kind::int_list, "actual lengths, e.g. 5,8"},
    {"seqlens_kv", Kind::int_list, "actual kv lengths (default: seqlens_q)"},
    {"padded_q", Kind::int_list, "padded lengths (default: padded to a multiple of 2*cp_size)"},
    {"padded_kv", Kind::int_list, "padded kv lengths (default: padded_q when seqlens_kv equals seqlens_q, so K/V of "
                                  "self-attention are laid out as Q; else seqlens_kv padded to a multiple of 2*cp_size)"},
    {"total_tokens_q", Kind::integer, "rows of the q tensor (default: sum of padded_q)"},
    {"total_tokens_kv", Kind::integer, "rows of the kv tensors (default: total_tokens_q when K/V are laid out as Q, "
                                       "else sum of padded_kv)"},
    {"heads_q", Kind::integer, "query heads"},
    {"heads_kv", Kind::integer, "kv heads (default: heads_q)"},
    {"dim_qk", Kind::integer, "head dim of q and k"},
    {"dim_v", Kind::integer, "head dim of v (default: dim_qk)"},
    {"dtype", Kind::text, "bf16 | fp16 | fp32"},
    {"mask", Kind::text, "none | causal"},
    {"window", Kind::pair, "wl,wr (-1 unbounded)"},
    {"cp_size", Kind::integer, "CP ranks W"},
    {"comm", Kind::text, "p2p | a2a | all_gather | a2a+p2p"},
    {"a2a_size", Kind::integer, "a2a group size for a2a+p2p"},
    {"seed", Kind::integer, "seed of the inputs"},
    {"pad_fill", Kind::text, "zero | random | nan | inf"},
    {"softmax_scale", Kind::number, "default 1/sqrt(dim_qk)"},
};

inline std::string flag_name(const std::string& key) {
  std::string f = "--" + key;
  for (char& c : f)
    if (c == '_') c = '-';
  return f;
}

// A flag's number goes through the JSON number grammar, so a flag and the same key in --case read the same value and
// meet the same range in sim::parse_case (one parser, one range: a seed of 2^64-1 or a softmax_scale of 5e-324 is
// judged the same way either way).
inline nlohmann::json parse_number(const std::string& key, const std::string& text, bool integer) {
  nlohmann::json value;
  try {
    value = sim::parse_json(text, key);
  } catch (const InputError& e) {
    if (std::string(e.what()).find("out_of_range") != std::string::npos || std::string(e.what()).find("out of range") != std::string::npos)
      fail_input(key, "value \"", sim::excerpt(text), "\" is out of range (it does not fit a 64-bit float or integer)");
    fail_input(key, "value \"", sim::excerpt(text), "\" is not ", integer ? "an integer" : "a number");
  }
  if (!value.is_number() || (integer && !value.is_number_integer()))
    fail_input(key, "value \"", sim::excerpt(text), "\" is not ", integer ? "an integer" : "a number");
  return value;
}

// "5,8" -> [5, 8]; an empty item ("5,,8", "5,8,", ",5") is an error naming its index.
inline nlohmann::json parse_list(const std::string& key, const std::string& text) {
  nlohmann::json list = nlohmann::json::array();
  if (text.empty()) return list;
  size_t begin = 0;
  for (int i = 0;; ++i) {
    const size_t end = text.find(',', begin);
    const std::string item = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    const std::string field = key + "[" + std::to_string(i) + "]";
    if (item.empty()) fail_input(field, "empty item in \"", sim::excerpt(text), "\"");
    list.push_back(parse_number(field, item, true));
    if (end == std::string::npos) return list;
    begin = end + 1;
  }
}

inline nlohmann::json to_json(const Key& key, const std::string& text) {
  switch (key.kind) {
    case Kind::integer: return parse_number(key.name, text, true);
    case Kind::number: return parse_number(key.name, text, false);
    case Kind::text: return text;
    case Kind::int_list:
    case Kind::pair: return parse_list(key.name, text);
  }
  return text;
}
}  // namespace case_flags_detail

// Adds --case and one flag per case key to `sub`.
inline void add_case_flags(CLI::App& sub, const std::shared_ptr<CaseFlags>& flags) {
  sub.add_option("--case", flags->case_json, "the case as one JSON object (docs/case-spec.md); flags override its keys");
  for (const auto& key : case_flags_detail::kKeys) {
    const std::string name = key.name;
    sub.add_option_function<std::string>(
        case_flags_detail::flag_name(name), [flags, name](const std::string& v) { flags->values[name] = v; }, key.help);
  }
}

// The case object as given (--case merged with the flags), before parse_case validates and normalises it; InputError
// naming --case when it is not a JSON object.
inline nlohmann::json case_object_from_flags(const CaseFlags& flags) {
  nlohmann::json object = nlohmann::json::object();
  if (!flags.case_json.empty()) {
    object = sim::parse_json(flags.case_json, "--case");  // bounded: length, depth, no key twice
    if (!object.is_object()) fail_input("--case", "must be a JSON object, got ", sim::excerpt(flags.case_json));
  }
  for (const auto& key : case_flags_detail::kKeys) {
    auto it = flags.values.find(key.name);
    if (it != flags.values.end()) object[key.name] = case_flags_detail::to_json(key, it->second);
  }
  if (!object.contains("seqlens_q")) fail_input("seqlens_q", "is required (give --seqlens-q or --case)");
  return object;
}

// The case from --case and the flags; InputError (exit code 2) naming the key and value on bad input.
inline sim::CaseSpec case_from_flags(const CaseFlags& flags) { return sim::parse_case(case_object_from_flags(flags)); }

}  // namespace cpgold::app
