#include "transport/mpi/mpi_job.h"

#include <algorithm>
#include <array>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::microseconds kFirstPause{20};
constexpr std::chrono::microseconds kMaxPause{1000};
// What every rank tells the others at the handshake: "refit-mpi" as a number, the protocol, and
// the layout, all of which must agree.
constexpr int64_t kHandshakeMagic = 0x69706d2d74696665;  // "efit-mpi", little-endian
constexpr int kHandshakeFields = 4;

// MPI's own broadcast on the job's data communicators.
class MpiBroadcast final : public DataCollective {
 public:
  explicit MpiBroadcast(MpiJob& job) : job_(job) {}
  std::string_view name() const override { return "mpi"; }
  Status Broadcast(uint32_t producer, std::byte* bytes, uint64_t size, Clock::time_point deadline,
                   const std::stop_token& stop, std::shared_ptr<void> owner,
                   const std::string& what) override {
    return job_.Broadcast(bytes, size, 0, job_.data(producer), deadline, stop, std::move(owner),
                          what);
  }

 private:
  MpiJob& job_;
};

Mutex job_mutex;
// Lives for the rest of the process once made.
MpiJob* job REFIT_GUARDED_BY(job_mutex) = nullptr;

Status MpiCall(int code, std::string_view what) {
  if (code == MPI_SUCCESS) return Status::OK();
  return Unavailable("mpi: {} failed: {}", what, MpiErrorText(code));
}

}  // namespace

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return fmt::format("MPI error {}", code);
  }
  return std::string(text, static_cast<size_t>(length));
}

void KeepForever(std::shared_ptr<void> buffers) {
  static internal::Mutex mutex;
  static std::vector<std::shared_ptr<void>> kept;
  internal::MutexLock lock(mutex);
  kept.push_back(std::move(buffers));
}

Result<MpiJob*> MpiJob::Join(const MpiJobOptions& options) {
  MutexLock lock(job_mutex);
  if (job != nullptr) {
    const MpiJobOptions& held = job->options_;
    if (held.communicator != options.communicator || held.producers != options.producers ||
        held.shard_group != options.shard_group ||
        held.protocol_version != options.protocol_version) {
      return FailedPrecondition(
          "mpi: this process joined a job of {} producer(s), shard group {}; it cannot join "
          "another layout ({} producer(s), shard group {})",
          held.producers, held.shard_group, options.producers, options.shard_group);
    }
    return job;
  }
  std::unique_ptr<MpiJob> made(new MpiJob());
  REFIT_RETURN_NOT_OK(made->Build(options));
  job = made.release();
  return job;
}

MpiJob* MpiJob::Current() {
  MutexLock lock(job_mutex);
  return job;
}

