// The sections of e2e_bench, each a Run… that measures on loopback and returns every figure as
// JSON and a Print… that prints those figures as tables; main.cc's Run calls them in this order.
// Also the entry points of the child processes the executable re-executes itself as.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "e2e/harness.h"
#include "refit/status.h"

namespace refit::bench::e2e {

// The end-to-end section refits one daemon: the fan-out section covers more.
constexpr size_t kEndToEndReceivers = 1;
// argv[1] of this executable re-executed as the embedded section's receiver process, or as one
// rank of the producers section's persistent rank processes.
constexpr std::string_view kEmbeddedChildFlag = "--internal-embedded-receiver";
constexpr std::string_view kProducerRankFlag = "--internal-producer-rank";

// --- end to end (end_to_end.cc) ----------------------------------------------------------------

// One producer (this process) refits one `refit serve` daemon over zmq:// + the HTTP control
// plane, on a bf16 model of --model-mib: one training step at each --densities value, each
// followed by a delta refit, then a FULL transfer of the same model (the yardstick: same
// transport, same fleet, same run). Per refit: wire bytes, time, and the peak RSS of both
// processes during that refit, against the model bytes each holds.
Result<nlohmann::json> RunEndToEnd(const Args& args, const std::string& work_dir);
void PrintEndToEnd(const nlohmann::json& e2e, const Args& args);

// --- fan-out (fan_out.cc) ----------------------------------------------------------------------

// 1, 2, 4, 8 daemons (--fanout) through the relay tree on a smaller model: one delta at
// --fanout-density and a FULL for each fleet size. The producer sends every payload once to its
// root relay, so its wire bytes must not grow with N; every daemon is downloaded tensor by tensor
// and compared with the producer's bytes.
Result<nlohmann::json> RunFanOut(const Args& args, const std::string& work_dir);
void PrintFanOut(const nlohmann::json& fanout);

// --- producers (producers.cc) ------------------------------------------------------------------

// W = 1, 2, 4 trainer ranks (--producers) refit the same daemons with the same delta steps, once
// as W Publisher threads of this process (in-process group) and once as W `refit push --group
// tcp://…` processes; time per refit, wire bytes and processes / threads per W.
Result<nlohmann::json> RunProducers(const Args& args, const std::string& work_dir);
void PrintProducers(const nlohmann::json& section);

// One rank of the producers section's persistent rank processes (this executable re-executed):
// what one process of a W-process trainer job does. It draws the initial model (the same seed as
// the benchmark), joins the TCP producer group and a second TCP group used only as a barrier,
// adopts the model as the fleet's, then per step: applies the step to its copy, waits at the
// barrier (so that the timed Sync starts with every rank ready, as a job's ranks arrive after the
// same optimizer step) and Syncs. Rank 0 writes every step's report to --result-file.
Status RunProducerRank(const ChildFlags& flags);

// --- tp (tensor_parallel.cc) -------------------------------------------------------------------

// One replica unsharded, then as a tensor-parallel shard group of TP = 2, 4 (--tp) `refit serve
// --loader … --replica …` daemons, each holding only its shard of a Llama-layout model (fused qkv
// and gate_up, column-sharded o/down, vocabulary-parallel embedding and lm_head); the same steps;
// time per refit against the unsharded one, and each shard's peak memory against its slice.
Result<nlohmann::json> RunTensorParallel(const Args& args, const std::string& work_dir);
void PrintTensorParallel(const nlohmann::json& section);

// --- elastic (elastic.cc) ---------------------------------------------------------------------

// A fleet of 8 embedded receivers (this process, loopback sockets) and 2 publisher ranks
// (threads): a laggard 3 versions behind and a newcomer with the step-0 weights join between
// syncs. The join sync twice from one seed — today's whole-fleet anchor, then per-receiver plans
// — with its time, the producers' egress and each receiver's bytes; the newcomer's catch-up (the
// join sync) against the raw copy of the model to one receiver (target <= 1.3x); the laggard's
// fold at the producers against the deltas it missed. Ratios in one run, NOT MET where not met.
Result<nlohmann::json> RunElastic(const Args& args, const std::string& work_dir);
void PrintElastic(const nlohmann::json& section);

// --- embedded (embedded.cc) --------------------------------------------------------------------

// A ReceiverNode embedded in a process of its own (this executable, re-executed) over buffers
// that process allocated and registered (no model file): its RSS after registering, during each
// delta and after commit.
Result<nlohmann::json> RunEmbedded(const Args& args, const std::string& work_dir);
void PrintEmbedded(const nlohmann::json& section);

// What the embedded section's receiver process is told on its command line.
struct EmbeddedChildArgs {
  uint64_t model_bytes = 0;
  uint64_t seed = 0;
  int threads = 1;
  std::string data_endpoint;
  std::string ready_file;
  std::string result_file;
};

// The flags of the receiver process (argv[2…]). Errors: InvalidArgument.
Result<EmbeddedChildArgs> ParseEmbeddedChildArgs(int argc, char** argv);

// The embedded section's receiver process: it draws the same synthetic model as the benchmark
// (same seed), registers those buffers with a ReceiverNode (no model file), serves until
// SIGTERM, then reports the fingerprint of its own buffers, read directly, not through the node.
// Its RSS at each stage goes into the ready file.
Status RunEmbeddedChild(const EmbeddedChildArgs& args);

}  // namespace refit::bench::e2e
