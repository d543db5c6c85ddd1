// refit push: send a safetensors checkpoint to a fleet of `refit serve` daemons and commit it —
// as a delta against the checkpoint they hold (--base) or as a FULL anchor — through Publisher,
// exactly as a trainer does: one rank, W ranks as threads (--producers), or this process as one
// rank of W processes (--group, --rank, --world-size). Prepare, stream, flush with state digests,
// commit; any failure on any rank rolls every receiver back.
#include <stdlib.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <thread>

#include "cli_common.h"
#include "config_file.h"
#include "progress.h"
#include "refit/control_client.h"
#include "role_options.h"
#if REFIT_HAVE_MPI
#include "refit/mpi.h"
#include "refit/mpi_producer_group.h"
#endif
#include "refit/producer_group.h"
#include "refit/producer_layout.h"
#include "refit/publisher.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"

namespace refit::cli {
namespace {

struct PushArgs {
  std::string config;
  std::string checkpoint;
  std::string base;
  /// This rank's pieces (JSON): the checkpoint is then its local tensors (a sharded push).
  std::string layout;
  /// "CONTROL_URL=DATA_ENDPOINT", one per receiver, in tree order.
  std::vector<std::string> receivers;
  uint32_t producers = 1;
  // One rank of a multi-process group (--group): rank 0 coordinates.
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string group;
  double timeout_s = 600;
  bool anchor = false;
  bool json = false;
  /// The flags that set configuration keys, in the order given; they override the file.
  std::vector<config::ConfigOverride> overrides;
};

// The configuration file (or the defaults) with the flags applied on top.
Result<config::RefitConfig> ResolveConfig(const PushArgs& args) {
  std::vector<config::ConfigOverride> overrides = args.overrides;
  if (!args.receivers.empty()) {
    std::vector<config::ReceiverConfig> receivers;
    for (const std::string& spec : args.receivers) {
      // A control URL alone serves transports that announce payloads on it (s3://).
      const size_t equals = spec.find('=');
      if (equals == std::string::npos) {
        receivers.push_back({spec, ""});
        continue;
      }
      if (equals == 0 || equals + 1 == spec.size()) {
        return InvalidArgument(
            "--receiver '{}': expected CONTROL_URL=DATA_ENDPOINT, e.g. "
            "http://10.0.0.5:8081=10.0.0.5:5555 (or CONTROL_URL alone for s3://)",
            spec);
      }
      receivers.push_back({spec.substr(0, equals), spec.substr(equals + 1)});
    }
    overrides.push_back({"receivers", std::move(receivers), "--receiver"});
  }
  return config::LoadConfigFile(args.config, overrides);
}

// The newest version the receivers hold: what --base is (the receivers that loaded it and
// followed the trainer). A receiver behind it (restarted from an older checkpoint) is refit by
// an anchor, which Publisher decides at Sync. A receiver that is prepared (its push died before
// the decision) is resolved by this push's prepare (implied commit or abort, docs/protocol.md);
// one still receiving is another push's: this push's prepare rolls it back once it has been
// quiet for the receiver's preempt_after (its push died), and is refused naming it otherwise.
// Errors name the receiver, and for a refused key the variable it came from (`api_key_env`).
Result<uint64_t> FleetVersion(const PublisherOptions& options, const std::string& api_key_env,
                              std::chrono::steady_clock::time_point deadline) {
  std::optional<uint64_t> version;
  for (const PublisherReceiver& receiver : options.receivers) {
    ControlClientOptions client_options = options.control;
    client_options.base_url = receiver.control_url;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                           ControlClient::Make(client_options));
    // The push's one deadline bounds the question to every receiver together.
    client->SetCallDeadline(deadline);
    const std::string& url = receiver.control_url;
    Result<ControlStatus> asked = client->GetStatus();
    // A refused key is the push's mistake, not a straggler: it fails the push whatever the policy.
    if (!asked.ok() && options.commit_policy.kind == CommitPolicy::Kind::kQuorum &&
        asked.status().code() != StatusCode::kPermissionDenied) {
      // Under a quorum a receiver that does not answer is left out of the push and fenced (the
      // Publisher decides whether enough replicas answered); it does not set the version.
      std::cerr << fmt::format(
          "warning: {} did not answer its status ({}); under commit policy "
          "{} it is left out of this push\n",
          url, asked.status().ToString(), CommitPolicyName(options.commit_policy));
      continue;
    }
    if (!asked.ok()) return ExplainReceiverError(asked.status(), "push", url, api_key_env);
    const ControlStatus& status = *asked;
    version = std::max(version.value_or(0), status.receiver.version);
  }
  if (!version.has_value()) return Unavailable("push: no receiver answered its status");
  return *version;
}

// A delta needs the base to have the model's tensors, in the same order and shapes.
Status CheckSameTensors(const std::vector<TensorView>& base, const std::vector<TensorView>& model) {
  if (base.size() != model.size()) {
    return InvalidArgument("--base has {} tensors but the checkpoint {}", base.size(),
                           model.size());
  }
  for (size_t t = 0; t < model.size(); ++t) {
    if (base[t].name != model[t].name || base[t].dtype != model[t].dtype ||
        base[t].shape != model[t].shape) {
      return InvalidArgument(
          "--base tensor {} is '{}' {} {} but the checkpoint's is '{}' {} {}: a delta needs the "
          "same tensors in the same order",
          t, base[t].name, DTypeName(base[t].dtype), ShapeToString(base[t].shape), model[t].name,
          DTypeName(model[t].dtype), ShapeToString(model[t].shape));
    }
  }
  return Status::OK();
}

// A layout file: a JSON list of pieces, each {tensor, dtype, shape, offset, extent} and
// optionally {local, local_shape, local_offset} (defaults: the tensor's name, the extent, zeros) —
// the dicts refit.layout writes.
Result<ProducerLayout> ReadLayoutFile(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, ReadFile(path));
  const nlohmann::json body = nlohmann::json::parse(
      reinterpret_cast<const char*>(bytes.data()),
      reinterpret_cast<const char*>(bytes.data()) + bytes.size(), nullptr, false);
  if (body.is_discarded() || !body.is_array()) {
    return InvalidArgument("--layout {}: not a JSON list of pieces", path);
  }
  const auto integers = [](const nlohmann::json& value) {
    return value.is_array() && std::all_of(value.begin(), value.end(),
                                           [](const auto& e) { return e.is_number_integer(); });
  };
  ProducerLayout layout;
  for (size_t i = 0; i < body.size(); ++i) {
    const nlohmann::json& entry = body[i];
    const std::string where = fmt::format("--layout {}: piece {}", path, i);
    if (!entry.is_object()) return InvalidArgument("{} is not an object", where);
    LayoutPiece piece;
    for (const auto& [key, value] : entry.items()) {
      if (key == "tensor" || key == "dtype" || key == "local") {
        if (!value.is_string()) return InvalidArgument("{}: '{}' is not a string", where, key);
      } else if (key == "shape" || key == "offset" || key == "extent" || key == "local_shape" ||
                 key == "local_offset") {
        if (!integers(value))
          return InvalidArgument("{}: '{}' is not a list of integers", where, key);
      } else {
        return InvalidArgument(
            "{}: unknown key '{}'; known keys: tensor, dtype, shape, offset, extent, local, "
            "local_shape, local_offset",
            where, key);
      }
    }
    for (const char* key : {"tensor", "dtype", "shape", "offset", "extent"}) {
      if (!entry.contains(key)) return InvalidArgument("{}: no '{}'", where, key);
    }
    piece.tensor = entry["tensor"].get<std::string>();
    REFIT_ASSIGN_OR_RETURN(piece.dtype, ParseDType(entry["dtype"].get<std::string>()));
    piece.shape = entry["shape"].get<Shape>();
    piece.offset = entry["offset"].get<std::vector<int64_t>>();
    piece.extent = entry["extent"].get<std::vector<int64_t>>();
    piece.local = entry.value("local", piece.tensor);
    piece.local_shape =
        entry.contains("local_shape") ? entry["local_shape"].get<Shape>() : Shape(piece.extent);
    piece.local_offset = entry.contains("local_offset")
                             ? entry["local_offset"].get<std::vector<int64_t>>()
                             : std::vector<int64_t>(piece.extent.size(), 0);
    layout.pieces.push_back(std::move(piece));
  }
  return layout;
}