Status MpiJob::Build(const MpiJobOptions& options) {
  options_ = options;
  if (options.producers == 0) return InvalidArgument("mpi: producers must be at least 1");
  if (options.shard_group == 0) return InvalidArgument("mpi: shard_group must be at least 1");
  if (options.timeout.count() <= 0) {
    return InvalidArgument("mpi: timeout must be positive, got {} ms", options.timeout.count());
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) return FailedPrecondition("mpi: MPI was finalized before refit joined");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized == 0) {
    REFIT_RETURN_NOT_OK(MpiCall(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided),
                                "MPI_Init_thread"));
    initialized_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    return FailedPrecondition(
        "mpi: MPI runs with thread level {} but refit needs MPI_THREAD_MULTIPLE ({}): a "
        "receiver listens to every producer and answers its control channel on threads of its "
        "own; initialize MPI with MPI_Init_thread(…, MPI_THREAD_MULTIPLE, …)",
        provided, MPI_THREAD_MULTIPLE);
  }
  base_ =
      options.communicator == 0 ? MPI_COMM_WORLD : CommFromHandle<MPI_Comm>(options.communicator);
  int rank = 0;
  int size = 0;
  REFIT_RETURN_NOT_OK(MpiCall(MPI_Comm_rank(base_, &rank), "MPI_Comm_rank"));
  REFIT_RETURN_NOT_OK(MpiCall(MPI_Comm_size(base_, &size), "MPI_Comm_size"));
  info_.rank = static_cast<uint32_t>(rank);
  info_.world_size = static_cast<uint32_t>(size);
  if (options.producers >= info_.world_size) {
    return InvalidArgument(
        "mpi: {} producer(s) in a job of {} rank(s) leaves no receiver (run mpirun -np with "
        "more ranks, or fewer producers)",
        options.producers, info_.world_size);
  }
  info_.producers = options.producers;
  info_.receivers = info_.world_size - options.producers;
  if (info_.receivers % options.shard_group != 0) {
    return InvalidArgument("mpi: {} receiver(s) do not form shard groups of {}", info_.receivers,
                           options.shard_group);
  }
  info_.producer = info_.rank < options.producers;
  info_.index = info_.producer ? info_.rank : info_.rank - options.producers;
  if (!info_.producer) {
    info_.place.shards = options.shard_group;
    info_.place.shard = info_.index % options.shard_group;
    info_.place.replica =
        options.shard_group > 1 ? fmt::format("mpi-{}", info_.index / options.shard_group) : "";
  }

  // Our own duplicate, made without blocking so that a rank that never joins is a timeout, not a
  // hang; then the handshake on it.
  const Clock::time_point deadline = Clock::now() + options.timeout;
  const std::stop_token no_stop;
  MPI_Request request = MPI_REQUEST_NULL;
  REFIT_RETURN_NOT_OK(MpiCall(MPI_Comm_idup(base_, &control_, &request), "MPI_Comm_idup"));
  REFIT_RETURN_NOT_OK(Wait(request, deadline, no_stop, /*collective=*/true, nullptr,
                           "mpi: joining the job (the other ranks must call JoinMpiJob too)"));
  MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN);
  auto table = std::make_shared<std::vector<int64_t>>(static_cast<size_t>(kHandshakeFields) *
                                                      (info_.world_size + 1));
  int64_t* mine = table->data() + static_cast<size_t>(kHandshakeFields) * info_.world_size;
  mine[0] = kHandshakeMagic;
  mine[1] = options.protocol_version;
  mine[2] = options.producers;
  mine[3] = options.shard_group;
  REFIT_RETURN_NOT_OK(MpiCall(MPI_Iallgather(mine, kHandshakeFields, MPI_INT64_T, table->data(),
                                             kHandshakeFields, MPI_INT64_T, control_, &request),
                              "MPI_Iallgather"));
  REFIT_RETURN_NOT_OK(Wait(request, deadline, no_stop, /*collective=*/true, table,
                           "mpi: the handshake (every rank must join the job)"));
  for (uint32_t r = 0; r < info_.world_size; ++r) {
    const int64_t* theirs = table->data() + static_cast<size_t>(kHandshakeFields) * r;
    if (theirs[0] != kHandshakeMagic || theirs[1] != options.protocol_version) {
      return FailedPrecondition(
          "mpi: rank {} speaks refit-mpi protocol {}, rank {} (this one) protocol {}: every rank "
          "must run the same refit build",
          r, theirs[0] == kHandshakeMagic ? fmt::format("{}", theirs[1]) : std::string("unknown"),
          info_.rank, options.protocol_version);
    }
    if (theirs[2] != options.producers || theirs[3] != options.shard_group) {
      return FailedPrecondition(
          "mpi: rank {} joined with {} producer(s) and shard group {}, rank {} (this one) with {} "
          "and {}: every rank must be given the same layout (the same mpi:// URI)",
          r, theirs[2], theirs[3], info_.rank, options.producers, options.shard_group);
    }
  }
  // Every rank is here and agrees: the blocking splits below cannot hang on a missing one.
  REFIT_RETURN_NOT_OK(
      MpiCall(MPI_Comm_split(control_, info_.producer ? 0 : MPI_UNDEFINED, rank, &producer_comm_),
              "MPI_Comm_split (producers)"));
  if (info_.producer) info_.producer_communicator = HandleOf(producer_comm_);
  data_.assign(options.producers, MPI_COMM_NULL);
  for (uint32_t p = 0; p < options.producers; ++p) {
    const bool member = info_.rank == p || !info_.producer;
    // Producer p is rank 0 of its communicator; the receivers follow in job order.
    REFIT_RETURN_NOT_OK(MpiCall(MPI_Comm_split(control_, member ? 0 : MPI_UNDEFINED,
                                               info_.rank == p ? 0 : rank + 1, &data_[p]),
                                "MPI_Comm_split (data)"));
    if (data_[p] != MPI_COMM_NULL) MPI_Comm_set_errhandler(data_[p], MPI_ERRORS_RETURN);
  }
  {
    // Nothing else sees the job yet; the lock is for the analysis, and costs nothing.
    MutexLock lock(data_plane_mutex_);
    data_plane_ = std::make_unique<MpiBroadcast>(*this);
  }
  REFIT_LOG_DEBUG("mpi: rank {} of {} joined as {} {}", info_.rank, info_.world_size,
                  info_.producer ? "producer" : "receiver", info_.index);
  return Status::OK();
}

Status MpiJob::Wait(MPI_Request& request, Clock::time_point deadline, const std::stop_token& stop,
                    bool collective, std::shared_ptr<void> buffers, const std::string& what) {
  std::chrono::microseconds pause = kFirstPause;
  while (true) {
    int done = 0;
    const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      if (collective) broken_ = true;
      return Unavailable("{}: {}", what, MpiErrorText(code));
    }
    if (done != 0) return Status::OK();
    const bool stopped = stop.stop_requested();
    if (stopped || Clock::now() >= deadline) {
      if (buffers != nullptr) KeepForever(std::move(buffers));
      if (collective) broken_ = true;
      if (stopped) return Cancelled("{}: stopped while waiting", what);
      return DeadlineExceeded(
          "{}: no answer within {} ms{}", what,
          std::chrono::duration_cast<std::chrono::milliseconds>(options_.timeout).count(),
          collective ? " (a collective cannot be cancelled: this job is now unusable)" : "");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kMaxPause);
  }
}

