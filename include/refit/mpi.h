// MPI jobs: trainer ranks (producers, each a Publisher) and receivers (each a ReceiverNode) as the
// ranks of one MPI communicator, refit's collective transport `mpi://` (docs/transports.md,
// "mpi://"). Everything of a transfer travels on that communicator — payloads as broadcasts rooted
// at the producer that owns them, and the prepare/flush/commit/abort calls as point-to-point
// messages between producer 0 (the coordinator) and each receiver — so an MPI job needs no HTTP.
//
//   ranks 0 … P−1   producers: Publisher over MakeMpiGroup(producer_communicator)
//   ranks P … N−1   receivers: ReceiverNode with transport mpi://
//
// The declarations exist only in builds that found MPI (REFIT_HAVE_MPI=1).
#pragma once

#include <chrono>
#include <cstdint>
#include <stop_token>
#include <string>

#include "refit/status.h"
#include "refit/transfer.h"

namespace refit {

/// The protocol a rank speaks on the communicator ("refit-mpi/1", docs/protocol.md). Ranks of
/// different protocols refuse each other at JoinMpiJob, on every rank, within its timeout.
inline constexpr uint32_t kMpiProtocolVersion = 1;

/// The layout of an MPI job. Every rank must join with equal values (JoinMpiJob checks).
struct MpiJobOptions {
  /// The communicator whose ranks form the job, as MpiGroupOptions::communicator takes it (the
  /// C handle as an integer); 0 means MPI_COMM_WORLD. A launcher that runs other ranks too
  /// (a trainer with its own data-parallel world) hands in a sub-communicator.
  uintptr_t communicator = 0;
  /// Ranks 0 … producers − 1 of the communicator are producers; the others are receivers.
  uint32_t producers = 1;
  /// Receivers form replicas of this many consecutive ranks (the tensor-parallel shards of one
  /// generation engine): receiver i is shard i % shard_group of replica "mpi-<i / shard_group>".
  /// 1: every receiver is a replica of its own. The receiver count must be a multiple of it.
  uint32_t shard_group = 1;
  /// How long the set-up, a control call and a payload broadcast may wait for the other ranks.
  /// A collective that times out cannot be cancelled (MPI forbids it): the job is then broken,
  /// and every later call fails with FailedPrecondition.
  std::chrono::milliseconds timeout{std::chrono::minutes(2)};
  /// The protocol this rank claims. Only tests set another value, to check the refusal.
  uint32_t protocol_version = kMpiProtocolVersion;
};

/// What a rank is in its job.
struct MpiJobInfo {
  uint32_t rank = 0;
  uint32_t world_size = 0;
  bool producer = false;
  /// The producer id (producers) or the receiver index (receivers).
  uint32_t index = 0;
  uint32_t producers = 0;
  uint32_t receivers = 0;
  /// Receivers: their replica and shard (MpiJobOptions::shard_group).
  ReplicaPlace place;
  /// Producers: the communicator of the producer ranks alone, for MakeMpiGroup; 0 on receivers.
  uintptr_t producer_communicator = 0;
};

/// Counters of this rank's traffic on the job's communicators.
struct MpiJobStats {
  /// Broadcasts this rank took part in as root (sent) and as a receiver (received), each piece
  /// (header, metadata, payload) counted once, and their bytes.
  uint64_t broadcasts_sent = 0;
  uint64_t broadcasts_received = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  /// Control requests answered (receivers) or made (the coordinator).
  uint64_t control_messages = 0;
};

/// Join this process's MPI job: collective over the communicator; every rank must call it. It
/// initializes MPI (MPI_THREAD_MULTIPLE: a receiver listens to every producer and answers its
/// control channel on threads of its own) unless the caller did, builds one data communicator per
/// producer (that producer and the receivers) and a control communicator, and checks that every
/// rank speaks the same protocol with the same layout. The mpi:// transport joins on first use,
/// with the layout of its URI. A second call with equal options returns the same job.
/// Errors: InvalidArgument (a layout the world cannot hold: no receiver, producers ≥ world size,
/// receivers not a multiple of shard_group); FailedPrecondition (MPI initialized with less than
/// MPI_THREAD_MULTIPLE or already finalized; a rank with another protocol or layout, named; a
/// second call with other options); DeadlineExceeded (a rank did not join within the timeout);
/// Unavailable (an MPI call failed).
Result<MpiJobInfo> JoinMpiJob(const MpiJobOptions& options);

/// The job this process joined. Errors: FailedPrecondition when it joined none.
Result<MpiJobInfo> CurrentMpiJob();

/// This rank's counters (zero before it joined).
MpiJobStats GetMpiJobStats();

/// Producers: end the job. Every producer broadcasts `close` on its data communicator, and
/// producer 0 tells every receiver's control channel, after which the receivers'
/// WaitForMpiJobEnd returns. Call it on every producer, after its last Sync.
/// Errors: FailedPrecondition (a receiver, or no job); DeadlineExceeded; Unavailable.
Status CloseMpiJob();

/// Receivers: block until every producer closed the job (CloseMpiJob), or `stop` is requested.
/// Errors: FailedPrecondition (a producer, or no job); Cancelled when stopped first.
Status WaitForMpiJobEnd(std::stop_token stop);

/// Free the job's communicators and finalize MPI if refit initialized it. Call it last, after
/// every ReceiverNode, Publisher and producer group of the job is gone. A broken job (a
/// collective that timed out) is not finalized: MPI_Finalize would wait for it forever.
void FinalizeMpi();

}  // namespace refit
