#include "refit/commit_policy.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit {

Result<CommitPolicy> ParseCommitPolicy(std::string_view text) {
  const auto refuse = [&] {
    return InvalidArgument(
        "commit policy '{}': expected 'all', 'quorum:N' (N ≥ 1 replicas), 'quorum:F' (a fraction "
        "of the replicas in (0, 1]) or 'quorum:P%' (a percentage in (0, 100])",
        text);
  };
  if (text == "all") return CommitPolicy{};
  constexpr std::string_view kQuorum = "quorum:";
  if (!text.starts_with(kQuorum)) return refuse();
  std::string_view value = text.substr(kQuorum.size());
  const bool percent = value.ends_with('%');
  if (percent) value.remove_suffix(1);
  if (value.empty()) return refuse();
  CommitPolicy policy;
  policy.kind = CommitPolicy::Kind::kQuorum;
  const bool integral = value.find_first_not_of("0123456789") == std::string_view::npos;
  if (integral && !percent) {
    uint64_t count = 0;
    const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), count);
    if (error != std::errc() || end != value.data() + value.size() || count > UINT32_MAX) {
      return refuse();
    }
    policy.count = static_cast<uint32_t>(count);
  } else {
    // std::from_chars for double is not in every standard library this builds with: strtod on a
    // copy, which must consume the whole text.
    const std::string copy(value);
    char* end = nullptr;
    const double number = std::strtod(copy.c_str(), &end);
    if (end != copy.c_str() + copy.size() || !std::isfinite(number)) return refuse();
    policy.fraction = percent ? number / 100.0 : number;
  }
  if (Status checked = CheckCommitPolicy(policy); !checked.ok()) {
    return InvalidArgument("commit policy '{}': {}", text, checked.message());
  }
  return policy;
}

std::string CommitPolicyName(const CommitPolicy& policy) {
  if (policy.kind == CommitPolicy::Kind::kAll) return "all";
  if (policy.count > 0) return fmt::format("quorum:{}", policy.count);
  return fmt::format("quorum:{}", policy.fraction);
}

Status CheckCommitPolicy(const CommitPolicy& policy) {
  if (policy.kind == CommitPolicy::Kind::kAll) return Status::OK();
  if (policy.count > 0) {
    if (policy.fraction != 0) {
      return InvalidArgument("a quorum names a count ({}) or a fraction ({}), not both",
                             policy.count, policy.fraction);
    }
    return Status::OK();
  }
  if (!(policy.fraction > 0 && policy.fraction <= 1)) {
    return InvalidArgument(
        "a quorum needs a count of replicas ≥ 1 or a fraction of them in (0, 1], got count 0 and "
        "fraction {}",
        policy.fraction);
  }
  return Status::OK();
}

Result<uint64_t> RequiredReplicas(const CommitPolicy& policy, uint64_t replicas) {
  REFIT_RETURN_NOT_OK(CheckCommitPolicy(policy));
  if (policy.kind == CommitPolicy::Kind::kAll) return replicas;
  if (policy.count > 0) {
    if (policy.count > replicas) {
      return InvalidArgument(
          "commit policy {}: the fleet has {} replica(s), fewer than the quorum of {} (a quorum "
          "counts replicas, every shard of a shard group together)",
          CommitPolicyName(policy), replicas, policy.count);
    }
    return policy.count;
  }
  // ⌈fraction × replicas⌉, computed so that 0.5 of 4 is exactly 2; at least one replica.
  const double exact = policy.fraction * static_cast<double>(replicas);
  uint64_t required = static_cast<uint64_t>(std::ceil(exact - 1e-9));
  if (required < 1) required = 1;
  if (required > replicas) required = replicas;
  return required;
}

}  // namespace refit
