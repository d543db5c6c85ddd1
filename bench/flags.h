// A benchmark's command line as a table: every flag is declared once, with the name of its value,
// its help and what it sets, so that the parser, the usage text and the flag's error messages
// come from one place. e2e_bench and s3_bench declare theirs with it.
#pragma once

#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::bench {

class FlagSet {
 public:
  /// Sets a flag's value from its text; `flag` is the flag's name, for the error.
  using Setter = std::function<Status(std::string_view flag, std::string_view text)>;

  /// `program` heads the usage text; `epilogue` (may be empty) ends it.
  FlagSet(std::string program, std::string epilogue);

  /// A flag without a value, which runs `set`.
  void Switch(std::string name, std::string help, std::function<void()> set);
  /// A flag without a value, which sets `*target` to true.
  void Switch(std::string name, std::string help, bool* target);
  /// A flag with a value, named `value_name` in the usage text.
  void Value(std::string name, std::string value_name, std::string help, Setter set);
  /// A flag whose value is taken as it is.
  void Text(std::string name, std::string value_name, std::string help, std::string* target);
  /// A flag whose value is a non-negative integer (ParseUnsigned).
  void Unsigned(std::string name, std::string value_name, std::string help,
                std::optional<uint64_t>* target);
  void Unsigned(std::string name, std::string value_name, std::string help, uint64_t* target);

  /// Walk argv[1…] once, calling each flag's setter in order. Errors: InvalidArgument for an
  /// unknown flag or a flag without its value; a setter's error as it is.
  Status Parse(int argc, char** argv) const;

  /// "usage: program [options]", then a line per flag with its value and help, then the epilogue.
  std::string Usage() const;

 private:
  struct Flag {
    std::string name;
    std::string value_name;  // empty: a switch
    std::string help;
    Setter set;
  };
  void Add(Flag flag);

  std::string program_;
  std::string epilogue_;
  std::vector<Flag> flags_;
};

/// A benchmark's exit code from its parsed flags (an Args with a `help` field) and `run` (a
/// Status of the Args): a flag error prints the error and `usage` (2), --help prints `usage` (0),
/// and a run prints its error (1) or succeeds (0).
template <typename Args, typename Run>
int RunBenchmark(std::string_view program, const Result<Args>& args, const std::string& usage,
                 Run&& run) {
  if (!args.ok()) {
    std::cerr << program << ": " << args.status().message() << "\n" << usage;
    return 2;
  }
  if (args->help) {
    std::cout << usage;
    return 0;
  }
  const Status status = run(*args);
  if (!status.ok()) {
    std::cerr << program << ": " << status.ToString() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace refit::bench
