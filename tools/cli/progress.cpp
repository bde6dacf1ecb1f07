#include "progress.hpp"

#include <cstdio>

namespace trisparse::cli {

namespace {
bool g_quiet = false;
}

void set_quiet(bool quiet) { g_quiet = quiet; }

phase::phase(std::string name) : name_(std::move(name)), start_(std::chrono::steady_clock::now()) {
  if (!g_quiet) std::fprintf(stderr, "%s ...\n", name_.c_str());
}

phase::~phase() {
  if (!g_quiet) std::fprintf(stderr, "%s: done in %.3f s\n", name_.c_str(), seconds());
}

double phase::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

}  // namespace trisparse::cli
