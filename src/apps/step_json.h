// One JSON line per refit step: what `refit demo` and its MPI form print with --json, so that a
// script reads both the same way.
#pragma once

#include <nlohmann/json.hpp>

#include "refit/refit_report.h"

namespace refit::cli {

/// The step's figures: `step`, `kind` (full or delta), `version`, `density` (changed ÷ total
/// elements), `changed`, `payloads`, `wire_bytes`, the
/// FULL's `full_wire_bytes` and `bytes_saved` against it, the phase times (`time_s`,
/// `prepare_s`, `stream_s`, `flush_s`, `commit_s`), `speedup_vs_full`, `raw_copy_s` and
/// `time_over_raw_copy` (lower is better: below 1 the step beat a plain broadcast of the model),
/// and `receivers`. Callers add their own keys.
nlohmann::json StepJson(int step, const RefitReport& report, const RefitReport& full,
                        double raw_copy_s);

}  // namespace refit::cli