// This process's producer group: one rank (the default), W threads of this process
// (--producers W), or one rank of W processes (--rank/--world-size/--group tcp://HOST:PORT).
Result<std::vector<std::unique_ptr<ProducerGroup>>> MakeGroups(
    const PushArgs& args, const std::string& api_key, std::chrono::milliseconds connect_timeout) {
  std::vector<std::unique_ptr<ProducerGroup>> groups;
  if (args.group.empty()) {
    if (args.world_size != 1 || args.rank != 0) {
      return InvalidArgument(
          "--rank/--world-size need --group tcp://HOST:PORT, where rank 0 listens for the others");
    }
    return MakeInProcessGroup(args.producers);
  }
  if (args.producers != 1) {
    return InvalidArgument(
        "--producers {} runs the producers as threads of one process; with --group each process "
        "is one rank: give --world-size instead",
        args.producers);
  }
  TcpGroupOptions options;
  options.address = args.group;
  options.rank = args.rank;
  options.world_size = args.world_size;
  options.api_key = api_key;
  options.connect_timeout = connect_timeout;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeTcpGroup(options));
  groups.push_back(std::move(group));
  return groups;
}

// What the ranks that sent nothing hold of the model, for the lines below: with the whole model
// on every rank, export chunk k (of about chunk_bytes, canonical order) is rank k % W's, so a
// model of fewer chunks than ranks leaves the last ranks nothing to send.
std::string IdleRanksNote(const StreamReport& stream, uint32_t world_size, uint64_t chunk_bytes) {
  return fmt::format(
      "the model is {} export chunk(s) of about {} (--chunk-bytes) and chunk k is sent by rank "
      "k % {}; a smaller --chunk-bytes on every rank spreads it over more ranks",
      stream.chunks, FormatBytes(chunk_bytes), world_size);
}

