#pragma once
// The CLI's subcommands: each registers its options on the app and runs when chosen.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "trisparse/graph/io.hpp"

namespace trisparse::cli {

using action = std::function<int()>;

action add_info(CLI::App& app);
action add_run(CLI::App& app);
action add_convert(CLI::App& app);
action add_generate(CLI::App& app);
action add_pattern(CLI::App& app);

/// --symmetry and --self-loops, shared by the commands that read graphs.
void add_read_options(CLI::App& cmd, read_options& options);

/// Reads a graph with a progress line.
csr_graph load(const std::string& path, const read_options& options);

}  // namespace trisparse::cli
