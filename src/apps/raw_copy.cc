#include "raw_copy.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include "loopback_ports.h"
#include "process.h"
#include "refit/status_format.h"
#include "util/mutex.h"

namespace refit::cli {
namespace {

constexpr int kAckTimeoutMs = 60'000;
// A receiver allocates its buffer and binds one socket: seconds at most.
constexpr auto kStartTimeout = std::chrono::seconds(60);
// After the last ACK a receiver only hashes its buffer and writes a line.
constexpr auto kExitTimeout = std::chrono::seconds(120);

/// One message of the stream: `size` bytes of the tensors' concatenation from `offset`, read at
/// `data`.
struct Slice {
  uint64_t offset = 0;
  const std::byte* data = nullptr;
  uint64_t size = 0;
};

std::vector<Slice> SliceTensors(const std::vector<TensorView>& tensors, uint64_t message_bytes) {
  std::vector<Slice> slices;
  uint64_t offset = 0;
  for (const TensorView& tensor : tensors) {
    for (uint64_t done = 0; done < tensor.bytes.size();) {
      const uint64_t n = std::min<uint64_t>(message_bytes, tensor.bytes.size() - done);
      slices.push_back(Slice{offset + done, tensor.bytes.data() + done, n});
      done += n;
    }
    offset += tensor.bytes.size();
  }
  return slices;
}

uint64_t Checksum(const std::vector<TensorView>& tensors) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const TensorView& tensor : tensors) {
    XXH3_64bits_update(state, tensor.bytes.data(), tensor.bytes.size());
  }
  const uint64_t checksum = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return checksum;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Send every slice to `endpoint` from `threads` DEALERs; the first error wins.
Status SendSlices(zmq::context_t& context, const std::string& endpoint,
                  const std::vector<Slice>& slices, int threads) {
  std::vector<zmq::socket_t> sockets;
  try {
    for (int t = 0; t < threads; ++t) {
      zmq::socket_t dealer(context, zmq::socket_type::dealer);
      dealer.set(zmq::sockopt::linger, 0);
      dealer.set(zmq::sockopt::rcvtimeo, kAckTimeoutMs);
      dealer.connect(endpoint);
      sockets.push_back(std::move(dealer));
    }
  } catch (const zmq::error_t& error) {
    return Unavailable("raw copy to {}: {}", endpoint, error.what());
  }
  std::atomic<size_t> next{0};
  internal::Mutex error_mutex;
  Status first_error;
  std::vector<std::jthread> senders;
  for (int t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      zmq::socket_t& socket = sockets[static_cast<size_t>(t)];
      try {
        for (size_t i = next.fetch_add(1); i < slices.size(); i = next.fetch_add(1)) {
          const Slice& slice = slices[i];
          socket.send(zmq::buffer(&slice.offset, sizeof(slice.offset)), zmq::send_flags::sndmore);
          // Copied into ZeroMQ's message, as the zmq:// transport's senders copy a payload.
          socket.send(zmq::buffer(slice.data, slice.size), zmq::send_flags::none);
          zmq::message_t ack;
          if (!socket.recv(ack)) {
            internal::MutexLock lock(error_mutex);
            if (first_error.ok()) {
              first_error =
                  Unavailable("raw copy to {}: no ACK within {} ms", endpoint, kAckTimeoutMs);
            }
            return;
          }
        }
      } catch (const zmq::error_t& error) {
        internal::MutexLock lock(error_mutex);
        if (first_error.ok()) {
          first_error = Unavailable("raw copy to {}: {}", endpoint, error.what());
        }
      }
    });
  }
  senders.clear();
  return first_error;
}

// The receiving processes; killed when destroyed unless each has been waited for.
class Sinks {
 public:
  ~Sinks() {
    for (pid_t pid : pids_) {
      if (pid <= 0) continue;
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }

  Status Start(const std::vector<std::string>& argv, const std::string& log_path) {
    REFIT_ASSIGN_OR_RETURN(const pid_t pid, testkit::SpawnProcess(argv, log_path, log_path));
    pids_.push_back(pid);
    logs_.push_back(log_path);
    return Status::OK();
  }

  // Wait until `path` exists, or fail naming receiver `r` when it exits or the time is up.
  Status WaitForFile(size_t r, const std::string& path, std::chrono::seconds timeout) {
    Result<std::string> ready = testkit::WaitForReadyFile(path, pids_[r], timeout, logs_[r]);
    if (ready.ok()) return Status::OK();
    // WaitForReadyFile reaped a receiver that exited.
    if (::kill(pids_[r], 0) != 0) pids_[r] = -1;
    return ready.status().WithContext(fmt::format("raw-copy receiver {}", r));
  }

  // Wait for receiver `r` to exit; it must exit with status 0.
  Status WaitForExit(size_t r, std::chrono::seconds timeout) {
    Result<testkit::ChildExit> exit = testkit::WaitProcess(pids_[r], timeout);
    pids_[r] = -1;
    if (!exit.ok()) {
      return exit.status().WithContext(
          fmt::format("raw-copy receiver {}, {} s after the last ACK", r, timeout.count()));
    }
    if (!exit->ok()) {
      return Internal("raw-copy receiver {} ended with {}; its log ends with:\n{}", r,
                      exit->Describe(), testkit::FileTail(logs_[r]));
    }
    return Status::OK();
  }

 private:
  std::vector<pid_t> pids_;
  std::vector<std::string> logs_;
};

}  // namespace