void PrintReport(const PushArgs& args, const SyncReport& sync, uint64_t model_bytes,
                 uint64_t chunk_bytes) {
  const RefitReport& report = sync.transfer;
  if (args.json) {
    nlohmann::json line = {{"transfer_id", report.plan.transfer_id.ToHex()},
                           {"kind", report.plan.anchor ? "full" : "delta"},
                           {"base_version", report.plan.base_version},
                           {"version", report.plan.target_version},
                           {"rank", sync.rank},
                           {"world_size", sync.world_size},
                           {"receivers", report.receivers.size()},
                           {"payloads", report.payloads},
                           {"changed", report.changed_elements},
                           {"elements", report.total_elements},
                           {"model_bytes", model_bytes},
                           {"wire_bytes", report.wire_bytes},
                           {"time_s", report.total_s}};
    nlohmann::json commits = nlohmann::json::array();
    for (const ReceiverOutcome& receiver : report.receivers) {
      commits.push_back(
          {{"receiver", receiver.name},
           {"held_version", receiver.held_version},
           {"lag", receiver.lag},
           {"caught_up_by", std::string(CatchUpName(receiver.caught_up_by))},
           {"wire_bytes", receiver.wire_bytes},
           {"committed", !receiver.fenced && receiver.commit_status.ok()},
           {"fenced", receiver.fenced},
           {"error", receiver.fenced ? nlohmann::json(receiver.fenced_because.ToString())
                     : receiver.commit_status.ok()
                         ? nlohmann::json(nullptr)
                         : nlohmann::json(receiver.commit_status.ToString())}});
    }
    line["commits"] = std::move(commits);
    line["fenced"] = report.fenced;
    std::cout << line.dump() << std::endl;
  } else if (sync.rank != 0) {
    std::cout << fmt::format(
        "rank {} of {}: sent its share of {} v{} -> v{}: {} changed of {} elements, {} payloads, "
        "{} on the wire\n",
        sync.rank, sync.world_size, report.plan.anchor ? "a FULL anchor" : "a delta",
        report.plan.base_version, report.plan.target_version, report.changed_elements,
        report.total_elements, report.payloads, FormatBytes(report.wire_bytes));
    const bool sharded = !args.layout.empty();
    if (!sharded && report.producers.size() == 1 && report.producers[0].owned_chunks == 0) {
      std::cout << fmt::format("rank {} of {} owns no export chunk, so it sent nothing: {}\n",
                               sync.rank, sync.world_size,
                               IdleRanksNote(report.producers[0], sync.world_size, chunk_bytes));
    }
  } else {
    std::cout << fmt::format(
        "pushed {} as {} v{} -> v{} to {} receiver(s) from {} rank(s): {} changed of {} "
        "elements, {} payloads, {} on the wire ({} model), {} (stream {}, flush {}, commit {})\n",
        args.checkpoint, report.plan.anchor ? "a FULL anchor" : "a delta", report.plan.base_version,
        report.plan.target_version, report.receivers.size(), sync.world_size,
        report.changed_elements, report.total_elements, report.payloads,
        FormatBytes(report.wire_bytes), FormatBytes(model_bytes), FormatDuration(report.total_s),
        FormatDuration(report.stream_s), FormatDuration(report.flush_s),
        FormatDuration(report.commit_s));
    // Receivers caught up on their own (new, behind, needing an anchor) in a delta transfer;
    // those at the base got the delta above. `--json` lists every receiver.
    for (const ReceiverOutcome& receiver : report.receivers) {
      if (receiver.caught_up_by == CatchUp::kDelta || report.plan.anchor) continue;
      std::cout << fmt::format("  {}: v{} -> v{} ({} behind the base) by {}, {} sent to it\n",
                               receiver.name, receiver.held_version, report.plan.target_version,
                               receiver.lag, CatchUpName(receiver.caught_up_by),
                               FormatBytes(receiver.wire_bytes));
    }
    std::vector<size_t> idle;
    for (size_t p = 0; p < report.producers.size(); ++p) {
      if (report.producers[p].owned_chunks == 0) idle.push_back(p);
    }
    if (args.layout.empty() && !idle.empty()) {
      std::cout << fmt::format("rank(s) {} of {} owned no export chunk and sent nothing: {}\n",
                               fmt::join(idle, ", "), report.producers.size(),
                               IdleRanksNote(report.producers[0], sync.world_size, chunk_bytes));
    }
  }
  for (const ReceiverOutcome& receiver : report.receivers) {
    if (receiver.fenced) {
      std::cerr << fmt::format(
          "warning: {} was fenced ({} of {} replica(s) flushed): {}; it stays at version {} and "
          "is caught up by the next push\n",
          receiver.name, report.flushed_replicas, report.replicas,
          receiver.fenced_because.ToString(), receiver.held_version);
    } else if (!receiver.commit_status.ok()) {
      std::cerr << fmt::format(
          "warning: {} did not confirm the commit ({}); it is prepared and commits at the next "
          "transfer\n",
          receiver.name, receiver.commit_status.ToString());
    }
  }
}

