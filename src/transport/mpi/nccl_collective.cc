// nccl://[?producers=P&shard_group=G&timeout_ms=T]: the protocol of mpi:// (mpi_transport.cc),
// with every broadcast of the data plane made by ncclBroadcast on device buffers; the job's
// set-up, its control channel and the producer group stay on MPI. Built when CMake finds CUDA and
// NCCL (REFIT_HAVE_NCCL=1).
//
// Each producer's data communicator gets an NCCL communicator over the same ranks (the unique id
// travels by MPI_Bcast on it), a CUDA stream and a device staging buffer of kStagingBytes. A
// broadcast moves the bytes through it in slices: the root copies a slice host-to-device, every
// rank joins ncclBroadcast, the receivers copy it back device-to-host, and the stream is polled
// (cudaStreamQuery) until it completes, the deadline passes or a stop is requested. A broadcast
// that does not complete aborts its NCCL communicator (ncclCommAbort) and breaks the job, as an
// uncancellable MPI collective does. Payloads live in host memory on both ends (the codec and the
// receiver's store are host-side), so the device buffers are only the wire.
//
// The device: rank i of the node's ranks (MPI_COMM_TYPE_SHARED) uses device i % devices. Every
// rank must have one: the ranks agree on that first (MPI_Allreduce), so a rank without a device
// fails the set-up on every rank instead of leaving the others in ncclCommInitRank.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/mpi/mpi_job.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_annotations.h"

namespace refit::internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kStagingBytes = uint64_t{64} << 20;
constexpr std::chrono::microseconds kFirstPause{20};
constexpr std::chrono::microseconds kMaxPause{1000};

Status CudaCall(cudaError_t code, std::string_view what) {
  if (code == cudaSuccess) return Status::OK();
  return Unavailable("nccl://: {} failed: {}", what, cudaGetErrorString(code));
}

Status NcclCall(ncclResult_t code, std::string_view what) {
  if (code == ncclSuccess) return Status::OK();
  return Unavailable("nccl://: {} failed: {}", what, ncclGetErrorString(code));
}

class NcclBroadcast final : public DataCollective {
 public:
  static Result<std::unique_ptr<NcclBroadcast>> Make(MpiJob& job) {
    const MpiJobInfo& info = job.info();
    int devices = 0;
    const cudaError_t counted = cudaGetDeviceCount(&devices);
    if (counted != cudaSuccess) devices = 0;
    // Every rank must have a device, or none may go on (the others would wait in NCCL's set-up).
    int mine = devices > 0 ? 1 : 0;
    int all = 0;
    REFIT_RETURN_NOT_OK(
        MpiCode(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, job.control()), "MPI_Allreduce"));
    if (all == 0) {
      return FailedPrecondition(
          "nccl://: {} (rank {}): nccl:// moves payloads through GPU memory and every rank needs "
          "a CUDA device; use mpi:// on hosts without one",
          mine == 0
              ? fmt::format("this rank has no CUDA device ({})",
                            counted == cudaSuccess ? "none found" : cudaGetErrorString(counted))
              : std::string("another rank has no CUDA device"),
          info.rank);
    }
    MPI_Comm node = MPI_COMM_NULL;
    REFIT_RETURN_NOT_OK(
        MpiCode(MPI_Comm_split_type(job.control(), MPI_COMM_TYPE_SHARED,
                                    static_cast<int>(info.rank), MPI_INFO_NULL, &node),
                "MPI_Comm_split_type"));
    int local = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    const int device = local % devices;
    REFIT_RETURN_NOT_OK(CudaCall(cudaSetDevice(device), "cudaSetDevice"));

