// mpi:// under a real mpirun: producers (Publishers over the MPI producer group) and receivers
// (ReceiverNodes) as ranks of MPI_COMM_WORLD, nothing but the communicator between them. ctest
// runs it with -np 2 … 6. Usage:
//
//   mpi_transport_test refit P [CHUNK_BYTES [SCHEME]]   ranks 0 … P−1 produce, the others
//                                                      receive; SCHEME mpi (default) or nccl
//   mpi_transport_test mismatch                         rank 1 claims another protocol version
//
// With nccl and no CUDA device on some rank, every rank prints SKIP and exits 77 (ctest's
// SKIP_RETURN_CODE): the NCCL path has to run on a GPU machine (scripts/gpu-tests.sh).
//
// `refit` runs, in order, checking every receiver bit for bit against the model it computes
// itself after every step (the ranks meet at an MPI_Barrier on MPI_COMM_WORLD between steps):
//   1 a delta;  2 nothing changed: one broadcast (`done`) per producer, nothing else;
//   3 a forced anchor;  4 a payload that fails its checksum (fault+mpi://?corrupt=1): aborted,
//   every receiver still holds step 3 exactly, and the job goes on;  5, 6 deltas;
//   7 the additive mode (op add, bf16 deltas), whose inexact elements are demoted to overwrite.
// Every rank checks what it sees; the exit status is non-zero on any mismatch (mpirun passes it
// on). A plain program: every rank must make the same collectives in the same order.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/half_float.h"
#include "refit/mpi.h"
#include "refit/mpi_producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "util/splitmix64.h"

