#include "trisparse/core/dtype.hpp"

#include "trisparse/core/error.hpp"

namespace trisparse {

std::string_view to_string(dtype t) {
  switch (t) {
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::f32:
      return "f32";
    case dtype::f64:
      return "f64";
  }
  return "?";
}

dtype parse_dtype(std::string_view name) {
  if (name == "f16" || name == "fp16" || name == "half" || name == "float16") return dtype::f16;
  if (name == "bf16" || name == "bfloat16") return dtype::bf16;
  if (name == "f32" || name == "fp32" || name == "float" || name == "float32") return dtype::f32;
  if (name == "f64" || name == "fp64" || name == "double" || name == "float64") return dtype::f64;
  throw invalid_input("unknown dtype '" + std::string(name) + "' (expected f16, bf16, f32 or f64)");
}

}  // namespace trisparse
