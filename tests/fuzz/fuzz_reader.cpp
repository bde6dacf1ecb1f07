// libFuzzer target for one reader (chosen at compile time): any bytes either parse into a graph
// that passes check() and builds every format, or throw invalid_input. Anything else - a crash, a
// sanitizer report, another exception type, a hang, unbounded memory - is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "trisparse/core/error.hpp"
#include "trisparse/formats/bsb.hpp"
#include "trisparse/formats/me_bcrs.hpp"
#include "trisparse/graph/io.hpp"

#define TRISPARSE_STR2(x) #x
#define TRISPARSE_STR(x) TRISPARSE_STR2(x)

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace trisparse;
  read_options options;
  options.format = parse_file_format(TRISPARSE_STR(TRISPARSE_FUZZ_FORMAT));
  options.max_bytes = std::uint64_t{1} << 24;
  try {
    const loaded_graph g = read_edges_from_memory(
        std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz-input", options);
    // Bound the work per input: a tiny file may declare a huge node count.
    if (g.edges.rows > (1 << 16) || g.edges.cols > (1 << 16)) return 0;
    const csr_graph csr = to_csr(g.edges, {.symmetrize = g.edges.rows == g.edges.cols});
    csr.check();
    csr_graph pattern = csr;  // BSB is binary: its round trip gives the pattern back
    pattern.values.clear();
    if (to_csr(build_bsb(csr)) != pattern) __builtin_trap();
    build_me_bcrs(csr).check();
  } catch (const invalid_input&) {
  }
  return 0;
}