Result<RawCopySinkResult> RunZmqRawCopySink(const std::string& endpoint, uint64_t total_bytes,
                                            const std::string& ready_file) {
  // Touched page by page as the bytes land, as a receiver's weight buffer would be.
  std::unique_ptr<std::byte[]> buffer(new std::byte[std::max<uint64_t>(total_bytes, 1)]);
  RawCopySinkResult result;
  try {
    zmq::context_t context(1);
    zmq::socket_t router(context, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, 0);
    router.bind(endpoint);
    REFIT_RETURN_NOT_OK(testkit::WriteTextFileAtomically(ready_file, "ready\n"));
    while (result.bytes < total_bytes) {
      zmq::message_t identity, offset_frame, data;
      if (!router.recv(identity) || !identity.more() || !router.recv(offset_frame) ||
          !offset_frame.more() || !router.recv(data) || data.more() ||
          offset_frame.size() != sizeof(uint64_t)) {
        return InvalidArgument("raw copy sink: a message that is not [offset, data]");
      }
      uint64_t offset = 0;
      std::memcpy(&offset, offset_frame.data(), sizeof(offset));
      if (offset > total_bytes || data.size() > total_bytes - offset) {
        return InvalidArgument("raw copy sink: {} bytes at {} lie outside the {}-byte buffer",
                               data.size(), offset, total_bytes);
      }
      std::memcpy(buffer.get() + offset, data.data(), data.size());
      result.bytes += data.size();
      ++result.messages;
      router.send(identity, zmq::send_flags::sndmore);
      router.send(zmq::message_t(), zmq::send_flags::none);
    }
  } catch (const zmq::error_t& error) {
    return Unavailable("raw copy sink on {}: {}", endpoint, error.what());
  }
  result.checksum = XXH3_64bits(buffer.get(), total_bytes);
  return result;
}

Result<RawCopyMeasurement> MeasureZmqRawCopy(const std::vector<TensorView>& tensors,
                                             const RawCopyOptions& options) {
  if (options.receivers == 0) return InvalidArgument("raw copy: no receivers");
  if (options.threads < 1) {
    return InvalidArgument("raw copy: threads must be at least 1, not {}", options.threads);
  }
  std::string binary = options.refit_binary;
  if (binary.empty()) {
    REFIT_ASSIGN_OR_RETURN(binary, testkit::SelfExecutable());
  }
  const std::vector<Slice> slices =
      SliceTensors(tensors, std::max<uint64_t>(options.message_bytes, 1));
  uint64_t bytes = 0;
  for (const Slice& slice : slices) bytes += slice.size;
  const uint64_t checksum = Checksum(tensors);

  REFIT_ASSIGN_OR_RETURN(std::vector<uint16_t> ports,
                         testkit::FreeLoopbackPorts(options.receivers));
  Sinks sinks;
  std::vector<std::string> endpoints, ready_files, result_files;
  for (size_t r = 0; r < options.receivers; ++r) {
    endpoints.push_back(fmt::format("tcp://127.0.0.1:{}", ports[r]));
    ready_files.push_back(fmt::format("{}/raw-copy-{}.ready", options.work_dir, r));
    result_files.push_back(fmt::format("{}/raw-copy-{}.result", options.work_dir, r));
    ::unlink(ready_files.back().c_str());
    ::unlink(result_files.back().c_str());
    REFIT_RETURN_NOT_OK(sinks.Start(
        {binary, "raw-copy-sink", "--endpoint", endpoints.back(), "--bytes", std::to_string(bytes),
         "--ready-file", ready_files.back(), "--result-file", result_files.back()},
        fmt::format("{}/raw-copy-{}.log", options.work_dir, r)));
  }
  for (size_t r = 0; r < options.receivers; ++r) {
    REFIT_RETURN_NOT_OK(sinks.WaitForFile(r, ready_files[r], kStartTimeout));
  }

  zmq::context_t context(1);
  std::vector<Status> sent(options.receivers);
  const double start = Now();
  {
    std::vector<std::jthread> broadcasts;
    for (size_t r = 0; r < options.receivers; ++r) {
      broadcasts.emplace_back(
          [&, r] { sent[r] = SendSlices(context, endpoints[r], slices, options.threads); });
    }
  }
  const double seconds = Now() - start;
  for (const Status& status : sent) REFIT_RETURN_NOT_OK(status);

  for (size_t r = 0; r < options.receivers; ++r) {
    REFIT_RETURN_NOT_OK(sinks.WaitForExit(r, kExitTimeout));
    std::ifstream result_file(result_files[r]);
    const nlohmann::json received = nlohmann::json::parse(result_file, nullptr, false);
    if (received.is_discarded() || received.value("bytes", uint64_t{0}) != bytes ||
        received.value("checksum", std::string()) != fmt::format("{:016x}", checksum)) {
      return DataLoss("raw-copy receiver {} got {} but {} bytes with checksum {:016x} were sent", r,
                      received.is_discarded() ? "an unreadable result" : received.dump(), bytes,
                      checksum);
    }
  }
  return RawCopyMeasurement{.seconds = seconds,
                            .bytes = bytes,
                            .messages = slices.size(),
                            .receivers = options.receivers,
                            .message_bytes = options.message_bytes,
                            .threads = options.threads};
}

Status RunRawCopySinkCommand(const std::string& endpoint, uint64_t bytes,
                             const std::string& ready_file, const std::string& result_file) {
  REFIT_ASSIGN_OR_RETURN(RawCopySinkResult result, RunZmqRawCopySink(endpoint, bytes, ready_file));
  const nlohmann::json out = {{"bytes", result.bytes},
                              {"messages", result.messages},
                              {"checksum", fmt::format("{:016x}", result.checksum)}};
  return testkit::WriteTextFileAtomically(result_file, out.dump() + "\n");
}

}  // namespace refit::cli
