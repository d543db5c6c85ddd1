// refit estimate: the bandwidth calculator. From a model size, a density, the producers (W), the
// receivers and the link (or an object store's) bandwidth, predict the time and wire bytes of a
// delta refit, a FULL (anchor) and a raw copy of the same bytes. Every rate comes from a short
// local calibration of refit's own stages on this machine, one thread each, printed with the
// prediction, so that each figure can be traced to what it was computed from.
//
// The model (docs/benchmarking.md, "refit estimate"): a refit is a pipeline, so its time is that
// of its slowest stage — the producers' compare + encode and serialize over their threads, the
// link carrying the wire bytes (twice for a relay that forwards to two children), the receiver's
// decode (on decode_threads, ahead of the apply) and apply (a delta's tensors and an anchor's
// copies on apply_threads, through a TP loader too) — or, where stages
// share cores (--same-host), the total CPU work over those cores if that is longer; a delta then
// adds what the producers' commit does before it returns. The trainer-visible sync is that sum;
// the producers' baseline fold (the scatter of the committed changes into the tracker's baseline)
// runs in the background after it and is printed apart: the next sync waits for it only if the
// training step between the two is shorter. With --tp a receiver is one tensor-parallel shard:
// routed by holdings (docs/protocol.md) it is sent only its class's 1/TP of the changes; a transfer
// that is not routed (tensor names unknown yet, or s3://) sends it the whole delta, which it maps
// through its loader keeping 1/TP; an anchor likewise. Both rows are printed, for the delta and the
// FULL.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "codec/tracker.h"
#include "core/half_float.h"
#include "pipeline/bucketing.h"
#include "pipeline/context_items.h"
#include "progress.h"
#include "receiver/apply.h"
#include "refit/payload.h"
#include "refit/receiver_session_options.h"
#include "refit/status_format.h"
#include "refit/stream_options.h"
#include "refit/weight_store.h"
#include "table.h"

