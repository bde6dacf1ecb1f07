#pragma once
// Progress lines on stderr for the CLI's phases: "name ..." at the start, the time at the end.
#include <chrono>
#include <string>

namespace trisparse::cli {

void set_quiet(bool quiet);

class phase {
 public:
  explicit phase(std::string name);
  ~phase();
  phase(const phase&) = delete;
  phase& operator=(const phase&) = delete;
  double seconds() const;

 private:
  std::string name_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace trisparse::cli
