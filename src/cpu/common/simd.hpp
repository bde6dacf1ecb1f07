// Eight floats as one vector (GCC and Clang's vector extension): AVX registers in the functions
// cloned for AVX2, two SSE registers in the default clones. Moved in and out with memcpy
// (unaligned), and never passed across a call (the AVX ABI would differ between the clones).
#pragma once

namespace trisparse::cpu {

using v8 = float __attribute__((vector_size(32)));

}  // namespace trisparse::cpu
