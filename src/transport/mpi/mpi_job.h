// The communicators of an MPI job (refit/mpi.h) and the waits everything on them shares.
//
//   data(p)    producer p and the receivers; p is rank 0, receiver i is rank i + 1. Producer p's
//              payloads are broadcasts rooted at 0, so producers never wait for each other and a
//              producer owning nothing costs the receivers one `done` broadcast per transfer.
//   control    every rank (a duplicate of the job's communicator): point-to-point requests from
//              producer 0, the coordinator, to receiver i at rank P + i, and their replies.
//   producers  the producer ranks alone, for the producer group (MakeMpiGroup).
//
// Waits poll MPI_Test (or MPI_Improbe) with a pause that doubles from 20 µs to 1 ms, until the
// request completes, the deadline passes or a stop is requested. A collective that did not
// complete cannot be cancelled: its buffers are kept for the rest of the process and the job is
// marked broken, which every later call reports.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <type_traits>
#include <vector>

#include "refit/mpi.h"
#include "refit/status.h"
#include "refit/transport.h"
#include "util/mutex.h"
#include "util/thread_annotations.h"

namespace refit::internal {

/// The message tags of the control communicator.
inline constexpr int kMpiRequestTag = 1;
inline constexpr int kMpiReplyTag = 2;
inline constexpr int kMpiCloseTag = 3;

/// The most bytes one MPI call moves: its counts are ints. Payloads are broadcast in slices of
/// this size, which both ends compute from the header.
inline constexpr uint64_t kMpiSliceBytes = uint64_t{1} << 30;

std::string MpiErrorText(int code);

/// The communicator behind an integer handle (MpiJobOptions::communicator): MPI_Comm is a
/// pointer in Open MPI, an int in MPICH.
template <typename Comm = MPI_Comm>
Comm CommFromHandle(uintptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    return static_cast<Comm>(handle);
  }
}

/// The integer handle of `comm`, as MpiJobOptions::communicator and MakeMpiGroup take it.
template <typename Comm>
uintptr_t HandleOf(Comm comm) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<uintptr_t>(comm);
  } else {
    return static_cast<uintptr_t>(comm);
  }
}

/// Keep `buffers` alive until the process exits: MPI may still write into them.
void KeepForever(std::shared_ptr<void> buffers);

/// The data plane of a job: one producer's broadcast to the receivers of its data
/// communicator. mpi:// broadcasts with MPI_Ibcast; nccl:// with ncclBroadcast through device
/// buffers (nccl_collective.cc, builds with CUDA and NCCL).
class DataCollective {
 public:
  virtual ~DataCollective() = default;
  /// "mpi" or "nccl", for messages.
  virtual std::string_view name() const = 0;
  /// Broadcast `size` bytes at `bytes` from producer `producer` (the root) to the receivers; the
  /// root's bytes are read, the others' written. Waits as MpiJob::Wait does; on a timeout or a
  /// stop the job is broken and `owner` (what holds `bytes`) is kept forever.
  virtual Status Broadcast(uint32_t producer, std::byte* bytes, uint64_t size,
                           std::chrono::steady_clock::time_point deadline,
                           const std::stop_token& stop, std::shared_ptr<void> owner,
                           const std::string& what) = 0;
};

class MpiJob {
 public:
  /// The job of this process, made by the first call (collective) and returned by later ones.
  static Result<MpiJob*> Join(const MpiJobOptions& options);
  /// The joined job, or null.
  static MpiJob* Current();

  const MpiJobInfo& info() const { return info_; }
  const MpiJobOptions& options() const { return options_; }
  /// Producer p's data communicator (MPI_COMM_NULL on the other producers).
  MPI_Comm data(uint32_t producer) const { return data_[producer]; }
  MPI_Comm control() const { return control_; }
  /// The control communicator's rank of receiver `index`, and of the coordinator.
  int ReceiverRank(uint32_t index) const { return static_cast<int>(info_.producers + index); }
  static constexpr int kCoordinatorRank = 0;

