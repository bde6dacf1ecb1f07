#pragma once
// Helpers shared by the tests: random patterns of awkward shapes, error measures, dataset lookup.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "trisparse/trisparse.hpp"

namespace trisparse::test {

/// ../shared/datasets (or $TRISPARSE_DATASETS), or "" when absent.
inline std::filesystem::path datasets_dir() {
  if (const char* env = std::getenv("TRISPARSE_DATASETS"))  // (a folder not there: skipped)
    return std::filesystem::is_directory(env) ? std::filesystem::path(env)
                                              : std::filesystem::path{};
  const std::filesystem::path p = TRISPARSE_DATASETS_DIR;
  return std::filesystem::exists(p / "MANIFEST.md") ? p : std::filesystem::path{};
}

#define TRISPARSE_SKIP_WITHOUT_DATASETS()                                                \
  do {                                                                                   \
    if (::trisparse::test::datasets_dir().empty())                                       \
      GTEST_SKIP() << "../shared/datasets not found (set TRISPARSE_DATASETS): skipping"; \
  } while (0)

/// Every graph file (*.el.xz) in the datasets folder, sorted; $TRISPARSE_TEST_GRAPHS, a comma
/// list of names ("cora,musae_github"), keeps only those (the sanitizer runs use it: the tools slow
/// kernels 10-100x, and the kernels' code paths, not the graphs' sizes, are what they check).
inline std::vector<std::filesystem::path> dataset_graphs() {
  std::vector<std::filesystem::path> out;
  const auto dir = datasets_dir();
  if (dir.empty()) return out;
  const char* only = std::getenv("TRISPARSE_TEST_GRAPHS");
  const std::string keep = only != nullptr ? "," + std::string(only) + "," : "";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(".el.xz")) continue;
    if (!keep.empty() &&
        keep.find("," + name.substr(0, name.size() - 6) + ",") == std::string::npos)
      continue;
    out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// A random pattern: each row draws a degree in [0, max_degree] (so some rows are empty);
/// optional duplicates-free. Rectangular when cols != rows.
inline csr_graph random_pattern(std::int64_t rows, std::int64_t cols, std::int64_t max_degree,
                                std::uint64_t seed, bool with_values = false) {
  rng r(seed);
  coo_graph coo;
  coo.rows = rows;
  coo.cols = cols;
  for (std::int64_t i = 0; i < rows; ++i) {
    const auto deg = static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(max_degree + 1)));
    for (std::int64_t k = 0; k < deg && cols > 0; ++k) {
      coo.src.push_back(i);
      coo.dst.push_back(static_cast<std::int64_t>(r.below(static_cast<std::uint64_t>(cols))));
      if (with_values) coo.values.push_back(static_cast<float>(0.5 + r.uniform()));
    }
  }
  return to_csr(coo);
}

/// A band of half-width `half` around the diagonal of an n x n pattern with its rows and columns
/// shuffled alike (reverse Cuthill-McKee restores the band: a plan's automatic order takes it).
inline csr_graph shuffled_band(std::int64_t n, std::int64_t half, std::uint64_t seed) {
  std::vector<std::int64_t> shuffled(static_cast<std::size_t>(n));
  std::iota(shuffled.begin(), shuffled.end(), 0);
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(seed));
  coo_graph band{.rows = n, .cols = n, .src = {}, .dst = {}, .values = {}};
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = std::max<std::int64_t>(0, i - half); j <= std::min(n - 1, i + half);
         ++j) {
      band.src.push_back(shuffled[static_cast<std::size_t>(i)]);
      band.dst.push_back(shuffled[static_cast<std::size_t>(j)]);
    }
  return to_csr(band);
}

/// random_pattern(rows, cols, max_degree, seed) with row 5 attending columns 0..hub-1 and column
/// 3 attended by rows 50..hub+49 (a hub row and column, cut into chunks by the plans).
inline csr_graph pattern_with_hubs(std::int64_t rows, std::int64_t cols, std::int64_t max_degree,
                                   std::int64_t hub, std::uint64_t seed) {
  coo_graph coo = to_coo(random_pattern(rows, cols, max_degree, seed));
  for (std::int64_t j = 0; j < hub; ++j) {
    coo.src.push_back(5);
    coo.dst.push_back(j);
    coo.src.push_back(j + 50);
    coo.dst.push_back(3);
  }
  return to_csr(coo);
}

/// max |a - b| / max |b| over all elements (normwise relative error), and whether all are finite.
struct error_report {
  double max_abs = 0, max_ref = 0;
  bool finite = true;
  double relative() const { return max_abs / std::max(max_ref, 1e-300); }
};
inline error_report compare(const host_tensor& got, const host_tensor& ref) {
  error_report e;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got.get(i), r = ref.get(i);
    e.finite = e.finite && std::isfinite(g);
    e.max_abs = std::max(e.max_abs, std::abs(g - r));
    e.max_ref = std::max(e.max_ref, std::abs(r));
  }
  return e;
}

/// Random Q/K/V for a pattern. lo = -1 gives signed inputs (negative and zero scores occur).
struct qkv {
  host_tensor q, k, v;
};
inline qkv random_qkv(const csr_graph& g, std::int64_t heads, std::int64_t dim, dtype t,
                      std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  qkv x{host_tensor(t, g.rows, heads, dim), host_tensor(t, g.cols, heads, dim),
        host_tensor(t, g.cols, heads, dim)};
  x.q.fill_uniform(lo, hi, seed);
  x.k.fill_uniform(lo, hi, seed + 1);
  x.v.fill_uniform(lo, hi, seed + 2);
  return x;
}

}  // namespace trisparse::test
