#pragma once
// Streaming byte sources for the readers: file or memory, optionally through gzip or xz, with a cap
// on decompressed bytes, and a line reader that counts lines for error messages.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trisparse/core/error.hpp"

namespace trisparse::io {

/// Throws invalid_input "name:line: message" (line 0 omitted).
[[noreturn]] void fail(std::string_view name, std::int64_t line, const std::string& message);

class byte_source {
 public:
  virtual ~byte_source() = default;
  /// Reads up to n bytes; returns 0 only at the end. Throws invalid_input on corrupt input.
  virtual std::size_t read(std::byte* buffer, std::size_t n) = 0;
};

enum class compression : std::uint8_t { none, gzip, xz };
compression detect_compression(std::span<const std::byte> head);

/// Opens raw bytes of a file (throws error naming the path if it cannot be opened).
std::unique_ptr<byte_source> open_file(const std::filesystem::path& path);
/// Bytes in memory (not copied: the span must outlive the source).
std::unique_ptr<byte_source> open_memory(std::span<const std::byte> bytes);
/// Wraps a source with a decompressor (none = unchanged) and a cap on bytes produced.
std::unique_ptr<byte_source> decompress(std::unique_ptr<byte_source> raw, compression c,
                                        std::string name, std::uint64_t max_bytes);
/// Reads everything (bounded by max_bytes; throws invalid_input past it).
std::vector<std::byte> read_all(byte_source& src, std::string_view name, std::uint64_t max_bytes);

/// Splits a source into lines ('\n', a trailing '\r' dropped); lines are capped in length.
class line_reader {
 public:
  line_reader(byte_source& src, std::string name);
  /// The next line, or false at the end. The view lives until the next call.
  bool next(std::string_view& line);
  std::int64_t line_number() const { return line_; }
  const std::string& name() const { return name_; }
  [[noreturn]] void fail(const std::string& message) const { io::fail(name_, line_, message); }

 private:
  static constexpr std::size_t kMaxLine = std::size_t{1} << 20;
  byte_source& src_;
  std::string name_;
  std::vector<std::byte> buf_;
  std::size_t begin_ = 0, end_ = 0;
  bool eof_ = false;
  std::string carry_;
  std::int64_t line_ = 0;
};

/// Splits a line into tokens at blanks and commas.
std::size_t tokenize(std::string_view line, std::string_view* out, std::size_t max_tokens);

/// Parses a whole token as a non-negative or signed integer / a finite float; false on failure.
bool parse_int(std::string_view token, std::int64_t& out);
bool parse_float(std::string_view token, double& out);

}  // namespace trisparse::io
