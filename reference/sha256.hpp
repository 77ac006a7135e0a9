#pragma once
// SHA-256 (FIPS 180-4) of a byte string, as lowercase hex: the digests of fixtures/data/golden/MANIFEST.json.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cpgold {

std::string sha256_hex(const uint8_t* data, size_t size);

// The same digest over bytes given in pieces (the inputs digest hashes four datasets one after the other).
class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t size);
  std::string hex();  // finishes the digest; update() may not be called afterwards

 private:
  uint32_t state_[8];
  uint8_t block_[64] = {};
  size_t in_block_ = 0;
  uint64_t total_ = 0;
};
inline std::string sha256_hex(const std::string& bytes) {
  return sha256_hex(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// True for a lowercase hex SHA-256 (64 characters of 0-9, a-f).
bool is_sha256_hex(std::string_view text);

}  // namespace cpgold
