#pragma once
/// @file Element types of dense tensors.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace trisparse {

/// Element type of a dense tensor.
enum class dtype : std::uint8_t { f16, bf16, f32, f64 };

/// Bytes per element.
constexpr std::size_t size_of(dtype t) {
  switch (t) {
    case dtype::f16:
    case dtype::bf16:
      return 2;
    case dtype::f32:
      return 4;
    case dtype::f64:
      return 8;
  }
  return 0;
}

/// "f16", "bf16", "f32" or "f64".
std::string_view to_string(dtype t);

/// Parses the names to_string gives (also "fp16", "half", "float", "double", "bfloat16").
/// @throws invalid_input for any other name.
dtype parse_dtype(std::string_view name);

}  // namespace trisparse
