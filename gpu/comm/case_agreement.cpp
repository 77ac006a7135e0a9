// agree_on_case: SHA-256 of each rank's description, gathered over the rank channel.
#include "gpu/comm/case_agreement.hpp"

#include <sstream>

#include "reference/sha256.hpp"
#include "reference/input_error.hpp"

namespace cpgold::gpu {

void agree_on_case(RankChannel& channel, const std::string& description, const std::string& label, Seconds timeout) {
  const std::string mine = sha256_hex(description).substr(0, 16) + " " + label;
  const std::vector<std::string> all = channel.all_gather(mine, "case agreement", timeout);
  bool same = true;
  for (const std::string& other : all) same = same && other.substr(0, 16) == all[0].substr(0, 16);
  if (same) return;
  std::ostringstream message;
  message << "the ranks run different cases (case and layout hash per rank:";
  for (size_t r = 0; r < all.size(); ++r) message << " rank " << r << " " << all[r] << (r + 1 < all.size() ? ";" : "");
  message << "); every rank must be given the same fixture and options";
  throw InputError("case", message.str());
}

}  // namespace cpgold::gpu
