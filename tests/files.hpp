#pragma once
// Writing test files: plain, gzip, xz, npy and npz (through the same libraries the readers use).
#include <lzma.h>
#include <unistd.h>
#include <zip.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "support.hpp"

namespace trisparse::test {

/// A fresh temporary folder, removed at the end of the test.
class temp_dir {
 public:
  temp_dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("trisparse_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~temp_dir() { std::filesystem::remove_all(path_); }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::string write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

inline std::string write_bytes(const std::filesystem::path& p,
                               const std::vector<unsigned char>& bytes) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()),
             static_cast<std::streamsize>(bytes.size()));
  return p.string();
}

inline std::vector<unsigned char> read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline std::string write_gzip(const std::filesystem::path& p, const std::string& text) {
  gzFile f = gzopen(p.c_str(), "wb");
  gzwrite(f, text.data(), static_cast<unsigned>(text.size()));
  gzclose(f);
  return p.string();
}

inline std::vector<unsigned char> xz_bytes(const std::string& text) {
  std::vector<unsigned char> out(text.size() + 1024);
  std::size_t pos = 0;
  lzma_easy_buffer_encode(6, LZMA_CHECK_CRC64, nullptr,
                          reinterpret_cast<const std::uint8_t*>(text.data()), text.size(),
                          out.data(), &pos, out.size());
  out.resize(pos);
  return out;
}

/// .npy bytes for a C-order array.
template <class T>
std::vector<unsigned char> npy_bytes(const std::string& descr,
                                     const std::vector<std::int64_t>& shape,
                                     const std::vector<T>& data) {
  const auto tmp = std::filesystem::temp_directory_path() /
                   ("trisparse_npy_" + std::to_string(::getpid()) + ".npy");
  write_npy(tmp, descr, shape, data.data(), data.size() * sizeof(T));
  auto bytes = read_bytes(tmp);
  std::filesystem::remove(tmp);
  return bytes;
}

/// An .npz with the given members (name -> .npy bytes), deflated or stored.
inline std::string write_npz(const std::filesystem::path& p,
                             const std::map<std::string, std::vector<unsigned char>>& members,
                             bool deflate = true) {
  int err = 0;
  zip_t* z = zip_open(p.c_str(), ZIP_CREATE | ZIP_TRUNCATE, &err);
  std::vector<std::vector<unsigned char>> keep;
  for (const auto& [name, bytes] : members) {
    keep.push_back(bytes);
    zip_source_t* s = zip_source_buffer(z, keep.back().data(), keep.back().size(), 0);
    const zip_int64_t idx = zip_file_add(z, name.c_str(), s, ZIP_FL_OVERWRITE);
    zip_set_file_compression(z, static_cast<zip_uint64_t>(idx),
                             deflate ? ZIP_CM_DEFLATE : ZIP_CM_STORE, 0);
  }
  zip_close(z);
  return p.string();
}

/// Expects read_graph(path) to throw invalid_input whose message contains every fragment.
inline void expect_invalid(const std::string& path, const std::vector<std::string>& fragments,
                           const read_options& options = {}) {
  try {
    (void)read_graph(path, options);
    ADD_FAILURE() << path << ": no exception";
  } catch (const invalid_input& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    for (const auto& f : fragments)
      EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

}  // namespace trisparse::test