namespace refit::cli {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

struct EstimateArgs {
  double model_gib = 0;
  double model_mib = 0;
  double density = 0.03;
  uint32_t producers = 1;
  uint32_t receivers = 1;
  /// Tensor-parallel shards per receiver replica (a receiver is one shard when > 1).
  uint32_t tp = 1;
  /// Link bandwidth per host in bytes per second (from --link-gbps or --link-bytes-per-s).
  double link_gbps = 0;
  double link_bytes_per_s = 0;
  int threads = 4;
  /// The receiver's apply threads (ReceiverSessionOptions::apply_threads).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
  /// The receiver's decode threads (ReceiverSessionOptions::decode_threads; 0: the apply thread
  /// decodes).
  int decode_threads = ReceiverSessionOptions{}.decode_threads;
  int cores = 0;
  bool same_host = false;
  std::string anchor_compression = "auto";
  uint64_t bucket_bytes = ProducerStreamOptions{}.bucket_bytes;
  uint64_t calibrate_mib = 64;
  bool json = false;
};

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Seconds per unit of each stage, one thread, measured on this machine.
struct Calibration {
  uint64_t bytes = 0;
  uint64_t changed = 0;
  double density = 0;
  // Delta: compare + encode per model byte; serialize (zstd) per model byte; apply (decode +
  // apply) and of it the decode alone per changed element; tracker commit until it returns, and
  // its background baseline fold, per changed element; wire bytes per changed.
  double delta_encode_s_per_byte = 0;
  double delta_serialize_s_per_byte = 0;
  double delta_apply_s_per_changed = 0;
  double delta_decode_s_per_changed = 0;
  double commit_s_per_changed = 0;
  double fold_s_per_changed = 0;
  double wire_bytes_per_changed = 0;
  // The same delta context-coded (delta_compression.item_coding): the coder per model byte, the
  // wire bytes per changed element, and the receiver's decode against the old span + apply per
  // model byte (O(span): every old element is read once).
  double context_encode_s_per_byte = 0;
  double context_wire_bytes_per_changed = 0;
  double context_apply_s_per_byte = 0;
  // FULL: encode (copy + digests) per byte; serialize per byte with zstd and raw; the zstd ratio;
  // apply (decode + copy + digests) per byte of a zstd and of a raw payload.
  double full_encode_s_per_byte = 0;
  double full_zstd_s_per_byte = 0;
  double full_raw_s_per_byte = 0;
  double full_zstd_ratio = 1;
  double full_apply_zstd_s_per_byte = 0;
  double full_apply_raw_s_per_byte = 0;
  // Of the apply: the decode alone (checksum, decompress or copy, parse), per byte.
  double full_decode_zstd_s_per_byte = 0;
  double full_decode_raw_s_per_byte = 0;
};

/// A bf16 tensor with a weight-like spread of values, and the same tensor after a step that
/// moves `density` of its elements by one ulp (what an optimizer step at a small learning rate
/// does to most changed bf16 weights).
std::pair<OwnedTensor, OwnedTensor> CalibrationTensors(uint64_t bytes, double density) {
  OwnedTensor base;
  base.name = "calibration.weight";
  base.dtype = DType::kBFloat16;
  const uint64_t numel = bytes / 2;
  base.shape = {static_cast<int64_t>(numel)};
  base.bytes.resize(numel * 2);
  // Any uniform bits will do: the calibration measures rates, not a reproducible stream.
  std::mt19937_64 next(0x5eed);
  for (uint64_t i = 0; i < numel; ++i) {
    // Sum of four uniforms: close enough to a normal of std 0.02 for the compressor.
    const uint64_t r = next();
    const double u =
        ((r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48)) / 65536.0 - 2.0;
    const uint16_t bits = FloatToBFloat16(static_cast<float>(u * 0.0346));
    std::memcpy(base.bytes.data() + i * 2, &bits, 2);
  }
  OwnedTensor next_step = base;
  // Element i moves when its draw falls below density × 2^64 (every element at density 1).
  const uint64_t threshold =
      density >= 1.0 ? UINT64_MAX : static_cast<uint64_t>(std::ldexp(density, 64));
  for (uint64_t i = 0; i < numel; ++i) {
    if (next() >= threshold && density < 1.0) continue;
    uint16_t bits = 0;
    std::memcpy(&bits, next_step.bytes.data() + i * 2, 2);
    bits = static_cast<uint16_t>(bits ^ 1u);
    std::memcpy(next_step.bytes.data() + i * 2, &bits, 2);
  }
  return {std::move(base), std::move(next_step)};
}

/// The ids of a calibration transfer's payloads (producer 0, from payload 0).
PayloadIds CalibrationIds(const TransferPlan& plan) {
  return PayloadIds{plan.transfer_id, 0, 0, plan.base_version, plan.target_version};
}

/// Seconds to decode and apply every payload and, of those, to decode alone.
struct ApplySeconds {
  double total = 0;
  double decode = 0;
};

/// Decode and apply every payload to `store` on one thread, as a receiver's session does (the
/// payload's bytes handed to the undo log, anchors not kept). Takes a copy, made before the clock
/// starts, because the log keeps the bytes.
Result<ApplySeconds> ApplyAll(std::vector<std::vector<std::byte>> payloads, WeightStore& store) {
  internal::UndoLog undo(internal::UndoLogOptions{.anchor_undo = AnchorUndo::kNone});
  ApplySeconds seconds;
  const auto start = std::chrono::steady_clock::now();
  for (std::vector<std::byte>& bytes : payloads) {
    // The listener's validation of the header is part of what a receiver does per payload.
    const auto decode_start = std::chrono::steady_clock::now();
    REFIT_ASSIGN_OR_RETURN(ValidatedPayload payload, ValidatePayload(std::move(bytes)));
    REFIT_ASSIGN_OR_RETURN(DecodedPayload decoded, DecodePayload(payload));
    seconds.decode += SecondsSince(decode_start);
    REFIT_RETURN_NOT_OK(internal::ApplyPayload(decoded, store, &undo, &payload));
  }
  seconds.total = SecondsSince(start);
  return seconds;
}

uint64_t TotalBytes(const std::vector<std::vector<std::byte>>& payloads) {
  uint64_t total = 0;
  for (const auto& payload : payloads) total += payload.size();
  return total;
}

Result<Calibration> Calibrate(uint64_t bytes, double density, uint64_t bucket_bytes) {
  Calibration c;
  auto [base, step] = CalibrationTensors(bytes, density);
  c.bytes = base.bytes.size();
  TrackerOptions tracker_options;
  tracker_options.compare.threads = 1;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::DeltaTracker> tracker,
                         internal::DeltaTracker::Make(tracker_options));
  REFIT_RETURN_NOT_OK(tracker->AdoptBaseline(base.view()));
  auto store = WeightStore::Make();
  REFIT_RETURN_NOT_OK(store->AddCopy(base.view()));

