#include "source.hpp"

#include <lzma.h>
#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

namespace trisparse::io {

void fail(std::string_view name, std::int64_t line, const std::string& message) {
  std::string where(name);
  if (line > 0) where += ":" + std::to_string(line);
  throw invalid_input(where + ": " + message);
}

compression detect_compression(std::span<const std::byte> head) {
  const auto at = [&](std::size_t i) { return std::to_integer<unsigned>(head[i]); };
  if (head.size() >= 2 && at(0) == 0x1F && at(1) == 0x8B) return compression::gzip;
  if (head.size() >= 6 && at(0) == 0xFD && at(1) == '7' && at(2) == 'z' && at(3) == 'X' &&
      at(4) == 'Z' && at(5) == 0) {
    return compression::xz;
  }
  return compression::none;
}

namespace {

class file_source final : public byte_source {
 public:
  explicit file_source(const std::filesystem::path& path) : f_(std::fopen(path.c_str(), "rb")) {
    if (f_ == nullptr) {
      throw invalid_input(path.string() + ": cannot open (" + std::string(std::strerror(errno)) +
                          ")");
    }
  }
  ~file_source() override { std::fclose(f_); }
  file_source(const file_source&) = delete;
  file_source& operator=(const file_source&) = delete;
  std::size_t read(std::byte* buffer, std::size_t n) override {
    return std::fread(buffer, 1, n, f_);
  }

 private:
  std::FILE* f_;
};

class memory_source final : public byte_source {
 public:
  explicit memory_source(std::span<const std::byte> bytes) : bytes_(bytes) {}
  std::size_t read(std::byte* buffer, std::size_t n) override {
    const std::size_t k = std::min(n, bytes_.size() - pos_);
    std::memcpy(buffer, bytes_.data() + pos_, k);
    pos_ += k;
    return k;
  }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
};

// Common shape of the two decompressors: pull input in chunks, push output, cap the total.
class inflating_source : public byte_source {
 public:
  inflating_source(std::unique_ptr<byte_source> raw, std::string name, std::uint64_t max_bytes)
      : raw_(std::move(raw)), name_(std::move(name)), max_(max_bytes), in_(kChunk) {}

 protected:
  static constexpr std::size_t kChunk = std::size_t{1} << 16;
  std::size_t refill() {
    const std::size_t k = raw_->read(in_.data(), in_.size());
    if (k == 0) raw_eof_ = true;
    return k;
  }
  void count(std::size_t produced) {
    total_ += produced;
    if (total_ > max_) {
      fail(name_, 0, "decompressed data exceeds the limit of " + std::to_string(max_) + " bytes");
    }
  }
  std::unique_ptr<byte_source> raw_;
  std::string name_;
  std::uint64_t max_;
  std::uint64_t total_ = 0;
  std::vector<std::byte> in_;
  bool raw_eof_ = false;
  bool done_ = false;
};

class gzip_source final : public inflating_source {
 public:
  gzip_source(std::unique_ptr<byte_source> raw, std::string name, std::uint64_t max_bytes)
      : inflating_source(std::move(raw), std::move(name), max_bytes) {
    if (inflateInit2(&z_, 15 + 16) != Z_OK) fail(name_, 0, "cannot initialise gzip decoder");
  }
  ~gzip_source() override { inflateEnd(&z_); }
  gzip_source(const gzip_source&) = delete;
  gzip_source& operator=(const gzip_source&) = delete;

  std::size_t read(std::byte* buffer, std::size_t n) override {
    if (done_ || n == 0) return 0;
    z_.next_out = reinterpret_cast<Bytef*>(buffer);
    z_.avail_out = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    while (z_.avail_out > 0) {
      if (z_.avail_in == 0) {
        const std::size_t k = refill();
        if (k == 0) {
          if (in_member_) fail(name_, 0, "truncated gzip stream");
          done_ = true;
          break;
        }
        z_.next_in = reinterpret_cast<Bytef*>(in_.data());
        z_.avail_in = static_cast<uInt>(k);
      }
      in_member_ = true;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        in_member_ = false;  // concatenated members: start the next one if bytes follow
        if (inflateReset(&z_) != Z_OK) fail(name_, 0, "gzip decoder reset failed");
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        fail(name_, 0,
             std::string("corrupt gzip stream (") + (z_.msg ? z_.msg : "zlib error") + ")");
      }
    }
    const std::size_t produced = n - z_.avail_out;
    count(produced);
    return produced;
  }

 private:
  z_stream z_{};
  bool in_member_ = false;
};

class xz_source final : public inflating_source {
 public:
  xz_source(std::unique_ptr<byte_source> raw, std::string name, std::uint64_t max_bytes)
      : inflating_source(std::move(raw), std::move(name), max_bytes) {
    if (lzma_stream_decoder(&z_, std::uint64_t{1} << 30, LZMA_CONCATENATED) != LZMA_OK) {
      fail(name_, 0, "cannot initialise xz decoder");
    }
  }
  ~xz_source() override { lzma_end(&z_); }
  xz_source(const xz_source&) = delete;
  xz_source& operator=(const xz_source&) = delete;