namespace refit {
namespace {

int failures = 0;
int my_rank = -1;

void Check(bool condition, std::string_view what) {
  if (condition) return;
  std::fprintf(stderr, "mpi_transport_test rank %d: FAILED: %.*s\n", my_rank,
               static_cast<int>(what.size()), what.data());
  ++failures;
}

void CheckOk(const Status& status, std::string_view what) {
  Check(status.ok(), fmt::format("{}: {}", what, status.ToString()));
}

// The model every rank computes for itself: odd names, a tensor smaller than any chunk, bf16
// and f32.
struct TensorSpec {
  std::string name;
  DType dtype;
  Shape shape;
};
const std::vector<TensorSpec>& Specs() {
  static const std::vector<TensorSpec> specs = {
      {"model.embed_tokens.weight", DType::kBFloat16, {64, 48}},
      {"layers.0/attn:q_proj.weight", DType::kBFloat16, {32, 32}},
      {"layers.0.norm", DType::kFloat32, {32}},
      {"tiny", DType::kBFloat16, {3}},
      {"layers.1.mlp.down_proj.weight", DType::kBFloat16, {96, 40}}};
  return specs;
}

std::vector<OwnedTensor> InitialModel() {
  std::vector<OwnedTensor> model;
  for (size_t t = 0; t < Specs().size(); ++t) {
    const TensorSpec& spec = Specs()[t];
    OwnedTensor tensor{spec.name, spec.dtype, spec.shape, {}};
    const uint64_t numel = *NumElements(spec.shape);
    tensor.bytes.resize(numel * DTypeSize(spec.dtype));
    for (uint64_t i = 0; i < numel; ++i) {
      const float value =
          static_cast<float>(
              static_cast<int64_t>(internal::SplitMix64Hash(t * 1000003 + i) % 2001) - 1000) /
          512.0f;
      if (spec.dtype == DType::kBFloat16) {
        const uint16_t bits = FloatToBFloat16(value);
        std::memcpy(tensor.bytes.data() + 2 * i, &bits, 2);
      } else {
        std::memcpy(tensor.bytes.data() + 4 * i, &value, 4);
      }
    }
    model.push_back(std::move(tensor));
  }
  return model;
}

// Step `step`'s update, the same on every rank: about 3 % of the elements get a small
// optimizer-like change. `additive` changes values by adding (what op add carries).
void Update(std::vector<OwnedTensor>& model, uint32_t step) {
  for (size_t t = 0; t < model.size(); ++t) {
    OwnedTensor& tensor = model[t];
    const uint64_t numel = tensor.bytes.size() / DTypeSize(tensor.dtype);
    for (uint64_t i = 0; i < numel; ++i) {
      const uint64_t h = internal::SplitMix64Hash((uint64_t{step} << 40) ^ (t << 32) ^ i);
      if (h % 100 >= 3) continue;
      const float delta = static_cast<float>(static_cast<int64_t>(h >> 40) % 9 - 4) / 128.0f;
      if (tensor.dtype == DType::kBFloat16) {
        uint16_t bits = 0;
        std::memcpy(&bits, tensor.bytes.data() + 2 * i, 2);
        bits = FloatToBFloat16(BFloat16ToFloat(bits) + delta + 1.0f / 4096);
        std::memcpy(tensor.bytes.data() + 2 * i, &bits, 2);
      } else {
        float value = 0;
        std::memcpy(&value, tensor.bytes.data() + 4 * i, 4);
        value += delta + 1e-3f;
        std::memcpy(tensor.bytes.data() + 4 * i, &value, 4);
      }
    }
  }
}

std::vector<TensorView> Views(const std::vector<OwnedTensor>& model) {
  std::vector<TensorView> views;
  for (const OwnedTensor& tensor : model) views.push_back(tensor.view());
  return views;
}

// Every rank at one point: producers after their Sync, receivers idle.
void Meet() { MPI_Barrier(MPI_COMM_WORLD); }

int RunMismatch() {
  MpiJobOptions options;
  options.producers = 1;
  options.timeout = std::chrono::seconds(20);
  if (my_rank == 1) options.protocol_version = kMpiProtocolVersion + 1;
  const auto start = std::chrono::steady_clock::now();
  Result<MpiJobInfo> joined = JoinMpiJob(options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Check(joined.status().code() == StatusCode::kFailedPrecondition,
        fmt::format("a mismatched protocol must be refused on every rank, got {}",
                    joined.status().ToString()));
  Check(joined.status().message().find("protocol") != std::string::npos,
        fmt::format("the refusal names the protocol: {}", joined.status().ToString()));
  Check(seconds < 20, fmt::format("refused within the timeout, took {:.1f} s", seconds));
  if (my_rank == 0) std::printf("mismatch refused: %s\n", joined.status().ToString().c_str());
  return failures == 0 ? 0 : 1;
}

struct Producer {
  std::unique_ptr<Publisher> good;
  std::unique_ptr<Publisher> corrupting;
  std::unique_ptr<Publisher> additive;
};

// Every publisher of the test is a trainer of one run: the first starts it, each later one
// (another transport, another op, a restart) resumes it as its next epoch, which fences the ones
// before (docs/protocol.md "Lineage and fencing").
Result<std::unique_ptr<Publisher>> MakePublisher(const MpiJobInfo& info, std::string uri,
                                                 uint64_t chunk_bytes, Op op, bool resume) {
  MpiGroupOptions group_options;
  group_options.communicator = info.producer_communicator;
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ProducerGroup> group, MakeMpiGroup(group_options));
  PublisherOptions options;
  options.transport_uri = std::move(uri);
  options.stream.chunk_bytes = chunk_bytes;
  options.tracker.op = op;
  options.transfer_timeout = std::chrono::seconds(60);
  options.control.timeout = std::chrono::seconds(30);
  options.run_id = "mpi-transport-test";
  options.resume = resume;
  return Publisher::Make(options, std::move(group));
}

constexpr int kSkipped = 77;

// nccl:// on a rank without a CUDA device: refused on every rank alike.
bool NoDevice(const Status& status) {
  return status.code() == StatusCode::kFailedPrecondition &&
         status.message().find("CUDA device") != std::string::npos;
}

int RunRefit(uint32_t producers, uint64_t chunk_bytes, const std::string& scheme) {
  const std::string uri = fmt::format("{}://?producers={}&timeout_ms=60000", scheme, producers);
  MpiJobOptions job_options;
  job_options.producers = producers;
  job_options.timeout = std::chrono::seconds(60);
  Result<MpiJobInfo> joined = JoinMpiJob(job_options);
  if (!joined.ok()) {
    Check(false, joined.status().ToString());
    return 1;
  }
  const MpiJobInfo info = *joined;
  std::vector<OwnedTensor> model = InitialModel();
  std::vector<OwnedTensor> held;  // a receiver's registered memory
  std::unique_ptr<ReceiverNode> node;
  Producer producer;

  if (info.producer) {
    Result<std::unique_ptr<Publisher>> good =
        MakePublisher(info, uri, chunk_bytes, Op::kXor, false);
    if (NoDevice(good.status())) {
      std::printf("SKIP: %s\n", good.status().ToString().c_str());
      MPI_Barrier(MPI_COMM_WORLD);
      return kSkipped;
    }
    Result<std::unique_ptr<Publisher>> bad =
        MakePublisher(info, "fault+" + uri + "&corrupt=1", chunk_bytes, Op::kXor, true);
    Result<std::unique_ptr<Publisher>> add = MakePublisher(info, uri, chunk_bytes, Op::kAdd, true);
    CheckOk(good.status(), "publisher");
    CheckOk(bad.status(), "corrupting publisher");
    CheckOk(add.status(), "additive publisher");
    if (!good.ok() || !bad.ok() || !add.ok()) return 1;
    producer = {std::move(good).ValueOrDie(), std::move(bad).ValueOrDie(),
                std::move(add).ValueOrDie()};
    CheckOk(producer.good->AdoptBaseline(Views(model), 0), "adopt");
    CheckOk(producer.corrupting->AdoptBaseline(Views(model), 0), "adopt (corrupting)");
  } else {
    held = InitialModel();
    ReceiverNodeOptions options;
    options.transport_uri = uri;
    options.version = 0;
    Result<std::unique_ptr<ReceiverNode>> made = ReceiverNode::Make(options);
    if (NoDevice(made.status())) {
      MPI_Barrier(MPI_COMM_WORLD);
      return kSkipped;
    }
    CheckOk(made.status(), "receiver node");
    if (!made.ok()) return 1;
    node = std::move(made).ValueOrDie();
    for (OwnedTensor& tensor : held)
      CheckOk(node->RegisterTensor(tensor.mutable_view()), "register");
    CheckOk(node->Start(), "start");
  }
  Meet();  // every receiver listens before the first sync

  // One step: the producers sync `publisher` (which must succeed or fail as `succeeds` says);
  // then every receiver compares its memory with `expected` and its version with `version`.
  auto step = [&](std::string_view name, Publisher* publisher, bool force_anchor, bool succeeds,
                  const std::vector<OwnedTensor>& expected, uint64_t version) {
    if (info.producer) {
      const MpiJobStats before = GetMpiJobStats();
      Result<SyncReport> synced = publisher->Sync(Views(model), force_anchor);
      const MpiJobStats after = GetMpiJobStats();
      if (succeeds) {
        CheckOk(synced.status(), fmt::format("step {}", name));
        if (synced.ok()) {
          Check(synced->transfer.plan.target_version == version,
                fmt::format("step {}: version {} (expected {})", name,
                            synced->transfer.plan.target_version, version));
          if (info.index == 0) {
            Check(synced->transfer.plan.anchor == force_anchor,
                  fmt::format("step {}: anchor {}", name, synced->transfer.plan.anchor));
          }
        }
        if (name == "unchanged") {
          Check(after.broadcasts_sent - before.broadcasts_sent == 1,
                fmt::format("an empty delta costs one broadcast per producer, producer {} made {}",
                            info.index, after.broadcasts_sent - before.broadcasts_sent));
        }
      } else {
        Check(!synced.ok(), fmt::format("step {} must fail", name));
        if (info.index == 0) {
          std::printf("step %.*s failed as it must: %s\n", static_cast<int>(name.size()),
                      name.data(), synced.status().ToString().c_str());
        }
      }
    }
    Meet();
    if (!info.producer) {
      const ReceiverStatus status = node->status();
      Check(status.state == ReceiverState::kIdle && status.version == version,
            fmt::format("step {}: receiver {} is {} at version {} (expected idle at {})", name,
                        info.index, ReceiverStateName(status.state), status.version, version));
      for (size_t t = 0; t < held.size(); ++t) {
        Check(held[t].bytes == expected[t].bytes,
              fmt::format("step {}: receiver {} tensor '{}' differs from the trainer's", name,
                          info.index, held[t].name));
      }
    }
    Meet();
  };

  Update(model, 1);
  step("delta", producer.good.get(), false, true, model, 1);
  step("unchanged", producer.good.get(), false, true, model, 2);
  Update(model, 3);
  step("anchor", producer.good.get(), true, true, model, 3);
  const std::vector<OwnedTensor> before_corruption = [&] {
    std::vector<OwnedTensor> copy;
    for (const OwnedTensor& tensor : model) copy.push_back(tensor);
    return copy;
  }();
  Update(model, 4);
  step("corrupted", producer.corrupting.get(), false, false, before_corruption, 3);
  if (info.producer) {
    // The corrupting trainer's prepare fenced the first: a restarted one resumes the run from the
    // version the fleet holds.
    Result<std::unique_ptr<Publisher>> restarted =
        MakePublisher(info, uri, chunk_bytes, Op::kXor, true);
    CheckOk(restarted.status(), "restarted publisher");
    if (!restarted.ok()) return 1;
    producer.good = std::move(restarted).ValueOrDie();
    CheckOk(producer.good->AdoptBaseline(Views(before_corruption), 3), "adopt (restarted)");
  }
  step("after-corruption", producer.good.get(), false, true, model, 4);
  Update(model, 5);
  step("delta-again", producer.good.get(), false, true, model, 5);
  if (info.producer) CheckOk(producer.additive->AdoptBaseline(Views(model), 5), "adopt (add)");
  Update(model, 6);
  step("additive", producer.additive.get(), false, true, model, 6);

  if (info.producer) {
    CheckOk(CloseMpiJob(), "close");
    producer = {};
  } else {
    CheckOk(WaitForMpiJobEnd({}), "wait for the job's end");
    node->Stop();
    node.reset();
  }
  const MpiJobStats stats = GetMpiJobStats();
  std::printf("rank %d (%s %u): %llu broadcasts sent, %llu received, %llu bytes in, %llu control\n",
              my_rank, info.producer ? "producer" : "receiver", info.index,
              static_cast<unsigned long long>(stats.broadcasts_sent),
              static_cast<unsigned long long>(stats.broadcasts_received),
              static_cast<unsigned long long>(stats.bytes_received),
              static_cast<unsigned long long>(stats.control_messages));
  FinalizeMpi();
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &refit::my_rank);
  const std::string scenario = argc > 1 ? argv[1] : "";
  int result = 2;
  if (scenario == "mismatch") {
    result = refit::RunMismatch();
    MPI_Finalize();
  } else if (scenario == "refit" && argc > 2) {
    const uint32_t producers = static_cast<uint32_t>(std::stoul(argv[2]));
    const uint64_t chunk_bytes = argc > 3 ? std::stoull(argv[3]) : 4096;
    const std::string scheme = argc > 4 ? argv[4] : "mpi";
    result = refit::RunRefit(producers, chunk_bytes, scheme);
    // The caller initialized MPI, so FinalizeMpi freed refit's communicators but left it open.
    MPI_Finalize();
  } else {
    std::fprintf(stderr,
                 "usage: mpi_transport_test refit PRODUCERS [CHUNK_BYTES [mpi|nccl]] | mismatch\n");
  }
  return result;
}