  // A delta.
  const TransferId delta_id = TransferId::Random();
  REFIT_ASSIGN_OR_RETURN(const TransferPlan delta_plan, tracker->Begin(delta_id));
  auto start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(internal::EncodeResult delta, tracker->Encode(delta_id, step.view()));
  c.delta_encode_s_per_byte = SecondsSince(start) / c.bytes;
  c.changed = delta.changed_elements;
  c.density = static_cast<double>(c.changed) / (c.bytes / 2.0);
  if (c.changed == 0) return InvalidArgument("estimate: the calibration step changed nothing");
  start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(auto delta_payloads,
                         PackPayloads(CalibrationIds(delta_plan), delta.items, bucket_bytes));
  c.delta_serialize_s_per_byte = SecondsSince(start) / c.bytes;
  c.wire_bytes_per_changed = static_cast<double>(TotalBytes(delta_payloads)) / c.changed;
  REFIT_ASSIGN_OR_RETURN(const ApplySeconds delta_apply, ApplyAll(delta_payloads, *store));
  c.delta_apply_s_per_changed = delta_apply.total / c.changed;
  c.delta_decode_s_per_changed = delta_apply.decode / c.changed;

  // The delta context-coded against the baseline, applied to a receiver at the base.
  {
    std::vector<Item> coded;
    start = std::chrono::steady_clock::now();
    for (const Item& item : delta.items) {
      REFIT_ASSIGN_OR_RETURN(Item one, internal::ContextCodeItem(item.view(), base.bytes));
      coded.push_back(std::move(one));
    }
    c.context_encode_s_per_byte = SecondsSince(start) / c.bytes;
    REFIT_ASSIGN_OR_RETURN(auto context_payloads,
                           PackPayloads(CalibrationIds(delta_plan), coded, bucket_bytes));
    c.context_wire_bytes_per_changed =
        static_cast<double>(TotalBytes(context_payloads)) / c.changed;
    auto at_base = WeightStore::Make();
    REFIT_RETURN_NOT_OK(at_base->AddCopy(base.view()));
    REFIT_ASSIGN_OR_RETURN(const ApplySeconds context_apply, ApplyAll(context_payloads, *at_base));
    c.context_apply_s_per_byte = context_apply.total / c.bytes;
  }
  start = std::chrono::steady_clock::now();
  REFIT_RETURN_NOT_OK(tracker->Commit(delta_id));
  c.commit_s_per_changed = SecondsSince(start) / c.changed;
  // The fold's own time on its thread (not the wait, which includes the thread's start).
  REFIT_RETURN_NOT_OK(tracker->WaitBaseline());
  c.fold_s_per_changed = tracker->last_fold().seconds / c.changed;

  // A FULL of the same weights.
  const TransferId full_id = TransferId::Random();
  REFIT_ASSIGN_OR_RETURN(const TransferPlan full_plan, tracker->Begin(full_id, true));
  start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(internal::EncodeResult full, tracker->Encode(full_id, step.view()));
  c.full_encode_s_per_byte = SecondsSince(start) / c.bytes;
  start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(auto zstd_payloads,
                         PackPayloads(CalibrationIds(full_plan), full.items, bucket_bytes));
  c.full_zstd_s_per_byte = SecondsSince(start) / c.bytes;
  c.full_zstd_ratio = static_cast<double>(TotalBytes(zstd_payloads)) / c.bytes;
  PayloadEncodeOptions raw;
  raw.compress = false;
  raw.byte_planes = false;
  start = std::chrono::steady_clock::now();
  REFIT_ASSIGN_OR_RETURN(auto raw_payloads,
                         PackPayloads(CalibrationIds(full_plan), full.items, bucket_bytes, raw));
  c.full_raw_s_per_byte = SecondsSince(start) / c.bytes;
  REFIT_ASSIGN_OR_RETURN(const ApplySeconds apply_zstd, ApplyAll(zstd_payloads, *store));
  c.full_apply_zstd_s_per_byte = apply_zstd.total / c.bytes;
  c.full_decode_zstd_s_per_byte = apply_zstd.decode / c.bytes;
  REFIT_ASSIGN_OR_RETURN(const ApplySeconds apply_raw, ApplyAll(raw_payloads, *store));
  c.full_apply_raw_s_per_byte = apply_raw.total / c.bytes;
  c.full_decode_raw_s_per_byte = apply_raw.decode / c.bytes;
  REFIT_RETURN_NOT_OK(tracker->Abort(full_id));
  return c;
}