  /// Wait for `request` until `deadline` or `stop`. On DeadlineExceeded or Cancelled the request
  /// is still pending: `buffers` (what it reads or writes) are kept forever and, for a
  /// collective, the job is marked broken. Errors name `what`.
  Status Wait(MPI_Request& request, std::chrono::steady_clock::time_point deadline,
              const std::stop_token& stop, bool collective, std::shared_ptr<void> buffers,
              const std::string& what);
  /// Broadcast `bytes` (any length) from `root` on `comm` in kMpiSliceBytes slices, waiting for
  /// each as Wait does. `bytes` must stay valid until it returns; on a timeout it is kept
  /// through `owner`.
  Status Broadcast(std::byte* bytes, uint64_t size, int root, MPI_Comm comm,
                   std::chrono::steady_clock::time_point deadline, const std::stop_token& stop,
                   std::shared_ptr<void> owner, const std::string& what);

  /// The job's data plane: MPI's own broadcasts unless nccl:// installed another.
  DataCollective& data_plane() {
    MutexLock lock(data_plane_mutex_);
    return *data_plane_;
  }
  /// Install `plane` (nccl://) as the job's data plane. Errors: FailedPrecondition when another
  /// kind was installed or used already: every message of a job goes one way.
  Status UseDataPlane(std::unique_ptr<DataCollective> plane);
  /// Mark the data plane as in use by a transport of kind `name` (its first sender or listener).
  Status ClaimDataPlane(std::string_view name);
  /// Mark the job broken (a collective that never completed).
  void MarkBroken() { broken_ = true; }

  /// Held by whoever broadcasts on this producer's data communicator (the sender of a transfer,
  /// CloseMpiJob): its messages must not interleave.
  internal::Mutex& data_mutex() { return data_mutex_; }

  /// FailedPrecondition once a collective timed out.
  Status CheckUsable() const;
  bool broken() const { return broken_.load(); }

  /// Counters (refit/mpi.h).
  MpiJobStats stats() const;
  void CountSent(uint64_t bytes) {
    broadcasts_sent_.fetch_add(1);
    bytes_sent_.fetch_add(bytes);
  }
  void CountReceived(uint64_t bytes) {
    broadcasts_received_.fetch_add(1);
    bytes_received_.fetch_add(bytes);
  }
  void CountControl() { control_messages_.fetch_add(1); }

  /// Receivers: the job's end, as producers announce it.
  void MarkDataClosed(uint32_t producer);
  void MarkControlClosed();
  Status WaitForEnd(std::stop_token stop);

  /// Free the communicators and finalize (refit/mpi.h FinalizeMpi).
  void Finalize();

 private:
  MpiJob() = default;
  Status Build(const MpiJobOptions& options);

  MpiJobOptions options_;
  MpiJobInfo info_;
  bool initialized_mpi_ = false;
  MPI_Comm base_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;
  MPI_Comm producer_comm_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> data_;
  internal::Mutex data_mutex_;
  Mutex data_plane_mutex_;
  std::unique_ptr<DataCollective> data_plane_ REFIT_GUARDED_BY(data_plane_mutex_);
  std::string data_plane_claimed_ REFIT_GUARDED_BY(data_plane_mutex_);
  std::atomic<bool> broken_{false};
  std::atomic<uint64_t> broadcasts_sent_{0};
  std::atomic<uint64_t> broadcasts_received_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> control_messages_{0};

  Mutex end_mutex_;
  CondVar end_changed_;
  uint32_t data_closed_ REFIT_GUARDED_BY(end_mutex_) = 0;
  bool control_closed_ REFIT_GUARDED_BY(end_mutex_) = false;
  bool finalized_ REFIT_GUARDED_BY(end_mutex_) = false;
};

/// The job a collective transport URI (mpi://, nccl://) names: its layout parameters
/// (producers, shard_group, timeout_ms), joined on first use. Errors: InvalidArgument (an
/// unknown parameter, a target other than "world"); those of MpiJob::Join.
Result<MpiJob*> JoinMpiJobOfUri(const TransportUri& uri);

/// The transport of the job's data plane for `uri`'s scheme (which must be the plane's kind).
Result<std::unique_ptr<Transport>> MakeCollectiveTransport(const TransportUri& uri,
                                                           const TransportOptions& options,
                                                           MpiJob& job);

}  // namespace refit::internal