// Under mpirun with mpi://: this process is producer `info.index` of the job; its group is the
// job's producer ranks, and the receivers are the job's other ranks.
struct MpiRank {
  bool active = false;
  uint32_t index = 0;
};

// A transport that carries its own control channel is an MPI job's (mpi://, nccl://): making it
// joins the job with the URI's layout (collective over the world). Other transports' factories
// do no I/O, so asking costs nothing.
Result<MpiRank> JoinMpiIfAsked(const std::string& transport_uri) {
  REFIT_ASSIGN_OR_RETURN(const std::unique_ptr<Transport> transport, MakeTransport(transport_uri));
  if (!transport->capabilities().carries_control) return MpiRank{};
#if REFIT_HAVE_MPI
  REFIT_ASSIGN_OR_RETURN(const MpiJobInfo info, CurrentMpiJob());
  if (!info.producer) {
    return InvalidArgument(
        "push: rank {} is receiver {} of the MPI job ({} producer rank(s)): run `refit serve` on "
        "the receiver ranks (mpirun -np P refit push … : -np R refit serve …)",
        info.rank, info.index, info.producers);
  }
  return MpiRank{true, info.index};
#else
  return FailedPrecondition(
      "push: transport '{}' carries its own control channel, which this "
      "build cannot drive",
      transport_uri);
#endif
}

