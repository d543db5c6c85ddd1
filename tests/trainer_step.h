// One simulated training step encoded as one transfer, as a trainer with W producers would send
// it: shared by the tests of everything that receives payloads (session, control plane, …).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "codec/tracker.h"
#include "receiver/receiver_session.h"
#include "refit/payload.h"
#include "test_data.h"

namespace refit::testing {

struct TrainerStep {
  TransferId id;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  /// An anchor: every element sent in FULL.
  bool anchor = false;
  std::vector<std::vector<std::byte>> payloads;
  std::vector<PayloadIds> ids;
  /// The items of each payload (to re-encode them differently).
  std::vector<std::vector<Item>> items;
  /// Per-producer payload counts and the producers' pending digests.
  TransferExpectation expected;
  uint64_t items_total = 0;
  uint64_t changed_elements = 0;
  /// The trainer's weights after the step.
  std::vector<OwnedTensor> next;
};

/// Open a transfer on `tracker` and encode `current` perturbed at `density`: every tensor split
/// into `spans` element ranges, one payload per range, range k of all tensors going to producer
/// k % producers (the upstream `chunk % W` ownership); `anchor`: a FULL transfer. The caller
/// commits or aborts the tracker.
inline TrainerStep EncodeTrainerStep(internal::DeltaTracker& tracker,
                                     const std::vector<OwnedTensor>& current, uint64_t seed,
                                     double density, uint32_t producers = 2, uint64_t spans = 1,
                                     bool anchor = false) {
  TrainerStep step;
  step.id = TransferId::Random();
  auto plan = tracker.Begin(step.id, anchor);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return step;
  step.anchor = plan->anchor;
  step.base_version = plan->base_version;
  step.target_version = plan->target_version;
  std::map<uint32_t, uint32_t> next_payload_id;
  uint64_t chunk = 0;
  for (size_t t = 0; t < current.size(); ++t) {
    step.next.push_back(Perturb(current[t], density, seed * 100 + t));
    const OwnedTensor& next = step.next.back();
    const uint64_t numel = next.view().numel();
    for (uint64_t s = 0; s < spans; ++s, ++chunk) {
      auto encoded =
          tracker.Encode(step.id, next.view(), numel * s / spans, numel * (s + 1) / spans);
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      if (!encoded.ok() || encoded->items.empty()) continue;
      const auto producer = static_cast<uint32_t>(chunk % producers);
      PayloadIds ids{step.id, producer, next_payload_id[producer]++, plan->base_version,
                     plan->target_version};
      std::vector<ItemView> views;
      for (const Item& item : encoded->items) {
        views.push_back(item.view());
        step.changed_elements += item.count;
      }
      step.items_total += views.size();
      auto bytes = EncodePayload(ids, views);
      EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
      step.payloads.push_back(std::move(bytes).ValueOrDie());
      step.ids.push_back(ids);
      step.items.push_back(std::move(encoded->items));
    }
  }
  step.expected.payloads_per_producer = std::move(next_payload_id);
  step.expected.digests = tracker.PendingDigests();
  return step;
}

}  // namespace refit::testing
