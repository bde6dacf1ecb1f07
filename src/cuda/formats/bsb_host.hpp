#pragma once
// The device BSB builder seen from the host (internal; tests compare it with build_bsb).
#include "../common/entry.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/graph/csr.hpp"

namespace trisparse {

/// The BSB (16x8 TCBs) that a CUDA attention plan builds, built on the current CUDA device and
/// copied back. @throws not_supported without the CUDA backend.
TRISPARSE_CUDA_ENTRY(bsb build_bsb_cuda(const csr_graph& pattern))

}  // namespace trisparse