Status RunPush(const PushArgs& args) {
  // --timeout is one deadline for the whole push: the fleet's version, the group, every phase of
  // the transfer and its aborts (which the coordinator allows a margin of a second past it).
  const std::chrono::steady_clock::time_point deadline =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1e3));
  const auto time_left = [&]() -> Result<std::chrono::milliseconds> {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return DeadlineExceeded("push: --timeout {} s passed before the transfer began",
                              args.timeout_s);
    }
    return left;
  };
  REFIT_ASSIGN_OR_RETURN(const config::RefitConfig config, ResolveConfig(args));
  REFIT_ASSIGN_OR_RETURN(const std::string transport_uri, config::ToTransportUri(config));
  REFIT_ASSIGN_OR_RETURN(const MpiRank mpi, JoinMpiIfAsked(transport_uri));
  if (mpi.active && (!args.group.empty() || args.producers != 1)) {
    return InvalidArgument(
        "push: under mpi:// the producers are the job's first ranks (mpi://?producers=P): "
        "--group and --producers do not apply");
  }
  const bool leader = mpi.active ? mpi.index == 0 : args.rank == 0;
  // A collective (mpi://, nccl://) knows its receivers itself; rank 0 of any other needs them.
  if (config.receivers.empty() && leader && !mpi.active) {
    return InvalidArgument(
        "no receivers: give --receiver CONTROL_URL=DATA_ENDPOINT or a --config "
        "file with a receivers list (or run under mpirun with --transport mpi://)");
  }
  if (!args.layout.empty() && (!args.base.empty() || args.producers != 1)) {
    return InvalidArgument(
        "push: --layout sends this rank's pieces as an anchor, from one rank per process "
        "(--group, or mpi://): --base and --producers do not apply");
  }
  std::optional<ShardedModel> sharded;
  if (!args.layout.empty()) {
    REFIT_ASSIGN_OR_RETURN(ProducerLayout layout, ReadLayoutFile(args.layout));
    sharded = ShardedModel{std::move(layout), {}};
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> checkpoint,
                         SafetensorsFile::Open(args.checkpoint));
  const std::vector<TensorView> model = checkpoint->tensors();
  if (sharded.has_value()) {
    for (const TensorView& tensor : model) sharded->locals.push_back(ExportTensor::Host(tensor));
  }
  std::unique_ptr<SafetensorsFile> base_file;
  std::vector<TensorView> base;
  if (!args.base.empty()) {
    REFIT_ASSIGN_OR_RETURN(base_file, SafetensorsFile::Open(args.base));
    base = base_file->tensors();
    REFIT_RETURN_NOT_OK(CheckSameTensors(base, model));
  }

  REFIT_ASSIGN_OR_RETURN(PublisherOptions options, config::ToPublisherOptions(config));
  options.transport_uri = transport_uri;
  // Each push is a trainer restarted from --base (or anchoring): it continues the run the fleet
  // holds as its next epoch (docs/protocol.md "Lineage and fencing"), so pushes follow one
  // another with deltas, and a push a newer one superseded is refused.
  options.resume = true;
  options.transfer_timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1e3));
  // A control call never outlives the push's budget, whatever a receiver does.
  options.control.timeout = std::min(options.control.timeout, options.transfer_timeout);
  // Every rank holds the key: the group's ranks authenticate with it too.
  const std::string api_key = options.control.api_key;
  std::optional<uint64_t> fleet_version;
  if (!leader) {
    options.receivers.clear();
  } else if (!mpi.active) {
    // Under mpi:// the receivers are the job's ranks, asked at Sync; the first Sync takes their
    // version.
    REFIT_ASSIGN_OR_RETURN(fleet_version,
                           FleetVersion(options, config.http_refit_api_key_env_var, deadline));
  }
  std::vector<std::unique_ptr<ProducerGroup>> groups;
  if (mpi.active) {
#if REFIT_HAVE_MPI
    REFIT_ASSIGN_OR_RETURN(const MpiJobInfo info, CurrentMpiJob());
    MpiGroupOptions group_options;
    group_options.communicator = info.producer_communicator;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeMpiGroup(group_options));
    groups.push_back(std::move(group));
