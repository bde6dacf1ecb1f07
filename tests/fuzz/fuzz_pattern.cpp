// libFuzzer target for the block pattern file: any bytes either parse into a pattern that passes
// check(), describes itself, draws, and saves to the same bytes' pattern again, or throw
// invalid_input. Anything else - a crash, a sanitizer report, another exception type, a hang,
// unbounded memory - is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "trisparse/core/error.hpp"
#include "trisparse/formats/block_pattern.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace trisparse;
  try {
    const block_pattern p =
        parse_block_pattern(std::span(reinterpret_cast<const char*>(data), size), "fuzz-input");
    p.check();
    // Bound the work per input: a small file may hold many empty heads or a huge empty shape.
    if (p.num_heads() > 16 || p.block_rows() * p.block_cols() > (std::int64_t{1} << 22)) return 0;
    (void)stats(p);
    (void)render(p, 64, 4);
    const auto path = std::filesystem::temp_directory_path() /
                      ("trisparse_fuzz_pattern_" + std::to_string(::getpid()) + ".tsbp");
    save_block_pattern(p, path);
    const block_pattern q = load_block_pattern(path);
    std::filesystem::remove(path);
    if (q.heads != p.heads || q.order != p.order || q.made_by != p.made_by) __builtin_trap();
  } catch (const invalid_input&) {
  }
  return 0;
}
