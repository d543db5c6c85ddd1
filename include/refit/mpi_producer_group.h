// The MPI producer group: the ranks of an MPI communicator (mpirun, Slurm's srun with PMI), for a
// trainer that already runs under MPI. MakeMpiGroup exists only in builds that found MPI: they
// define REFIT_HAVE_MPI=1 for everything that links refit_node.
//
// Failure model, and how it differs from the TCP group. MPI decides what a dead rank does: with
// Open MPI and MPICH the default is to abort the whole job, which is the failure report. The
// group's communicator returns errors instead of aborting (MPI_ERRORS_RETURN), so an
// implementation that reports a failed peer gives Unavailable. A deadline is honoured by
// polling non-blocking collectives (MPI_Ibcast, MPI_Iallgather, MPI_Igatherv), but a collective
// that timed out cannot be cancelled — MPI forbids cancelling a collective — so the group is
// then unusable: the call returns DeadlineExceeded and every later call FailedPrecondition. A
// rank cannot rejoin; the job restarts as a whole.
#pragma once

#include <cstdint>
#include <memory>

#include "refit/producer_group.h"
#include "refit/status.h"

namespace refit {

/// Options of MakeMpiGroup.
struct MpiGroupOptions {
  /// The communicator whose ranks form the group, as its C handle (`MPI_Comm`) converted to an
  /// integer, so that this header needs no mpi.h: with Open MPI, where MPI_Comm is a pointer,
  /// `reinterpret_cast<uintptr_t>(comm)`; with MPICH, where it is an int, `static_cast`; from
  /// mpi4py, `MPI._handleof(comm)`. 0 means MPI_COMM_WORLD. The group works on its own
  /// duplicate (MPI_Comm_dup), so its messages never match the caller's own traffic on it.
  uintptr_t communicator = 0;
  /// The largest message accepted (ResourceExhausted beyond it), as TcpGroupOptions. It must be
  /// the same on every rank (MakeMpiGroup checks): a collective involves every rank, so all of
  /// them must agree that a message is refused.
  uint64_t max_message_bytes = uint64_t{256} << 20;
};

/// Make this process's endpoint of an MPI group: rank and world size are those of the
/// communicator. Collective: every rank of the communicator must call it, and it blocks (with
/// no deadline) until they all have.
///
/// Initializes MPI (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, which an mpi:// transport in
/// the same process needs; the group itself needs only MPI_THREAD_SERIALIZED: its calls may come
/// from any one thread at a time) unless the caller already did; finalizing is the caller's
/// business, after every group is destroyed (FinalizeMpi in refit/mpi.h).
///
/// Thread-safety: as ProducerGroup. If the caller initialized MPI with less than
/// MPI_THREAD_SERIALIZED, the group must be used from the thread MPI allows.
/// Errors: FailedPrecondition (MPI already finalized), InvalidArgument (max_message_bytes
/// differs between ranks), Unavailable (an MPI call failed).
Result<std::unique_ptr<ProducerGroup>> MakeMpiGroup(const MpiGroupOptions& options = {});

}  // namespace refit