  std::size_t read(std::byte* buffer, std::size_t n) override {
    if (done_ || n == 0) return 0;
    z_.next_out = reinterpret_cast<std::uint8_t*>(buffer);
    z_.avail_out = n;
    while (z_.avail_out > 0) {
      lzma_action action = LZMA_RUN;
      if (z_.avail_in == 0 && !raw_eof_) {
        const std::size_t k = refill();
        z_.next_in = reinterpret_cast<const std::uint8_t*>(in_.data());
        z_.avail_in = k;
      }
      if (raw_eof_) action = LZMA_FINISH;
      const lzma_ret rc = lzma_code(&z_, action);
      if (rc == LZMA_STREAM_END) {
        done_ = true;
        break;
      }
      if (rc == LZMA_BUF_ERROR && raw_eof_) fail(name_, 0, "truncated xz stream");
      if (rc != LZMA_OK && rc != LZMA_BUF_ERROR) {
        fail(name_, 0,
             rc == LZMA_MEMLIMIT_ERROR
                 ? "xz stream needs more than 1 GiB to decode"
                 : "corrupt xz stream (lzma error " + std::to_string(static_cast<int>(rc)) + ")");
      }
    }
    const std::size_t produced = n - z_.avail_out;
    count(produced);
    return produced;
  }

 private:
  lzma_stream z_ = LZMA_STREAM_INIT;
};

}  // namespace

std::unique_ptr<byte_source> open_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw invalid_input(path.string() + ": is a directory");
  return std::make_unique<file_source>(path);
}

std::unique_ptr<byte_source> open_memory(std::span<const std::byte> bytes) {
  return std::make_unique<memory_source>(bytes);
}

std::unique_ptr<byte_source> decompress(std::unique_ptr<byte_source> raw, compression c,
                                        std::string name, std::uint64_t max_bytes) {
  switch (c) {
    case compression::gzip:
      return std::make_unique<gzip_source>(std::move(raw), std::move(name), max_bytes);
    case compression::xz:
      return std::make_unique<xz_source>(std::move(raw), std::move(name), max_bytes);
    case compression::none:
      break;
  }
  return raw;
}

std::vector<std::byte> read_all(byte_source& src, std::string_view name, std::uint64_t max_bytes) {
  std::vector<std::byte> out;
  std::size_t size = 0;
  while (true) {
    if (out.size() - size < (std::size_t{1} << 16))
      out.resize(std::max<std::size_t>(1 << 17, out.size() * 2));
    const std::size_t k = src.read(out.data() + size, out.size() - size);
    if (k == 0) break;
    size += k;
    if (size > max_bytes)
      fail(name, 0, "input exceeds the limit of " + std::to_string(max_bytes) + " bytes");
  }
  out.resize(size);
  return out;
}

line_reader::line_reader(byte_source& src, std::string name)
    : src_(src), name_(std::move(name)), buf_(std::size_t{1} << 16) {}

bool line_reader::next(std::string_view& line) {
  carry_.clear();
  while (true) {
    if (begin_ == end_) {
      if (eof_) break;
      end_ = src_.read(buf_.data(), buf_.size());
      begin_ = 0;
      if (end_ == 0) {
        eof_ = true;
        break;
      }
    }
    const char* base = reinterpret_cast<const char*>(buf_.data());
    const void* nl = std::memchr(base + begin_, '\n', end_ - begin_);
    if (nl != nullptr) {
      const std::size_t stop = static_cast<const char*>(nl) - base;
      ++line_;
      if (carry_.empty()) {
        line = std::string_view(base + begin_, stop - begin_);
      } else {
        carry_.append(base + begin_, stop - begin_);
        line = carry_;
      }
      begin_ = stop + 1;
      if (line.size() > kMaxLine) fail("line longer than " + std::to_string(kMaxLine) + " bytes");
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      return true;
    }
    carry_.append(base + begin_, end_ - begin_);
    begin_ = end_;
    if (carry_.size() > kMaxLine) {
      ++line_;
      fail("line longer than " + std::to_string(kMaxLine) + " bytes");
    }
  }
  if (carry_.empty()) return false;
  ++line_;
  line = carry_;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return true;
}

std::size_t tokenize(std::string_view line, std::string_view* out, std::size_t max_tokens) {
  std::size_t n = 0, i = 0;
  const auto sep = [](char c) {
    return c == ' ' || c == '\t' || c == ',' || c == '\r' || c == '\v' || c == '\f';
  };
  while (i < line.size()) {
    while (i < line.size() && sep(line[i])) ++i;
    if (i == line.size()) break;
    const std::size_t start = i;
    while (i < line.size() && !sep(line[i])) ++i;
    if (n < max_tokens) out[n] = line.substr(start, i - start);
    ++n;
  }
  return n;
}

bool parse_int(std::string_view token, std::int64_t& out) {
  if (!token.empty() && token.front() == '+') token.remove_prefix(1);
  const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), out);
  return ec == std::errc() && ptr == token.data() + token.size() && !token.empty();
}

bool parse_float(std::string_view token, double& out) {
  if (!token.empty() && token.front() == '+') token.remove_prefix(1);
  const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), out);
  return ec == std::errc() && ptr == token.data() + token.size() && !token.empty() &&
         std::isfinite(out);
}

}  // namespace trisparse::io
