// The elastic section (sections.h): a fleet of 8 in which a newcomer (step-0 weights) and a
// laggard (3 versions behind) join between syncs. The join sync runs twice from the same seed:
// once as today's whole-fleet anchor and once under per-receiver plans; then the newcomer's
// catch-up against the raw copy of the model to one receiver, and the laggard's folded bytes
// against the deltas it missed. Last, a second newcomer with no weights copies a member (a peer
// replica) and joins: its copy against the same raw copy, and the next sync's egress, which must
// be the fleet's delta alone.
#include "e2e/sections.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "codec/delta_history.h"
#include "codec/tracker.h"
#include "e2e/harness.h"
#include "pipeline/producer_stream.h"
#include "raw_copy.h"
#include "refit/chunk_source.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/status_format.h"
#include "table.h"
#include "testing/loopback_ports.h"

namespace refit::bench::e2e {
namespace {

constexpr size_t kFleet = 8;  // 6 members, a laggard and a newcomer.
// The receiver that then joins by copying a member (a peer replica); its port is the last.
constexpr size_t kPeerNewcomer = kFleet;
constexpr size_t kMembers = 6;
constexpr uint64_t kLaggardBehind = 3;
constexpr uint32_t kRanks = 2;
// The target: a catch-up within 1.3 × the raw copy of the model to that receiver.
constexpr double kCatchUpTarget = 1.3;

// One receiver of this process over a copy of the model, on loopback sockets.
struct Node {
  std::vector<std::vector<std::byte>> buffers;
  std::unique_ptr<ReceiverNode> node;
  double start_s = 0;  // Its Start (with a peer: the copy, verified, until it serves).
};

// `peer`: the control URL of a member to copy the fleet's version from before serving (empty:
// none).
Result<std::unique_ptr<Node>> StartNode(const std::vector<TensorView>& model, uint16_t port,
                                        const std::string& peer = {}) {
  auto node = std::make_unique<Node>();
  ReceiverNodeOptions options;
  options.transport_uri = "zmq://?timeout_ms=60000";
  options.data_endpoint = fmt::format("127.0.0.1:{}", port);
  options.bootstrap_peer = peer;
  REFIT_ASSIGN_OR_RETURN(node->node, ReceiverNode::Make(options));
  for (const TensorView& tensor : model) {
    node->buffers.emplace_back(tensor.bytes.begin(), tensor.bytes.end());
    REFIT_RETURN_NOT_OK(node->node->RegisterTensor(
        MutableTensorView{tensor.name, tensor.dtype, tensor.shape, node->buffers.back()}));
  }
  const double start = Now();
  REFIT_RETURN_NOT_OK(node->node->Start());
  node->start_s = Now() - start;
  return node;
}

// What one join sync did.
struct JoinRun {
  RefitReport report;
  uint64_t member_bytes = 0;  // The most any member received.
  uint64_t laggard_bytes = 0;
  uint64_t newcomer_bytes = 0;
  uint64_t missed_delta_bytes = 0;  // Producers' egress of the deltas the laggard missed.
  // Under per-receiver plans, a second newcomer then copies a member (a peer replica) and joins.
  struct PeerJoin {
    double copy_s = 0;  // Its Start: the copy from the peer, verified, until it serves.
    uint64_t model_bytes = 0;
    RefitReport report;  // The sync it joined in.
    uint64_t member_bytes = 0;
    uint64_t newcomer_bytes = 0;
  };
  std::optional<PeerJoin> peer;
};

// Run the scenario once: 7 receivers at version 0, two syncs, the laggard out for three, then
// the laggard and a newcomer back for the join sync (`whole_anchor`: forced FULL for everyone).
Result<JoinRun> RunJoin(const Args& args, uint64_t model_bytes, bool whole_anchor) {
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(model_bytes, args.seed, args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const std::vector<uint16_t> ports, testkit::FreeLoopbackPorts(kFleet + 1));
  std::vector<std::unique_ptr<Node>> nodes;
  for (size_t r = 0; r + 1 < kFleet; ++r) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Node> node, StartNode(model.views(), ports[r]));
    nodes.push_back(std::move(node));
  }
  // The step-0 checkpoint the newcomer loads: a copy, since every node's buffers move on.
  std::vector<std::vector<std::byte>> step0_bytes;
  std::vector<TensorView> step0;
  for (const TensorView& like : model.views()) {
    step0_bytes.emplace_back(like.bytes.begin(), like.bytes.end());
    step0.push_back(TensorView{like.name, like.dtype, like.shape, step0_bytes.back()});
  }
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=60000";
  options.stream.chunk_bytes = std::max<uint64_t>(model_bytes / 16, 1 << 20);
  options.stream.encode_threads = 1;
  options.stream.serialize_threads = 1;
  options.stream.send_threads = 1;
  options.transfer_timeout = std::chrono::minutes(5);
  options.receivers = {{"http://unused", "unused"}};
  REFIT_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<ProducerGroup>> groups,
                         MakeInProcessGroup(kRanks));
  std::vector<std::unique_ptr<Publisher>> ranks;
  for (std::unique_ptr<ProducerGroup>& group : groups) {
    REFIT_ASSIGN_OR_RETURN(ranks.emplace_back(), Publisher::Make(options, std::move(group)));
    REFIT_RETURN_NOT_OK(ranks.back()->AdoptBaseline(model.views(), 0));
  }
  const auto fleet = [&](size_t count, bool with_laggard) {
    std::vector<PublisherReceiver> listed;
    for (size_t r = 0; r < count; ++r) {
      if (r == kMembers && !with_laggard) continue;
      listed.push_back({nodes[r]->node->control_url(), nodes[r]->node->producer_endpoint()});
    }
    return ranks[0]->SetReceivers(std::move(listed));
  };
  const auto sync = [&](bool anchor) -> Result<SyncReport> {
    std::vector<Result<SyncReport>> results(kRanks, Status(StatusCode::kInternal, "unset"));
    {
      std::vector<std::jthread> threads;
      for (size_t p = 1; p < kRanks; ++p) {
        threads.emplace_back([&, p] {
          results[p] = ranks[p]->Sync(std::vector<TensorView>(model.views()), anchor);
        });
      }
      results[0] = ranks[0]->Sync(std::vector<TensorView>(model.views()), anchor);
    }
    for (size_t p = 1; p < kRanks; ++p) REFIT_RETURN_NOT_OK(results[p].status());
    return std::move(results[0]);
  };
  JoinRun run;
  uint64_t step = 0;
  REFIT_RETURN_NOT_OK(fleet(kMembers + 1, true));
  for (int s = 0; s < 2; ++s) {
    REFIT_RETURN_NOT_OK(model.Step(++step, args.step_density).status());
    REFIT_RETURN_NOT_OK(sync(false).status());
  }
  REFIT_RETURN_NOT_OK(fleet(kMembers, false));
  for (uint64_t s = 0; s < kLaggardBehind; ++s) {
    REFIT_RETURN_NOT_OK(model.Step(++step, args.step_density).status());
    REFIT_ASSIGN_OR_RETURN(SyncReport missed, sync(false));
    run.missed_delta_bytes += missed.transfer.wire_bytes;
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Node> newcomer, StartNode(step0, ports[kFleet - 1]));
  nodes.push_back(std::move(newcomer));
  REFIT_RETURN_NOT_OK(fleet(kFleet, true));
  REFIT_RETURN_NOT_OK(model.Step(++step, args.step_density).status());
  REFIT_ASSIGN_OR_RETURN(SyncReport joined, sync(whole_anchor));
  run.report = joined.transfer;
  for (size_t r = 0; r < kFleet; ++r) {
    const uint64_t bytes = run.report.receivers[r].wire_bytes;
    if (r < kMembers) run.member_bytes = std::max(run.member_bytes, bytes);
    if (r == kMembers) run.laggard_bytes = bytes;
    if (r == kMembers + 1) run.newcomer_bytes = bytes;
  }
  // Every receiver holds the trainer's bytes.
  const auto check = [&](std::string_view after) -> Status {
    for (size_t r = 0; r < nodes.size(); ++r) {
      for (size_t t = 0; t < model.views().size(); ++t) {
        const auto want = model.views()[t].bytes;
        if (!std::equal(want.begin(), want.end(), nodes[r]->buffers[t].begin())) {
          return DataLoss("elastic: receiver {} tensor '{}' differs after the {}", r,
                          model.views()[t].name, after);
        }
      }
    }
    return Status::OK();
  };
  REFIT_RETURN_NOT_OK(check("join sync"));
  if (!whole_anchor) {
    // A newcomer with no weights of its own (zeroed buffers) copies the fleet's version from a
    // member, then joins: the next sync is the fleet's delta for everyone.
    JoinRun::PeerJoin peer;
    std::vector<std::vector<std::byte>> zeros;
    std::vector<TensorView> empty;
    for (const TensorView& like : model.views()) {
      zeros.emplace_back(like.bytes.size());
      empty.push_back(TensorView{like.name, like.dtype, like.shape, zeros.back()});
    }
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Node> copied,
                           StartNode(empty, ports[kPeerNewcomer], nodes[0]->node->control_url()));
    peer.copy_s = copied->start_s;
    peer.model_bytes = model_bytes;
    nodes.push_back(std::move(copied));
    REFIT_RETURN_NOT_OK(fleet(kFleet + 1, true));
    REFIT_RETURN_NOT_OK(model.Step(++step, args.step_density).status());
    REFIT_ASSIGN_OR_RETURN(SyncReport after_copy, sync(false));
    peer.report = after_copy.transfer;
    for (size_t r = 0; r < kMembers; ++r) {
      peer.member_bytes = std::max(peer.member_bytes, peer.report.receivers[r].wire_bytes);
    }
    peer.newcomer_bytes = peer.report.receivers[kPeerNewcomer].wire_bytes;
    REFIT_RETURN_NOT_OK(check("sync after the peer copy"));
    run.peer = std::move(peer);
  }
  for (std::unique_ptr<Node>& node : nodes) node->node->Stop();
  return run;
}

