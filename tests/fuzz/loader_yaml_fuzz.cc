// libFuzzer target for refit::LoaderSpecFromYaml, a receiver's loader spec (`--loader`): hostile
// YAML (and hostile regular expressions in it) must come back as InvalidArgument, never a crash
// or an uncaught yaml-cpp / std::regex exception.
//
// Invariants for a spec that parses: tp_rank < tp_size, every rule's kind is named and parses
// back (ParseLoaderKind), and parsing again gives the same spec.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "refit/loader.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "loader_yaml_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

bool SameRule(const refit::LoaderRule& a, const refit::LoaderRule& b) {
  return a.kind == b.kind && a.match == b.match && a.to == b.to && a.q == b.q && a.k == b.k &&
         a.v == b.v && a.gate == b.gate && a.up == b.up && a.num_heads == b.num_heads &&
         a.num_kv_heads == b.num_kv_heads && a.vocab_size == b.vocab_size && a.pad_to == b.pad_to;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  refit::Result<refit::LoaderSpec> spec = refit::LoaderSpecFromYaml(text, "fuzz-loader.yaml");
  if (!spec.ok()) {
    Check(spec.status().code() == refit::StatusCode::kInvalidArgument,
          "a loader spec error that is not InvalidArgument");
    return 0;
  }
  Check(spec->tp_size > 0 && spec->tp_rank < spec->tp_size, "tp_rank outside [0, tp_size)");
  for (const refit::LoaderRule& rule : spec->rules) {
    refit::Result<refit::LoaderKind> kind =
        refit::ParseLoaderKind(refit::LoaderKindName(rule.kind));
    Check(kind.ok() && *kind == rule.kind, "a rule kind that does not name itself");
  }
  refit::Result<refit::LoaderSpec> again = refit::LoaderSpecFromYaml(text, "fuzz-loader.yaml");
  Check(again.ok() && again->tp_rank == spec->tp_rank && again->tp_size == spec->tp_size &&
            again->rules.size() == spec->rules.size(),
        "LoaderSpecFromYaml is not deterministic");
  for (size_t i = 0; i < spec->rules.size(); ++i) {
    Check(SameRule(again->rules[i], spec->rules[i]), "LoaderSpecFromYaml is not deterministic");
  }
  return 0;
}