/// One predicted refit: its wire bytes, its time, the stage that bounds it, and each stage's
/// time.
struct Prediction {
  std::string kind;
  uint64_t wire_bytes = 0;
  double seconds = 0;
  std::string bound;
  nlohmann::json stages;
  /// Work that runs after the refit returned, off the trainer's path (the producers' baseline
  /// fold): its name and seconds; 0 when none.
  std::string background_name;
  double background_s = 0;
};

/// The trainer-visible sync the issue sets for the 235B routed TP 16 delta at 3 % (docs/
/// benchmarking.md, "refit estimate"), printed MET or NOT MET beside every estimate's first delta.
constexpr double kTargetTrainerVisibleSyncS = 0.6;

/// The time of a pipeline of `stages` (name, seconds, CPU seconds): its slowest stage, or the
/// total CPU work over `shared_cores` when the stages share them and that is longer; plus
/// `serial_s` after it.
Prediction Pipeline(std::string kind, uint64_t wire_bytes,
                    const std::vector<std::tuple<std::string, double, double>>& stages,
                    int shared_cores, double serial_s = 0, std::string serial_name = "") {
  Prediction p;
  p.kind = std::move(kind);
  p.wire_bytes = wire_bytes;
  double cpu = 0;
  for (const auto& [name, seconds, cpu_s] : stages) {
    p.stages[name] = seconds;
    cpu += cpu_s;
    if (seconds > p.seconds) {
      p.seconds = seconds;
      p.bound = name;
    }
  }
  if (shared_cores > 0) {
    const double cpu_bound = cpu / shared_cores;
    p.stages["cpu over shared cores"] = cpu_bound;
    if (cpu_bound > p.seconds) {
      p.seconds = cpu_bound;
      p.bound = "cpu over shared cores";
    }
  }
  if (serial_s > 0) {
    p.stages[serial_name] = serial_s;
    p.seconds += serial_s;
  }
  return p;
}

nlohmann::json CalibrationJson(const Calibration& c) {
  const auto per_core = [](double s_per_byte) { return s_per_byte > 0 ? 1.0 / s_per_byte : 0.0; };
  return {{"bytes", c.bytes},
          {"changed", c.changed},
          {"density", c.density},
          {"delta_encode_bytes_per_s", per_core(c.delta_encode_s_per_byte)},
          {"delta_serialize_bytes_per_s", per_core(c.delta_serialize_s_per_byte)},
          {"delta_apply_changed_per_s", per_core(c.delta_apply_s_per_changed)},
          {"delta_decode_changed_per_s", per_core(c.delta_decode_s_per_changed)},
          {"commit_changed_per_s", per_core(c.commit_s_per_changed)},
          {"fold_changed_per_s", per_core(c.fold_s_per_changed)},
          {"wire_bytes_per_changed", c.wire_bytes_per_changed},
          {"context_encode_bytes_per_s", per_core(c.context_encode_s_per_byte)},
          {"context_wire_bytes_per_changed", c.context_wire_bytes_per_changed},
          {"context_apply_bytes_per_s", per_core(c.context_apply_s_per_byte)},
          {"full_encode_bytes_per_s", per_core(c.full_encode_s_per_byte)},
          {"full_zstd_bytes_per_s", per_core(c.full_zstd_s_per_byte)},
          {"full_raw_bytes_per_s", per_core(c.full_raw_s_per_byte)},
          {"full_zstd_ratio", c.full_zstd_ratio},
          {"full_apply_zstd_bytes_per_s", per_core(c.full_apply_zstd_s_per_byte)},
          {"full_apply_raw_bytes_per_s", per_core(c.full_apply_raw_s_per_byte)},
          {"full_decode_zstd_bytes_per_s", per_core(c.full_decode_zstd_s_per_byte)},
          {"full_decode_raw_bytes_per_s", per_core(c.full_decode_raw_s_per_byte)}};
}