// The laggard's fold at the producers: one producer over the same model and steps, with a
// history, sends the join transfer's delta and the fold from 3 versions back; their bytes.
Result<nlohmann::json> MeasureFold(const Args& args, uint64_t model_bytes) {
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(model_bytes, args.seed, args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::DeltaTracker> tracker,
                         internal::DeltaTracker::Make({}));
  for (const TensorView& tensor : model.views())
    REFIT_RETURN_NOT_OK(tracker->AdoptBaseline(tensor));
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<DeltaHistory> history, DeltaHistory::Make({}));
  ProducerStreamOptions options;
  options.chunk_bytes = std::max<uint64_t>(model_bytes / 16, 1 << 20);
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerStream> stream, ProducerStream::Make(options));
  uint64_t delta_bytes = 0;
  uint64_t missed = 0;
  uint64_t folded = 0;
  const uint64_t steps = 2 + kLaggardBehind + 1;
  for (uint64_t step = 1; step <= steps; ++step) {
    REFIT_RETURN_NOT_OK(model.Step(step, args.step_density).status());
    REFIT_ASSIGN_OR_RETURN(TransferPlan plan, tracker->Begin(TransferId::Random()));
    history->Begin(plan.base_version, plan.anchor);
    std::atomic<uint64_t> sent{0}, sent_folded{0};
    std::vector<StreamRoute> routes = {StreamRoute{nullptr,
                                                   [&](uint32_t, std::span<const std::byte> p) {
                                                     sent += p.size();
                                                     return Status::OK();
                                                   },
                                                   nullptr}};
    const bool join = step == steps;
    if (join) {
      routes.push_back(StreamRoute{nullptr,
                                   [&](uint32_t, std::span<const std::byte> p) {
                                     sent_folded += p.size();
                                     return Status::OK();
                                   },
                                   nullptr, CatchUp::kFolded, plan.base_version - kLaggardBehind});
    }
    REFIT_RETURN_NOT_OK(stream
                            ->Run(*tracker, TensorListSource(model.views(), options.chunk_bytes),
                                  routes, history.get())
                            .status());
    REFIT_RETURN_NOT_OK(tracker->Commit(plan.transfer_id));
    history->Commit();
    delta_bytes = sent;
    if (step > steps - kLaggardBehind - 1) missed += sent;
    if (join) folded = sent_folded;
  }
  return nlohmann::json{
      {"folded_bytes", folded},
      {"missed_deltas_bytes", missed},
      {"join_delta_bytes", delta_bytes},
      {"folded_vs_missed", static_cast<double>(folded) / std::max<uint64_t>(missed, 1)},
      {"met", folded <= missed}};
}

}  // namespace

