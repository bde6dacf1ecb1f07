// trisparse: sparse attention and sparse formats from the command line.
#include <cstdio>
#include <exception>
#include <new>

#include "commands.hpp"
#include "progress.hpp"
#include "trisparse/core/error.hpp"

namespace {

int run_cli(int argc, char** argv) {
  CLI::App app{
      "trisparse: sparse attention O = softmax(scale (Q K^T ⊙ A)) V and its sparse formats"};
  app.require_subcommand(1);
  bool quiet = false;
  app.add_flag("-q,--quiet", quiet, "no progress lines on stderr");
  using trisparse::cli::action;
  const action info = trisparse::cli::add_info(app);
  const action run = trisparse::cli::add_run(app);
  const action convert = trisparse::cli::add_convert(app);
  const action generate = trisparse::cli::add_generate(app);
  const action pattern = trisparse::cli::add_pattern(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  trisparse::cli::set_quiet(quiet);
  try {
    for (auto* sub : app.get_subcommands()) {
      const std::string name = sub->get_name();
      if (name == "info") return info();
      if (name == "run") return run();
      if (name == "convert") return convert();
      if (name == "generate") return generate();
      if (name == "pattern") return pattern();
    }
  } catch (const trisparse::invalid_input& e) {
    std::fprintf(stderr, "trisparse: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "trisparse: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trisparse: error: %s\n", e.what());
    return 1;
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run_cli(argc, argv);
  } catch (...) {  // nothing escapes main: the library's errors are handled in run_cli
    std::fputs("trisparse: error: unexpected exception\n", stderr);
    return 1;
  }
}