Status RunEstimate(const EstimateArgs& args) {
  const double model_bytes =
      args.model_gib > 0 ? args.model_gib * 1024 * 1024 * 1024 : args.model_mib * 1024 * 1024;
  if (model_bytes < 2) return InvalidArgument("estimate: give --model-gib or --model-mib > 0");
  if (args.density <= 0 || args.density > 1) {
    return InvalidArgument("estimate: --density {} is outside (0, 1]", args.density);
  }
  const double link = args.link_bytes_per_s > 0 ? args.link_bytes_per_s : args.link_gbps * 1e9 / 8;
  if (link <= 0) return InvalidArgument("estimate: give --link-gbps or --link-bytes-per-s > 0");
  if (args.producers == 0 || args.receivers == 0 || args.tp == 0 || args.threads < 1) {
    return InvalidArgument(
        "estimate: --producers {}, --receivers {}, --tp {} and --threads {} must each be at least "
        "1",
        args.producers, args.receivers, args.tp, args.threads);
  }
  if (args.apply_threads < 1 || args.decode_threads < 0) {
    return InvalidArgument(
        "estimate: --apply-threads {} must be at least 1, --decode-threads {} "
        "at least 0",
        args.apply_threads, args.decode_threads);
  }
  Result<AnchorCompression> parsed = ParseAnchorCompression(args.anchor_compression);
  if (!parsed.ok()) return parsed.status().WithContext("estimate: --anchor-compression");
  const AnchorCompression anchor_mode = *parsed;
  const int cores = args.cores > 0
                        ? args.cores
                        : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(args.threads, 1);
  const double producers = args.producers;  // W
  // A producer's stages run on its own cores: at most `threads` of them at once.
  const double producer_parallel = std::min(threads, cores);

  if (!args.json) {
    std::cout << fmt::format("calibrating on {} of bf16 at {:.2f}% (one thread per stage)...\n",
                             FormatBytes(args.calibrate_mib * kMiB), 100 * args.density);
  }
  REFIT_ASSIGN_OR_RETURN(const Calibration c,
                         Calibrate(args.calibrate_mib * kMiB, args.density, args.bucket_bytes));
  const double elements = model_bytes / 2;
  const double changed = elements * c.density;
  // A relay forwards every payload to up to two children, so its link carries up to twice the
  // wire bytes out; a lone receiver only takes them in.
  const double relay = args.receivers > 1 ? 2.0 : 1.0;
  // Cores the stages share: on one host (loopback) every producer and receiver stage competes.
  const int shared = args.same_host ? cores : 0;

  std::vector<Prediction> predictions;
  // A receiver's apply and decode threads, and the shards of a replica.
  const double receiver_parallel = std::min(std::max(args.apply_threads, 1), cores);
  const double decoders = std::min(args.decode_threads, cores);
  const double tp = args.tp;
  using Stage = std::tuple<std::string, double, double>;
  // A receiver's stages: decode on the decode threads, overlapped with the apply (or, with no
  // decode thread, on the apply thread before each apply); its CPU counted once per receiver.
  const auto receiver_stages = [&](double decode_cpu, double apply_s, double apply_cpu,
                                   std::string apply_name) -> std::vector<Stage> {
    const double cpu = (decode_cpu + apply_cpu) * args.receivers;
    if (decoders < 1) {
      return {{"receiver decode + " + apply_name, decode_cpu + apply_s, cpu}};
    }
    return {{fmt::format("receiver decode ({} threads)", decoders), decode_cpu / decoders, cpu},
            {"receiver " + std::move(apply_name), apply_s, 0.0}};
  };
  {
    const double encode_cpu = model_bytes * c.delta_encode_s_per_byte;
    const double serialize_cpu = model_bytes * c.delta_serialize_s_per_byte;
    const double decode_per_changed = c.delta_decode_s_per_changed;
    const double apply_per_changed = c.delta_apply_s_per_changed - decode_per_changed;
    // A receiver is sent `received` changed elements and applies them on `apply_parallel`
    // threads.
    const auto delta = [&](std::string kind, double received, double apply_parallel,
                           std::string apply_name) {
      const double wire = received * c.wire_bytes_per_changed;
      std::vector<Stage> stages = {
          {"producer compare + encode", encode_cpu / producers / producer_parallel, encode_cpu},
          {"producer serialize", serialize_cpu / producers / producer_parallel, serialize_cpu},
          {"link", wire * relay / link, 0.0}};
      for (Stage& stage : receiver_stages(received * decode_per_changed,
                                          received * apply_per_changed / apply_parallel,
                                          received * apply_per_changed, std::move(apply_name))) {
        stages.push_back(std::move(stage));
      }
      Prediction p = Pipeline(std::move(kind), static_cast<uint64_t>(wire), stages, shared,
                              changed * c.commit_s_per_changed / producers, "producer commit");
      // Each producer folds its own changes, on one thread here (commit_threads spreads the
      // tensors over more: this is the bound when one tensor dominates).
      p.background_name = "producer baseline fold";
      p.background_s = changed * c.fold_s_per_changed / producers;
      return p;
    };
    if (args.tp == 1) {
      // The items of different tensors apply on apply_threads (a large model has far more
      // tensors than threads).
      predictions.push_back(delta("delta", changed, receiver_parallel,
                                  fmt::format("apply ({} threads)", receiver_parallel)));
      // Context-coded (delta_compression.item_coding): fewer wire bytes, for the coder at the
      // producer and, at the receiver, a decode over every old element of the payload's items on
      // the apply thread before the payload applies (payloads apply one at a time).
      const double context_wire = changed * c.context_wire_bytes_per_changed;
      const double context_encode_cpu = model_bytes * c.context_encode_s_per_byte;
      const double context_apply_cpu = model_bytes * c.context_apply_s_per_byte;
      predictions.push_back(Pipeline(
          "delta (context-coded)", static_cast<uint64_t>(context_wire),
          {{"producer compare + encode + context coding",
            (encode_cpu + context_encode_cpu) / producers / producer_parallel,
            encode_cpu + context_encode_cpu},
           {"producer serialize", serialize_cpu / producers / producer_parallel, serialize_cpu},
           {"link", context_wire * relay / link, 0.0},
           {"receiver context decode + apply (1 thread)", context_apply_cpu,
            context_apply_cpu * args.receivers}},
          shared, changed * c.commit_s_per_changed / producers, "producer commit"));
    } else {
      // Routed by holdings, a shard is sent only its class's 1/TP of the changes; unrouted, it
      // receives and decodes the whole delta and maps every changed element through its loader,
      // keeping about 1/TP. Either way the tensors (groups of local tensors) apply on
      // apply_threads.
      const std::string through =
          fmt::format("apply through the loader ({} threads)", receiver_parallel);
      predictions.push_back(delta(fmt::format("delta (TP {} shard, routed)", args.tp), changed / tp,
                                  receiver_parallel, through));
      predictions.push_back(delta(fmt::format("delta (TP {} shard, not routed)", args.tp), changed,
                                  receiver_parallel, through));
    }
  }
  {
    const bool compress_zstd = [&] {
      if (anchor_mode == AnchorCompression::kZstd) return true;
      if (anchor_mode == AnchorCompression::kNone) return false;
      // As the stream's auto rule: compress when the compressed path is 10 % faster.
      const double compressor = producers * producer_parallel / c.full_zstd_s_per_byte;
      return std::min(compressor, link / c.full_zstd_ratio) > 1.10 * link;
    }();
    const double serialize_s_per_byte =
        compress_zstd ? c.full_zstd_s_per_byte : c.full_raw_s_per_byte;
    const double apply_s_per_byte =
        compress_zstd ? c.full_apply_zstd_s_per_byte : c.full_apply_raw_s_per_byte;
    const double wire = model_bytes * (compress_zstd ? c.full_zstd_ratio : 1.0);
    const double encode_cpu = model_bytes * c.full_encode_s_per_byte;
    const double serialize_cpu = model_bytes * serialize_s_per_byte;
    // The receiver copies an anchor's tensors (groups of local tensors, through a loader) on
    // apply_threads, a TP shard only its 1/TP. Routed by holdings, a shard is sent and decodes
    // only its slice of the anchor; unrouted, the whole anchor.
    const double decode_cpu = model_bytes * (compress_zstd ? c.full_decode_zstd_s_per_byte
                                                           : c.full_decode_raw_s_per_byte);
    const double copy_cpu = (model_bytes * apply_s_per_byte - decode_cpu) / tp;
    const auto full = [&](std::string kind, double received_share) {
      std::vector<Stage> stages = {
          {"producer encode", encode_cpu / producers / producer_parallel, encode_cpu},
          {"producer serialize", serialize_cpu / producers / producer_parallel, serialize_cpu},
          {"link", wire * received_share * relay / link, 0.0}};
      for (Stage& stage : receiver_stages(
               decode_cpu * received_share, copy_cpu / receiver_parallel, copy_cpu,
               fmt::format("copy{} ({} threads)", args.tp == 1 ? "" : " through the loader",
                           receiver_parallel))) {
        stages.push_back(std::move(stage));
      }
      return Pipeline(std::move(kind), static_cast<uint64_t>(wire * received_share), stages,
                      shared);
    };
    const std::string full_kind = fmt::format("FULL ({})", compress_zstd ? "zstd" : "raw blocks");
    if (args.tp == 1) {
      predictions.push_back(full(full_kind, 1.0));
    } else {
      predictions.push_back(
          full(fmt::format("{} (TP {} shard, routed)", full_kind, args.tp), 1.0 / tp));
      predictions.push_back(
          full(fmt::format("{} (TP {} shard, not routed)", full_kind, args.tp), 1.0));
    }
  }
  predictions.push_back(Pipeline("raw copy", static_cast<uint64_t>(model_bytes),
                                 {{"link", model_bytes * relay / link, 0.0}}, 0));

  nlohmann::json out = {{"inputs",
                         {{"model_bytes", model_bytes},
                          {"density", args.density},
                          {"producers", args.producers},
                          {"receivers", args.receivers},
                          {"tp", args.tp},
                          {"apply_threads", args.apply_threads},
                          {"decode_threads", args.decode_threads},
                          {"link_bytes_per_s", link},
                          {"threads", threads},
                          {"cores", cores},
                          {"same_host", args.same_host},
                          {"anchor_compression", args.anchor_compression}}},
                        {"calibration", CalibrationJson(c)},
                        {"predictions", nlohmann::json::array()}};
  const double raw_s = predictions.back().seconds;
  // What delta_compression.item_coding = auto would send: context-coded when at least
  // kContextMinSaving smaller and, on a link whose bytes are not billed, sooner (s3:// bills them).
  std::string auto_choice = "no context-coded row (TP shards must be sent plain)";
  if (args.tp == 1) {
    const Prediction& plain = predictions[0];
    const Prediction& context = predictions[1];
    const bool smaller = static_cast<double>(context.wire_bytes) <=
                         (1 - internal::kContextMinSaving) * static_cast<double>(plain.wire_bytes);
    auto_choice = fmt::format("s3:// (billed bytes) {}, a link of this speed {}",
                              smaller ? "context" : "plain",
                              smaller && context.seconds < plain.seconds ? "context" : "plain");
    out["item_coding_auto"] = {
        {"billed_link", smaller ? "context" : "plain"},
        {"unbilled_link", smaller && context.seconds < plain.seconds ? "context" : "plain"}};
  }
  for (const Prediction& p : predictions) {
    out["predictions"].push_back(
        {{"kind", p.kind},
         {"wire_bytes", p.wire_bytes},
         {"seconds", p.seconds},
         {"over_raw_copy", p.seconds / raw_s},
         {"bound", p.bound},
         {"stages", p.stages},
         {"trainer_visible_s", p.seconds},
         {"background", p.background_s > 0 ? nlohmann::json{{p.background_name, p.background_s}}
                                           : nlohmann::json::object()}});
  }
  // The first delta row: the routed one under --tp.
  const Prediction& delta = predictions.front();
  out["trainer_visible_sync"] = {{"kind", delta.kind},
                                 {"seconds", delta.seconds},
                                 {"target_s", kTargetTrainerVisibleSyncS},
                                 {"met", delta.seconds <= kTargetTrainerVisibleSyncS},
                                 {"background_s", delta.background_s}};
  if (args.json) {
    std::cout << out.dump() << "\n";
    return Status::OK();
  }
  const nlohmann::json& cal = out["calibration"];
  std::cout << fmt::format(
      "calibration (per thread): delta compare+encode {:.2f} GB/s, serialize {:.2f} GB/s, apply "
      "{:.1f} M changed/s, commit {:.1f} M changed/s + background fold {:.1f} M changed/s, {:.2f} "
      "wire B per changed; FULL encode "
      "{:.2f} GB/s, zstd {:.2f} GB/s to {:.3f} of the bytes, raw blocks {:.2f} GB/s, apply "
      "{:.2f} GB/s (zstd) / {:.2f} GB/s (raw)\n",
      cal["delta_encode_bytes_per_s"].get<double>() / 1e9,
      cal["delta_serialize_bytes_per_s"].get<double>() / 1e9,
      cal["delta_apply_changed_per_s"].get<double>() / 1e6,
      cal["commit_changed_per_s"].get<double>() / 1e6,
      cal["fold_changed_per_s"].get<double>() / 1e6, c.wire_bytes_per_changed,
      cal["full_encode_bytes_per_s"].get<double>() / 1e9,
      cal["full_zstd_bytes_per_s"].get<double>() / 1e9, c.full_zstd_ratio,
      cal["full_raw_bytes_per_s"].get<double>() / 1e9,
      cal["full_apply_zstd_bytes_per_s"].get<double>() / 1e9,
      cal["full_apply_raw_bytes_per_s"].get<double>() / 1e9);
  std::cout << fmt::format(
      "model {}, {:.2f}% changed, W = {} producers x {} threads, {} receivers{} with {} apply "
      "and {} decode threads, link {:.2f} GB/s{}\n",
      FormatBytes(static_cast<uint64_t>(model_bytes)), 100 * args.density, args.producers, threads,
      args.receivers, args.tp > 1 ? fmt::format(" (each a TP {} shard)", args.tp) : "",
      args.apply_threads, args.decode_threads, link / 1e9,
      args.same_host ? fmt::format(", one host of {} cores", cores) : "");
  Table table({"refit", "wire", "time", "vs raw copy", "bound by", "background"});
  for (const Prediction& p : predictions) {
    table.AddRow({p.kind, FormatBytes(p.wire_bytes), FormatDuration(p.seconds),
                  fmt::format("{:.2f}", p.seconds / raw_s), p.bound,
                  p.background_s > 0 ? FormatDuration(p.background_s) : "-"});
  }
  table.Print(std::cout);
  std::cout << "each time is the slowest pipeline stage (--json lists every stage's)"
            << (args.same_host ? " or the CPU work over the shared cores" : "")
            << "; a delta adds what the producers' commit does before it returns: the time is "
               "what the trainer waits for. background = the producers' baseline fold after it, "
               "which the next sync waits for only if the training step is shorter\n";
  std::cout << fmt::format(
      "trainer-visible sync ({}): {} vs target <= {} s: {}; baseline fold {} in the background\n",
      delta.kind, FormatDuration(delta.seconds), kTargetTrainerVisibleSyncS,
      delta.seconds <= kTargetTrainerVisibleSyncS ? "MET" : "NOT MET",
      FormatDuration(delta.background_s));
  std::cout << "delta_compression.item_coding auto would send: " << auto_choice
            << " (context-coded only when at least 5 % smaller; the calibration's changes do "
               "not depend on magnitude as an optimizer's do, so real checkpoints gain more: "
               "bench/context_bench)\n";
  return Status::OK();
}

}  // namespace