Result<nlohmann::json> RunElastic(const Args& args, const std::string& work_dir) {
  const uint64_t model_bytes = args.elastic_model_bytes;
  nlohmann::json out;
  REFIT_ASSIGN_OR_RETURN(JoinRun whole, RunJoin(args, model_bytes, /*whole_anchor=*/true));
  REFIT_ASSIGN_OR_RETURN(JoinRun plan, RunJoin(args, model_bytes, /*whole_anchor=*/false));
  out["model_bytes"] = model_bytes;
  out["receivers"] = kFleet;
  out["ranks"] = kRanks;
  const auto row = [](const JoinRun& run) {
    std::string laggard = std::string(CatchUpName(run.report.receivers[kMembers].caught_up_by));
    return nlohmann::json{
        {"time_s", run.report.total_s},     {"egress_bytes", run.report.wire_bytes},
        {"member_bytes", run.member_bytes}, {"laggard_bytes", run.laggard_bytes},
        {"laggard_caught_up_by", laggard},  {"newcomer_bytes", run.newcomer_bytes},
        {"anchor", run.report.plan.anchor}};
  };
  out["whole_fleet_anchor"] = row(whole);
  out["per_receiver_plan"] = row(plan);
  out["egress_ratio"] =
      static_cast<double>(plan.report.wire_bytes) / std::max<uint64_t>(whole.report.wire_bytes, 1);
  out["time_ratio"] = plan.report.total_s / std::max(whole.report.total_s, 1e-9);
  out["laggard_missed_delta_bytes"] = plan.missed_delta_bytes;
  // The raw copy of the model to one receiver: the yardstick of the newcomer's catch-up, which
  // is the join sync (it is caught up when the sync commits).
  cli::RawCopyOptions copy_options;
  copy_options.refit_binary = args.refit_binary;
  copy_options.work_dir = work_dir;
  copy_options.receivers = 1;
  copy_options.message_bytes = args.bucket_bytes;
  copy_options.threads = 1;
  REFIT_ASSIGN_OR_RETURN(SyntheticModel model,
                         SyntheticModel::Make(model_bytes, args.seed, args.threads, nullptr));
  REFIT_ASSIGN_OR_RETURN(const cli::RawCopyMeasurement copy,
                         cli::MeasureZmqRawCopy(model.views(), copy_options));
  out["raw_copy_s"] = copy.seconds;
  out["newcomer_catch_up_s"] = plan.report.total_s;
  out["catch_up_vs_raw_copy"] = plan.report.total_s / std::max(copy.seconds, 1e-9);
  out["catch_up_target"] = kCatchUpTarget;
  out["catch_up_met"] = out["catch_up_vs_raw_copy"].get<double>() <= kCatchUpTarget;
  // The newcomer that copied a member: its copy against the same yardstick, and the sync it
  // joined in, which must be the fleet's delta alone (one route; it got what a member got).
  const JoinRun::PeerJoin& peer = plan.peer.value();
  const bool delta_only = peer.report.wire_bytes == peer.member_bytes &&
                          peer.newcomer_bytes == peer.member_bytes &&
                          peer.report.receivers[kPeerNewcomer].caught_up_by == CatchUp::kDelta;
  out["peer"] =
      nlohmann::json{{"copy_s", peer.copy_s},
                     {"copy_vs_raw_copy", peer.copy_s / std::max(copy.seconds, 1e-9)},
                     {"copy_met", peer.copy_s / std::max(copy.seconds, 1e-9) <= kCatchUpTarget},
                     {"next_sync_egress_bytes", peer.report.wire_bytes},
                     {"next_sync_member_bytes", peer.member_bytes},
                     {"next_sync_newcomer_bytes", peer.newcomer_bytes},
                     {"newcomer_caught_up_by",
                      std::string(CatchUpName(peer.report.receivers[kPeerNewcomer].caught_up_by))},
                     {"next_sync_delta_only", delta_only}};
  REFIT_ASSIGN_OR_RETURN(out["fold"], MeasureFold(args, model_bytes));
  out["laggard_folded_end_to_end"] =
      std::string(CatchUpName(plan.report.receivers[kMembers].caught_up_by)) == "folded";
  return out;
}

