#include "step_json.h"

#include <algorithm>
#include <cstdint>

namespace refit::cli {
namespace {

/// Seconds below which a time is taken as zero in a ratio (a clock's resolution).
constexpr double kMinSeconds = 1e-9;

}  // namespace

nlohmann::json StepJson(int step, const RefitReport& report, const RefitReport& full,
                        double raw_copy_s) {
  const double density = report.total_elements > 0 ? static_cast<double>(report.changed_elements) /
                                                         static_cast<double>(report.total_elements)
                                                   : 0.0;
  return {{"step", step},
          {"kind", report.plan.anchor ? "full" : "delta"},
          {"version", report.plan.target_version},
          {"density", density},
          {"changed", report.changed_elements},
          {"payloads", report.payloads},
          {"wire_bytes", report.wire_bytes},
          {"full_wire_bytes", full.wire_bytes},
          {"bytes_saved", 1.0 - static_cast<double>(report.wire_bytes) /
                                    static_cast<double>(std::max<uint64_t>(full.wire_bytes, 1))},
          {"time_s", report.total_s},
          {"prepare_s", report.prepare_s},
          {"stream_s", report.stream_s},
          {"flush_s", report.flush_s},
          {"commit_s", report.commit_s},
          {"speedup_vs_full", full.total_s / std::max(report.total_s, kMinSeconds)},
          {"raw_copy_s", raw_copy_s},
          {"time_over_raw_copy", report.total_s / std::max(raw_copy_s, kMinSeconds)},
          {"receivers", report.receivers.size()}};
}

}  // namespace refit::cli