Status MpiJob::Broadcast(std::byte* bytes, uint64_t size, int root, MPI_Comm comm,
                         Clock::time_point deadline, const std::stop_token& stop,
                         std::shared_ptr<void> owner, const std::string& what) {
  for (uint64_t offset = 0; offset < size; offset += kMpiSliceBytes) {
    const int count = static_cast<int>(std::min(kMpiSliceBytes, size - offset));
    MPI_Request request = MPI_REQUEST_NULL;
    REFIT_RETURN_NOT_OK(
        MpiCall(MPI_Ibcast(bytes + offset, count, MPI_BYTE, root, comm, &request), what));
    REFIT_RETURN_NOT_OK(Wait(request, deadline, stop, /*collective=*/true, owner, what));
  }
  return Status::OK();
}

Status MpiJob::UseDataPlane(std::unique_ptr<DataCollective> plane) {
  MutexLock lock(data_plane_mutex_);
  if (!data_plane_claimed_.empty() && data_plane_claimed_ != plane->name()) {
    return FailedPrecondition("mpi: this job's payloads already travel by {}, not {}",
                              data_plane_claimed_, plane->name());
  }
  data_plane_claimed_ = std::string(plane->name());
  data_plane_ = std::move(plane);
  return Status::OK();
}

Status MpiJob::ClaimDataPlane(std::string_view name) {
  MutexLock lock(data_plane_mutex_);
  if (data_plane_claimed_.empty()) data_plane_claimed_ = std::string(name);
  if (data_plane_claimed_ != name || data_plane_->name() != name) {
    return FailedPrecondition(
        "mpi: this job's payloads travel by {}: a {}:// transport cannot join it (every rank "
        "must use the same scheme)",
        data_plane_claimed_, name);
  }
  return Status::OK();
}

Status MpiJob::CheckUsable() const {
  if (!broken_.load()) return Status::OK();
  return FailedPrecondition(
      "mpi: this job is unusable: a collective timed out and MPI cannot cancel it (restart the "
      "job; docs/transports.md, mpi:// failure semantics)");
}

MpiJobStats MpiJob::stats() const {
  return MpiJobStats{broadcasts_sent_.load(), broadcasts_received_.load(), bytes_sent_.load(),
                     bytes_received_.load(), control_messages_.load()};
}

void MpiJob::MarkDataClosed(uint32_t /*producer*/) {
  MutexLock lock(end_mutex_);
  ++data_closed_;
  end_changed_.notify_all();
}

void MpiJob::MarkControlClosed() {
  MutexLock lock(end_mutex_);
  control_closed_ = true;
  end_changed_.notify_all();
}

Status MpiJob::WaitForEnd(std::stop_token stop) {
  if (info_.producer) return FailedPrecondition("mpi: a producer does not wait for the job's end");
  MutexLock lock(end_mutex_);
  const bool ended = end_changed_.wait(lock, stop, [this]() REFIT_REQUIRES(end_mutex_) {
    return control_closed_ && data_closed_ >= info_.producers;
  });
  if (!ended) return Cancelled("mpi: stopped before the producers closed the job");
  return Status::OK();
}

void MpiJob::Finalize() {
  {
    MutexLock lock(end_mutex_);
    if (finalized_) return;
    finalized_ = true;
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) return;
  if (broken_.load()) {
    REFIT_LOG_WARN("mpi: not finalizing: a collective of this job never completed");
    return;
  }
  for (MPI_Comm& comm : data_) {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  // The producer communicator belongs to the producer group made over it (MakeMpiGroup works on
  // its own duplicate), so it can go too.
  if (producer_comm_ != MPI_COMM_NULL) MPI_Comm_free(&producer_comm_);
  if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
  if (initialized_mpi_) MPI_Finalize();
}

}  // namespace refit::internal

namespace refit {

Result<MpiJobInfo> JoinMpiJob(const MpiJobOptions& options) {
  REFIT_ASSIGN_OR_RETURN(internal::MpiJob * job, internal::MpiJob::Join(options));
  return job->info();
}

Result<MpiJobInfo> CurrentMpiJob() {
  internal::MpiJob* job = internal::MpiJob::Current();
  if (job == nullptr) return FailedPrecondition("mpi: this process joined no MPI job");
  return job->info();
}

MpiJobStats GetMpiJobStats() {
  internal::MpiJob* job = internal::MpiJob::Current();
  return job == nullptr ? MpiJobStats{} : job->stats();
}

Status WaitForMpiJobEnd(std::stop_token stop) {
  internal::MpiJob* job = internal::MpiJob::Current();
  if (job == nullptr) return FailedPrecondition("mpi: this process joined no MPI job");
  return job->WaitForEnd(std::move(stop));
}

void FinalizeMpi() {
  internal::MpiJob* job = internal::MpiJob::Current();
  if (job != nullptr) job->Finalize();
}

}  // namespace refit