void PrintElastic(const nlohmann::json& section) {
  std::cout << fmt::format(
      "== elastic: bf16 model {}, {} receivers ({} members, a laggard {} versions behind, a "
      "newcomer at step 0), {} publisher ranks, zmq:// relay trees\n",
      FormatBytes(section["model_bytes"]), section["receivers"].get<size_t>(), kMembers,
      kLaggardBehind, section["ranks"].get<uint32_t>());
  Table table({"join sync", "time", "producers' egress", "member got", "laggard got", "laggard by",
               "newcomer got"});
  for (const char* key : {"whole_fleet_anchor", "per_receiver_plan"}) {
    const nlohmann::json& row = section[key];
    table.AddRow({key, FormatDuration(row["time_s"]), FormatBytes(row["egress_bytes"]),
                  FormatBytes(row["member_bytes"]), FormatBytes(row["laggard_bytes"]),
                  row["laggard_caught_up_by"].get<std::string>(),
                  FormatBytes(row["newcomer_bytes"])});
  }
  table.Print(std::cout);
  const nlohmann::json& fold = section["fold"];
  std::cout << fmt::format(
      "per-receiver plan vs whole-fleet anchor: egress {:.3f}x, sync time {:.2f}x\n"
      "newcomer catch-up {} vs raw copy {} to one receiver: {:.2f}x (target <= {:.1f}x): {}\n"
      "laggard fold at the producers: {} vs the {} deltas it missed {} (incl. the join delta): "
      "{:.2f}x: {}\n"
      "laggard folded end to end: {}\n",
      section["egress_ratio"].get<double>(), section["time_ratio"].get<double>(),
      FormatDuration(section["newcomer_catch_up_s"]), FormatDuration(section["raw_copy_s"]),
      section["catch_up_vs_raw_copy"].get<double>(), section["catch_up_target"].get<double>(),
      section["catch_up_met"].get<bool>() ? "met" : "NOT MET", FormatBytes(fold["folded_bytes"]),
      kLaggardBehind + 1, FormatBytes(fold["missed_deltas_bytes"]),
      fold["folded_vs_missed"].get<double>(), fold["met"].get<bool>() ? "met" : "NOT MET",
      section["laggard_folded_end_to_end"].get<bool>()
          ? "yes"
          : "NOT MET (the laggard was not caught up by a fold: an anchor of its own)");
  const nlohmann::json& peer = section["peer"];
  std::cout << fmt::format(
      "newcomer copied from a peer replica: {} vs raw copy {}: {:.2f}x (target <= {:.1f}x): {}\n"
      "the sync it then joined: producers' egress {}, a member got {}, it got {} ({}): {}\n\n",
      FormatDuration(peer["copy_s"]), FormatDuration(section["raw_copy_s"]),
      peer["copy_vs_raw_copy"].get<double>(), section["catch_up_target"].get<double>(),
      peer["copy_met"].get<bool>() ? "met" : "NOT MET", FormatBytes(peer["next_sync_egress_bytes"]),
      FormatBytes(peer["next_sync_member_bytes"]), FormatBytes(peer["next_sync_newcomer_bytes"]),
      peer["newcomer_caught_up_by"].get<std::string>(),
      peer["next_sync_delta_only"].get<bool>()
          ? "the fleet's delta alone"
          : "NOT MET (the producers sent more than the fleet's delta)");
}

}  // namespace refit::bench::e2e
