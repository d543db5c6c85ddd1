#include "flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "bench_util.h"
#include "refit/status_format.h"

namespace refit::bench {

FlagSet::FlagSet(std::string program, std::string epilogue)
    : program_(std::move(program)), epilogue_(std::move(epilogue)) {}

void FlagSet::Add(Flag flag) {
  // Two declarations of one flag would make the second unreachable: a bug in the benchmark.
  if (std::any_of(flags_.begin(), flags_.end(),
                  [&](const Flag& other) { return other.name == flag.name; })) {
    std::fprintf(stderr, "%s: flag %s declared twice\n", program_.c_str(), flag.name.c_str());
    std::abort();
  }
  flags_.push_back(std::move(flag));
}

void FlagSet::Switch(std::string name, std::string help, std::function<void()> set) {
  Add(Flag{std::move(name), "", std::move(help),
           [set = std::move(set)](std::string_view, std::string_view) {
             set();
             return Status::OK();
           }});
}

void FlagSet::Switch(std::string name, std::string help, bool* target) {
  Switch(std::move(name), std::move(help), [target] { *target = true; });
}

void FlagSet::Value(std::string name, std::string value_name, std::string help, Setter set) {
  Add(Flag{std::move(name), std::move(value_name), std::move(help), std::move(set)});
}

void FlagSet::Text(std::string name, std::string value_name, std::string help,
                   std::string* target) {
  Value(std::move(name), std::move(value_name), std::move(help),
        [target](std::string_view, std::string_view text) {
          *target = std::string(text);
          return Status::OK();
        });
}

void FlagSet::Unsigned(std::string name, std::string value_name, std::string help,
                       std::optional<uint64_t>* target) {
  Value(std::move(name), std::move(value_name), std::move(help),
        [target](std::string_view flag, std::string_view text) -> Status {
          REFIT_ASSIGN_OR_RETURN(*target, ParseUnsigned(flag, text));
          return Status::OK();
        });
}

void FlagSet::Unsigned(std::string name, std::string value_name, std::string help,
                       uint64_t* target) {
  Value(std::move(name), std::move(value_name), std::move(help),
        [target](std::string_view flag, std::string_view text) -> Status {
          REFIT_ASSIGN_OR_RETURN(*target, ParseUnsigned(flag, text));
          return Status::OK();
        });
}

Status FlagSet::Parse(int argc, char** argv) const {
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    const auto flag = std::find_if(flags_.begin(), flags_.end(),
                                   [&](const Flag& candidate) { return candidate.name == name; });
    if (flag == flags_.end()) return InvalidArgument("unknown argument '{}'", name);
    std::string_view text;
    if (!flag->value_name.empty()) {
      if (i + 1 >= argc) return InvalidArgument("{} needs a value ({})", name, flag->value_name);
      text = argv[++i];
    }
    REFIT_RETURN_NOT_OK(flag->set(name, text));
  }
  return Status::OK();
}

std::string FlagSet::Usage() const {
  std::vector<std::string> heads;
  size_t width = 0;
  for (const Flag& flag : flags_) {
    heads.push_back(flag.value_name.empty() ? flag.name
                                            : fmt::format("{} {}", flag.name, flag.value_name));
    width = std::max(width, heads.back().size());
  }
  std::string usage = fmt::format("usage: {} [options]\n", program_);
  for (size_t f = 0; f < flags_.size(); ++f) {
    usage += fmt::format("  {:<{}}  {}\n", heads[f], width, flags_[f].help);
  }
  usage += epilogue_;
  return usage;
}

}  // namespace refit::bench
