#pragma once
// JSON on standard output. File names, group names and attribute values are bytes, not always UTF-8, and a JSON
// document must be: every byte that is not part of a valid UTF-8 sequence is written as the four characters \xHH
// (so the JSON string holds "\\xff"), the rest is kept. Every subcommand's --format json output goes through here.
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace cpgold::app {

// `bytes` with each byte outside a valid UTF-8 sequence (overlong forms, surrogates and code points past U+10FFFF
// included) replaced by the text \xHH.
inline std::string printable_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    size_t length = 0;
    uint32_t code = 0, min = 0;
    if (c < 0x80) length = 1, code = c;
    else if ((c & 0xE0) == 0xC0) length = 2, code = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) length = 3, code = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) length = 4, code = c & 0x07, min = 0x10000;
    bool valid = length > 0 && i + length <= n;
    for (size_t k = 1; valid && k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) valid = false;
      else code = (code << 6) | (s[i + k] & 0x3F);
    }
    if (valid && length > 1 && (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))) valid = false;
    if (valid) {
      out.append(bytes.substr(i, length));
      i += length;
      continue;
    }
    static const char* digits = "0123456789abcdef";
    out += "\\x";
    out += digits[c >> 4];
    out += digits[c & 15];
    ++i;
  }
  return out;
}

// The same tree with every string and key made printable (the trees cpgold builds are a few levels deep).
template <class Json>
Json printable(const Json& j) {
  if (j.is_string()) return printable_utf8(j.template get_ref<const std::string&>());
  if (j.is_array()) {
    Json out = Json::array();
    for (const auto& item : j) out.push_back(printable(item));
    return out;
  }
  if (j.is_object()) {
    Json out = Json::object();
    for (auto it = j.begin(); it != j.end(); ++it) out[printable_utf8(it.key())] = printable(it.value());
    return out;
  }
  return j;
}

template <class Json>
std::string json_text(const Json& j) {
  return printable(j).dump(2) + "\n";
}

// {"error": {"field", "message", "exit_code"}}: what --format json prints when a command cannot do its work.
inline std::string json_error_text(const std::string& field, const std::string& message, int exit_code) {
  nlohmann::ordered_json j;
  j["error"] = {{"field", field}, {"message", message}, {"exit_code", exit_code}};
  return json_text(j);
}

}  // namespace cpgold::app