#endif
  } else {
    REFIT_ASSIGN_OR_RETURN(const std::chrono::milliseconds left, time_left());
    REFIT_ASSIGN_OR_RETURN(groups, MakeGroups(args, api_key, left));
  }
  // The transfer gets what is left of the push's deadline.
  REFIT_ASSIGN_OR_RETURN(options.transfer_timeout, time_left());
  options.control.timeout = std::min(options.control.timeout, options.transfer_timeout);
  std::vector<std::unique_ptr<Publisher>> publishers;
  for (std::unique_ptr<ProducerGroup>& group : groups) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Publisher> publisher,
                           Publisher::Make(options, std::move(group)));
    if (!args.base.empty()) {
      // Only rank 0 asked the fleet which version it holds; the others learn it from rank 0.
      REFIT_RETURN_NOT_OK(
          publisher->AdoptBaseline(base, publisher->rank() == 0 ? fleet_version : std::nullopt));
    }
    publishers.push_back(std::move(publisher));
  }

  // Every rank syncs at once; in-process ranks each on a thread of their own.
  const bool anchor = args.anchor || args.base.empty();
  std::vector<Result<SyncReport>> results(publishers.size(), Status(StatusCode::kInternal, ""));
  {
    std::vector<std::jthread> threads;
    for (size_t p = 1; p < publishers.size(); ++p) {
      threads.emplace_back([&, p] { results[p] = publishers[p]->Sync(model, anchor); });
    }
    results[0] = sharded.has_value() ? publishers[0]->Sync(*sharded, anchor)
                                     : publishers[0]->Sync(model, anchor);
  }
#if REFIT_HAVE_MPI
  if (mpi.active) {
    // The job ends with this push: the receivers' `refit serve` exit once every producer closed.
    publishers.clear();
    groups.clear();
    const Status closed = CloseMpiJob();
    FinalizeMpi();
    REFIT_RETURN_NOT_OK(results[0].status());
    REFIT_RETURN_NOT_OK(closed);
  }
#endif
  REFIT_RETURN_NOT_OK(results[0].status());
  uint64_t model_bytes = 0;
  for (const TensorView& tensor : model) model_bytes += tensor.bytes.size();
  PrintReport(args, *results[0], model_bytes, options.stream.chunk_bytes);
  return Status::OK();
}

}  // namespace

