#pragma once
/// @file Error types and the checking macros every layer uses.
#include <stdexcept>
#include <string>

namespace trisparse {

/// Base of every exception the library throws; what() names the culprit.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad user input: a malformed file, a wrong shape or dtype, an out-of-range id.
/// For files, what() reads "FILE:LINE: problem" (or "FILE[array]: problem" inside archives).
class invalid_input : public error {
 public:
  using error::error;
};

/// A CUDA runtime or library call failed; what() names the call, the file and the line.
class cuda_error : public error {
 public:
  using error::error;
};

/// The request is valid but this build or device cannot serve it (e.g. no CUDA backend).
class not_supported : public error {
 public:
  using error::error;
};

namespace detail {
/// Throws E with "source_file:line: message".
template <class E>
[[noreturn]] void fail_at(const char* file, int line, const std::string& message) {
  throw E(std::string(file) + ":" + std::to_string(line) + ": " + message);
}
}  // namespace detail

}  // namespace trisparse

/// Throws trisparse::error (with file and line) when cond is false.
#define TRISPARSE_EXPECTS(cond, message)                                                          \
  do {                                                                                            \
    if (!(cond)) ::trisparse::detail::fail_at<::trisparse::error>(__FILE__, __LINE__, (message)); \
  } while (0)

/// Throws trisparse::invalid_input (with file and line) when cond is false: for bad arguments.
#define TRISPARSE_EXPECTS_INPUT(cond, message)                                                 \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::trisparse::detail::fail_at<::trisparse::invalid_input>(__FILE__, __LINE__, (message)); \
  } while (0)
