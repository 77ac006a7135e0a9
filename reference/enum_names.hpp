#pragma once
// The spelling of every value of an enum that is written in text, as one table (docs/layout.md, "One convention for
// enum names"): `X_name` and `parse_X` read the same table, so that a value and its spelling are written once.
//
//   constexpr std::pair<PadFill, std::string_view> kPadFillNames[] = {{PadFill::zero, "zero"}, ...};
//   std::string_view pad_fill_name(PadFill fill) { return name_in(kPadFillNames, fill); }
//
// A value the table does not hold (an integer cast to the enum) is spelled "?"; a spelling it does not hold parses to
// nullopt, and the caller that knows the field names it.
#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>

namespace cpgold {

template <typename Enum, std::size_t N>
constexpr std::string_view name_in(const std::pair<Enum, std::string_view> (&table)[N], Enum value) {
  for (const auto& [v, text] : table)
    if (v == value) return text;
  return "?";
}

template <typename Enum, std::size_t N>
constexpr std::optional<Enum> parse_in(const std::pair<Enum, std::string_view> (&table)[N], std::string_view text) {
  for (const auto& [v, spelled] : table)
    if (spelled == text) return v;
  return std::nullopt;
}

}  // namespace cpgold