void RegisterEstimate(CLI::App& app, Status* result) {
  auto args = std::make_shared<EstimateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "estimate",
      "Predict refit time and wire bytes (delta, FULL, raw copy) from a local calibration");
  cmd->add_option("--model-gib", args->model_gib, "Model size in GiB (bf16)");
  cmd->add_option("--model-mib", args->model_mib, "Model size in MiB (bf16)");
  cmd->add_option("--density", args->density, "Fraction of elements a step changes")
      ->capture_default_str();
  cmd->add_option("--producers", args->producers, "Producer ranks W")->capture_default_str();
  cmd->add_option("--receivers", args->receivers, "Receivers (a relay tree beyond one)")
      ->capture_default_str();
  cmd->add_option("--link-gbps", args->link_gbps,
                  "Link (or object store) bandwidth per host in Gbit/s");
  cmd->add_option("--link-bytes-per-s", args->link_bytes_per_s,
                  "The same in bytes per second (e.g. a measured raw copy)");
  cmd->add_option("--threads", args->threads, "Threads per producer stage")->capture_default_str();
  cmd->add_option("--apply-threads", args->apply_threads, "A receiver's apply threads")
      ->capture_default_str();
  cmd->add_option("--decode-threads", args->decode_threads,
                  "A receiver's decode threads (0: the apply thread decodes)")
      ->capture_default_str();
  cmd->add_option("--tp", args->tp,
                  "Tensor-parallel shards per replica: each receiver is one shard")
      ->capture_default_str();
  cmd->add_option("--cores", args->cores, "Cores per host (default: this machine's)");
  cmd->add_flag("--same-host", args->same_host,
                "Producers and receivers share one host's cores (loopback)");
  cmd->add_option("--anchor-compression", args->anchor_compression, "auto, zstd or none")
      ->capture_default_str();
  cmd->add_option("--calibrate-mib", args->calibrate_mib, "Bytes the calibration measures")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_flag("--json", args->json, "Print one JSON document");
  cmd->callback([args, result] { *result = RunEstimate(*args); });
}

}  // namespace refit::cli