    std::unique_ptr<NcclBroadcast> made(new NcclBroadcast(job, device));
    made->channels_.resize(info.producers);
    for (uint32_t p = 0; p < info.producers; ++p) {
      const MPI_Comm comm = job.data(p);
      if (comm == MPI_COMM_NULL) continue;
      auto channel = std::make_unique<Channel>();
      int rank = 0;
      int size = 0;
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
      channel->root = rank == 0;
      ncclUniqueId id{};
      if (rank == 0) REFIT_RETURN_NOT_OK(NcclCall(ncclGetUniqueId(&id), "ncclGetUniqueId"));
      REFIT_RETURN_NOT_OK(
          MpiCode(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm), "MPI_Bcast (NCCL unique id)"));
      REFIT_RETURN_NOT_OK(
          NcclCall(ncclCommInitRank(&channel->comm, size, id, rank), "ncclCommInitRank"));
      REFIT_RETURN_NOT_OK(CudaCall(
          cudaStreamCreateWithFlags(&channel->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
      void* device_bytes = nullptr;
      REFIT_RETURN_NOT_OK(CudaCall(cudaMalloc(&device_bytes, kStagingBytes), "cudaMalloc"));
      channel->device = static_cast<std::byte*>(device_bytes);
      made->channels_[p] = std::move(channel);
    }
    REFIT_LOG_INFO("nccl://: rank {} on CUDA device {} of {}", info.rank, device, devices);
    return made;
  }

  ~NcclBroadcast() override {
    for (std::unique_ptr<Channel>& channel : channels_) {
      if (channel == nullptr) continue;
      // A communicator that a timed-out broadcast aborted has nothing left to wait for.
      if (channel->comm != nullptr && !channel->aborted) ncclCommDestroy(channel->comm);
      if (channel->device != nullptr && !channel->aborted) cudaFree(channel->device);
      if (channel->stream != nullptr && !channel->aborted) cudaStreamDestroy(channel->stream);
    }
  }

  std::string_view name() const override { return "nccl"; }

  Status Broadcast(uint32_t producer, std::byte* bytes, uint64_t size, Clock::time_point deadline,
                   const std::stop_token& stop, std::shared_ptr<void> owner,
                   const std::string& what) override {
    if (producer >= channels_.size() || channels_[producer] == nullptr) {
      return InvalidArgument("{}: this rank is not on producer {}'s communicator", what, producer);
    }
    Channel& channel = *channels_[producer];
    MutexLock lock(channel.mutex);
    if (channel.aborted) return FailedPrecondition("{}: its NCCL communicator was aborted", what);
    REFIT_RETURN_NOT_OK(CudaCall(cudaSetDevice(device_), "cudaSetDevice"));
    for (uint64_t offset = 0; offset < size; offset += kStagingBytes) {
      const uint64_t part = std::min(kStagingBytes, size - offset);
      if (channel.root) {
        REFIT_RETURN_NOT_OK(CudaCall(cudaMemcpyAsync(channel.device, bytes + offset, part,
                                                     cudaMemcpyHostToDevice, channel.stream),
                                     "cudaMemcpyAsync (host to device)"));
      }
      REFIT_RETURN_NOT_OK(NcclCall(ncclBroadcast(channel.device, channel.device, part, ncclUint8, 0,
                                                 channel.comm, channel.stream),
                                   "ncclBroadcast"));
      if (!channel.root) {
        REFIT_RETURN_NOT_OK(CudaCall(cudaMemcpyAsync(bytes + offset, channel.device, part,
                                                     cudaMemcpyDeviceToHost, channel.stream),
                                     "cudaMemcpyAsync (device to host)"));
      }
      REFIT_RETURN_NOT_OK(WaitForStream(channel, deadline, stop, owner, what));
    }
    return Status::OK();
  }

 private:
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    std::byte* device = nullptr;
    bool root = false;
    Mutex mutex;
    bool aborted REFIT_GUARDED_BY(mutex) = false;
  };

  NcclBroadcast(MpiJob& job, int device) : job_(job), device_(device) {}

  static Status MpiCode(int code, std::string_view what) {
    if (code == MPI_SUCCESS) return Status::OK();
    return Unavailable("nccl://: {} failed: {}", what, MpiErrorText(code));
  }

  Status WaitForStream(Channel& channel, Clock::time_point deadline, const std::stop_token& stop,
                       const std::shared_ptr<void>& owner, const std::string& what)
      REFIT_REQUIRES(channel.mutex) {
    std::chrono::microseconds pause = kFirstPause;
    while (true) {
      const cudaError_t state = cudaStreamQuery(channel.stream);
      if (state == cudaSuccess) return Status::OK();
      if (state != cudaErrorNotReady) return CudaCall(state, what);
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(channel.comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) return NcclCall(async, what);
      if (stop.stop_requested() || Clock::now() >= deadline) {
        // The device may still read or write the host bytes: keep them, and end the
        // communicator, which no later broadcast can use.
        KeepForever(owner);
        ncclCommAbort(channel.comm);
        channel.aborted = true;
        job_.MarkBroken();
        if (stop.stop_requested()) return Cancelled("{}: stopped while waiting", what);
        return DeadlineExceeded(
            "{}: the NCCL broadcast did not complete in time (its "
            "communicator was aborted: this job is now unusable)",
            what);
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, kMaxPause);
    }
  }

  MpiJob& job_;
  const int device_;
  std::vector<std::unique_ptr<Channel>> channels_;
};

}  // namespace

Result<std::unique_ptr<Transport>> MakeNcclTransport(const TransportUri& uri,
                                                     const TransportOptions& options) {
  REFIT_ASSIGN_OR_RETURN(MpiJob * job, JoinMpiJobOfUri(uri));
  // The first nccl:// transport of the process installs the NCCL data plane (collective: every
  // rank of the job makes its transport at the same point, as for the job itself).
  if (job->data_plane().name() != "nccl") {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<NcclBroadcast> plane, NcclBroadcast::Make(*job));
    REFIT_RETURN_NOT_OK(job->UseDataPlane(std::move(plane)));
  }
  return MakeCollectiveTransport(uri, options, *job);
}

}  // namespace refit::internal