void RegisterPush(CLI::App& app, Status* result) {
  auto args = std::make_shared<PushArgs>();
  CLI::App* cmd = app.add_subcommand(
      "push", "Send a safetensors checkpoint to running `refit serve` daemons and commit it");
  cmd->add_option("checkpoint", args->checkpoint, "The checkpoint to send (safetensors)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--config", args->config,
                  "A refit YAML file (docs/configuration.md); flags override its values")
      ->check(CLI::ExistingFile);
  cmd->add_option("--receiver", args->receivers,
                  "CONTROL_URL=DATA_ENDPOINT of each receiver, in relay-tree order (repeat), "
                  "e.g. http://127.0.0.1:8081=127.0.0.1:5555; replaces the file's receivers")
      ->allow_extra_args(false);
  cmd->add_option("--base", args->base,
                  "The checkpoint the receivers hold now: send only what changed (default: a "
                  "FULL anchor)")
      ->check(CLI::ExistingFile);
  cmd->add_flag("--anchor", args->anchor, "Send every element even with --base");
  cmd->add_option("--layout", args->layout,
                  "A sharded rank's layout (JSON: a list of pieces {tensor, dtype, shape, offset, "
                  "extent[, local, local_shape, local_offset]}; docs/sharded.md): the checkpoint "
                  "is then this rank's local tensors, and it sends only its own boxes. Every "
                  "rank of the group passes one; the push is an anchor")
      ->check(CLI::ExistingFile);
  // Flags that set a key of the configuration file: each value is read and checked as the
  // file's would be, and wins over the file (docs/configuration.md).
  const auto config_flag = [&](const char* flag, std::vector<const char*> keys, const char* help,
                               const char* default_text) {
    cmd->add_option_function<std::string>(
           flag,
           [args, flag, keys](const std::string& value) {
             for (const char* key : keys) args->overrides.push_back({key, value, flag});
           },
           help)
        ->default_str(default_text);
  };
  config_flag("--anchor-compression", {"delta_compression.anchor_compression"},
              "How an anchor's payloads are compressed: auto (measure the compressor against the "
              "link, compress only if it is faster), zstd, none (raw)",
              "auto");
  config_flag("--item-coding", {"delta_compression.item_coding"},
              "Whether a delta's XOR items are context-coded (payload format v2, coded given the "
              "old values the receiver holds: fewer bytes for an O(model) pass at the receiver): "
              "auto (where the transport's link is slow or billed: s3://, file://), context, plain",
              "auto");
  config_flag("--transport", {"transport"},
              "Transport URI for the payloads (zmq://?timeout_ms=…&api_key_env=…&curve_…)",
              "zmq://");
  config_flag("--api-key-env", {"http_refit_api_key_env_var"},
              "Environment variable holding the control plane's api key", "");
  config_flag("--chunk-bytes", {"delta_compression.export_chunk_bytes"},
              "The export chunk: the model is cut, in canonical order, into chunks of about this "
              "size, and rank k of W sends chunks k, k + W, ...; a model smaller than one chunk "
              "is sent by rank 0 alone. Every rank must give the same value",
              "256MiB");
  config_flag("--commit-policy", {"commit_policy"},
              "When the push commits although some receivers did not flush: all (one failure "
              "aborts everywhere), or quorum:N | quorum:F | quorum:P% of the replicas, the others "
              "fenced (rolled back, listed as fenced) and caught up by the next push",
              "all");
  cmd->add_option("--producers", args->producers,
                  "Producer ranks W as threads of this process (chunk k goes to k % W)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--group", args->group,
                  "Run as one rank of a multi-process producer group: tcp://HOST:PORT, where rank "
                  "0 listens and the other ranks connect (authenticated by the api key). Each "
                  "rank sends the export chunks it owns (chunk k: rank k % W; see --chunk-bytes); "
                  "rank 0 also coordinates the receivers");
  cmd->add_option("--rank", args->rank, "This process's rank in --group (0 coordinates)")
      ->capture_default_str();
  cmd->add_option("--world-size", args->world_size, "The number of ranks W in --group")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  config_flag("--threads", {"tuning.encode_workers", "tuning.transfer_workers"},
              "Threads of the encode and the send stage (tuning.encode_workers and "
              "tuning.transfer_workers; default: the file's, else 8 and 4)",
              "");
  cmd->add_option("--timeout", args->timeout_s,
                  "Seconds the whole push may take, every phase and retry included (aborting a "
                  "failed transfer may take one more)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", args->json, "Print the result as one JSON line");
  cmd->callback([args, result] { *result = RunPush(*args); });
}

}  // namespace refit::cli
