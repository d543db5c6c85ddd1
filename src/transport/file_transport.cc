// file://<dir>: a shared-filesystem drop, for clusters that share storage but no network path.
//
// Layout under the drop directory <dir> (every name derives from ids, never from tensor names):
//
//   <dir>/<inbox>/<transfer id, 32 hex>/<producer, %06u>/<payload, %06u>.rfpl   one payload
//   <dir>/<inbox>/<transfer id>/<producer>/<payload>.rfpl.<nonce>.tmp            a write in flight
//   <dir>/<inbox>/<transfer id>/<producer>/done                                  "<count>\n"
//
// An inbox is one receiver's sub-directory (the ListenerContext::endpoint); the endpoint "" is
// <dir> itself, for a single receiver. A sender writes every payload to each inbox it is given.
//
// Sender: each payload is written to a `.tmp` name, fsynced, renamed to its final name and the
// directory fsynced, so a reader sees a complete payload or none, and Send returns only once the
// payload would survive a crash. Finish writes `done` (the payload count) the same way, after
// every Send has returned — so once `done` exists, every payload file of that producer exists.
//
// Listener: one round (Poll, or the polling thread every poll_ms) walks the inbox in id order,
// reads each `.rfpl` file (bounded by the payload size limit), checks its header cheaply and that
// the header's ids match the path, and delivers it. A payload the sink staged (or recognised as a
// duplicate) is removed; one it refused is kept and reported. Refusals that may pass later (no
// open transfer yet, a stop) are retried with a backoff in rounds; others (corrupt, conflicting)
// are reported once and not read again until the file changes. When `done` exists and no payload
// file of that producer is left, the stream end is delivered, and `done`, the debris of failed
// writes (`.tmp`) and the emptied directories are removed. Names that are not the writer's
// canonical ones are ignored. One listener per inbox.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit::internal {
namespace {

constexpr TransportCapabilities kFileCapabilities{.shared_filesystem = true,
                                                  .reports_stream_end = true};

constexpr std::string_view kPayloadSuffix = ".rfpl";
constexpr std::string_view kTmpSuffix = ".tmp";
constexpr std::string_view kDoneName = "done";
// Ids are zero-padded to six digits, as upstream's object keys: listings sort in id order for
// the first million payloads, and longer ids still round-trip.
constexpr int kIdDigits = 6;
// The longest decimal uint32 (10 digits) plus a newline; anything longer is not a done marker.
constexpr size_t kMaxDoneMarkerBytes = 11;

// Default interval of the polling thread: a payload waits at most this long in the drop, and a
// round over an idle inbox costs one directory listing, negligible at ten per second.
constexpr uint64_t kDefaultPollMs = 100;
// An hour: a longer interval is a mistyped value (seconds for milliseconds), not a setting.
constexpr uint64_t kMaxPollMs = 3'600'000;
// A listener removes a transfer directory once the last stream in it ended. A late producer of
// that transfer creating its directory between the listener's check and its rmdir sees ENOENT
// and creates both again. The window is two syscalls wide and reopens only when another stream
// of the transfer ends meanwhile, so a second attempt practically always succeeds.
constexpr int kDirectoryAttempts = 8;
// A kept payload refused for a reason that may pass is retried after 1, 2, 4, … rounds, at most
// this many: leftovers of an aborted transfer are re-read rarely (every 6.4 s at the default
// interval) while one that only waited for Prepare goes through at the next round.
constexpr uint64_t kMaxRetryBackoffRounds = 64;

constexpr mode_t kDirectoryMode = 0755;
constexpr mode_t kFileMode = 0644;

constexpr const char* kPollThreadName = "refit-file-poll";

std::string IdName(uint32_t id) { return fmt::format("{:0{}}", id, kIdDigits); }

std::string PayloadName(uint32_t payload_id) {
  return IdName(payload_id) + std::string(kPayloadSuffix);
}

// Parse the writer's canonical id name (IdName); anything else is not ours.
std::optional<uint32_t> ParseIdName(std::string_view name) {
  uint64_t value = 0;
  const char* end = name.data() + name.size();
  const auto [ptr, error] = std::from_chars(name.data(), end, value);
  if (name.empty() || error != std::errc() || ptr != end ||
      value > std::numeric_limits<uint32_t>::max()) {
    return std::nullopt;
  }
  const auto id = static_cast<uint32_t>(value);
  if (IdName(id) != name) return std::nullopt;
  return id;
}

// Parse "<IdName>.rfpl".
std::optional<uint32_t> ParsePayloadName(std::string_view name) {
  if (name.size() < kPayloadSuffix.size() ||
      name.substr(name.size() - kPayloadSuffix.size()) != kPayloadSuffix) {
    return std::nullopt;
  }
  return ParseIdName(name.substr(0, name.size() - kPayloadSuffix.size()));
}

std::optional<TransferId> ParseTransferName(std::string_view name) {
  Result<TransferId> id = TransferId::FromHex(name);
  if (!id.ok() || id->ToHex() != name) return std::nullopt;
  return *id;
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Errors a refusal may recover from without the file changing: the receiver was not ready
// (no open transfer), the medium or a peer was briefly gone, the delivery was stopped.
bool IsRetryable(StatusCode code) {
  return code == StatusCode::kFailedPrecondition || code == StatusCode::kUnavailable ||
         code == StatusCode::kCancelled || code == StatusCode::kDeadlineExceeded ||
         code == StatusCode::kIoError;
}

// ---- POSIX helpers ---------------------------------------------------------------------------

class UniqueFd {
 public:
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  // Close now, reporting the error (a deferred write error can surface here).
  Status Close(std::string_view what) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return IoErrorFromErrno(errno, fmt::format("close {}", what));
    return Status::OK();
  }

 private:
  int fd_;
};

// Whether `path` is an existing directory.
bool IsDirectory(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

// fsync the directory `path`, so that an entry created or renamed in it survives a crash.
Status SyncDirectory(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return IoErrorFromErrno(errno, fmt::format("open directory '{}'", path));
  if (::fsync(fd.get()) != 0) {
    return IoErrorFromErrno(errno, fmt::format("fsync directory '{}'", path));
  }
  return fd.Close(fmt::format("directory '{}'", path));
}

// The names in directory `path`, without "." and "..". Errors: NotFound when the directory is
// gone (ENOENT, ENOTDIR); IoError otherwise.
Result<std::vector<std::string>> ListDirectory(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) {
    const int error = errno;
    if (error == ENOENT || error == ENOTDIR) return NotFound("directory '{}' is gone", path);
    return IoErrorFromErrno(error, fmt::format("open directory '{}'", path));
  }
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name = entry->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
    errno = 0;
  }
  const int error = errno;
  ::closedir(dir);
  if (error != 0) return IoErrorFromErrno(error, fmt::format("read directory '{}'", path));
  return names;
}

// Write `bytes` to `fd` completely.
Status WriteAll(int fd, std::span<const std::byte> bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return IoErrorFromErrno(errno, fmt::format("write '{}'", path));
    }
    bytes = bytes.subspan(static_cast<size_t>(written));
  }
  return Status::OK();
}

// Read exactly `bytes.size()` bytes from `fd`. Errors: IoError, also for a file that shrank.
Status ReadAll(int fd, std::span<std::byte> bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t got = ::read(fd, bytes.data(), bytes.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoErrorFromErrno(errno, fmt::format("read '{}'", path));
    }
    if (got == 0) return IoError("'{}' shrank while being read", path);
    bytes = bytes.subspan(static_cast<size_t>(got));
  }
  return Status::OK();
}

// Write `bytes` to `dir/name` atomically and durably: a `.tmp` name, fsync, rename, fsync of
// the directory. `nonce` makes the temporary name unique among concurrent writers.
// Errors: Unavailable when `dir` is gone; IoError.
Status WriteFileAtomically(const std::string& dir, std::string_view name,
                           std::span<const std::byte> bytes, uint64_t nonce) {
  const std::string path = fmt::format("{}/{}", dir, name);
  const std::string tmp_path = fmt::format("{}.{:016x}{}", path, nonce, kTmpSuffix);
  UniqueFd fd(::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, kFileMode));
  if (fd.get() < 0) {
    if (errno == ENOENT) return Unavailable("directory '{}' is gone", dir);
    return IoErrorFromErrno(errno, fmt::format("create '{}'", tmp_path));
  }
  Status status = WriteAll(fd.get(), bytes, tmp_path);
  if (status.ok() && ::fsync(fd.get()) != 0) {
    status = IoErrorFromErrno(errno, fmt::format("fsync '{}'", tmp_path));
  }
  if (status.ok()) {
    status = fd.Close(fmt::format("'{}'", tmp_path));
  }
  if (status.ok() && ::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = IoErrorFromErrno(errno, fmt::format("rename '{}' to '{}'", tmp_path, path));
  }
  if (!status.ok()) {
    // Best effort: a leftover is ignored by listeners and removed with its stream.
    ::unlink(tmp_path.c_str());
    return status;
  }
  return SyncDirectory(dir);
}

// Create directory `path` if missing; `created` tells whether it was (its parent then needs an
// fsync for the entry to be durable). Errors: NotFound when the parent is gone; IoError.
Status MakeDirectory(const std::string& path, bool& created) {
  created = ::mkdir(path.c_str(), kDirectoryMode) == 0;
  if (created) return Status::OK();
  const int error = errno;
  if (error == EEXIST && IsDirectory(path)) return Status::OK();
  if (error == ENOENT) return NotFound("the parent of '{}' is gone", path);
  return IoErrorFromErrno(error, fmt::format("create directory '{}'", path));
}

// Check an inbox name: "" (the drop directory itself) or one plain path component.
Status CheckInboxName(const std::string& root, const std::string& inbox) {
  if (inbox.empty()) return Status::OK();
  const bool plain = std::all_of(inbox.begin(), inbox.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (!plain || inbox == "." || inbox == "..") {
    return InvalidArgument(
        "file://{}: inbox '{}' is not a plain directory name (letters, digits, '.', '_', '-')",
        root, Printable(inbox));
  }
  return Status::OK();
}

std::string InboxPath(const std::string& root, const std::string& inbox) {
  return inbox.empty() ? root : fmt::format("{}/{}", root, inbox);
}

// ---- Sender ----------------------------------------------------------------------------------

class FileSender final : public TransportSender {
 public:
  FileSender(std::string root, SenderContext context, PayloadLimits limits, uint64_t nonce_base)
      : TransportSender(std::move(context), limits),
        root_(std::move(root)),
        transfer_name_(this->context().transfer_id.ToHex()),
        producer_name_(IdName(this->context().producer_id)),
        next_nonce_(nonce_base) {}

 private:
  Status Deliver(uint32_t payload_id, std::span<const std::byte> payload,
                 const PayloadHeader& /*header*/) override {
    for (const std::string& inbox : context().endpoints) {
      REFIT_RETURN_NOT_OK(Write(inbox, PayloadName(payload_id), payload)
                              .WithContext(fmt::format("file://{}: payload {} of producer {}",
                                                       root_, payload_id, context().producer_id)));
    }
    return Status::OK();
  }

  Status EndStream(uint64_t payloads) override {
    const std::string marker = fmt::format("{}\n", payloads);
    for (const std::string& inbox : context().endpoints) {
      REFIT_RETURN_NOT_OK(Write(inbox, kDoneName, std::as_bytes(std::span(marker)))
                              .WithContext(fmt::format("file://{}: end of producer {}", root_,
                                                       context().producer_id)));
    }
    return Status::OK();
  }

  // Write one file into this producer's directory of `inbox`, creating the directories.
  Status Write(const std::string& inbox, std::string_view name, std::span<const std::byte> bytes) {
    // The drop directory is a mount point: if it is gone, creating it again would write to the
    // local disk where no receiver looks.
    if (!IsDirectory(root_)) return Unavailable("drop directory '{}' is gone", root_);
    const std::string inbox_path = InboxPath(root_, inbox);
    if (!IsDirectory(inbox_path)) {
      return Unavailable("no listener inbox '{}' (the receiver creates it when it starts)",
                         inbox_path);
    }
    const std::string transfer_path = fmt::format("{}/{}", inbox_path, transfer_name_);
    const std::string producer_path = fmt::format("{}/{}", transfer_path, producer_name_);
    // Both directories first, fsyncs after: the producer directory keeps the transfer
    // directory from being removed, so the race window stays two syscalls wide.
    bool created_transfer = false;
    bool created_producer = false;
    Status status;
    for (int attempt = 0; attempt < kDirectoryAttempts; ++attempt) {
      status = MakeDirectory(transfer_path, created_transfer);
      if (!status.ok()) break;  // NotFound: the inbox is gone.
      status = MakeDirectory(producer_path, created_producer);
      // NotFound: a listener removed the transfer directory in between (kDirectoryAttempts).
      if (status.code() != StatusCode::kNotFound) break;
    }
    if (status.code() == StatusCode::kNotFound) return Unavailable("{}", status.message());
    REFIT_RETURN_NOT_OK(status);
    if (created_transfer) REFIT_RETURN_NOT_OK(SyncDirectory(inbox_path));
    if (created_producer) REFIT_RETURN_NOT_OK(SyncDirectory(transfer_path));
    return WriteFileAtomically(producer_path, name, bytes, next_nonce_.fetch_add(1));
  }

  const std::string root_;
  const std::string transfer_name_;
  const std::string producer_name_;
  std::atomic<uint64_t> next_nonce_;
};

// ---- Listener --------------------------------------------------------------------------------

// What identifies one version of a file: a replaced or rewritten file is tried afresh.
struct FileIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  int64_t mtime_ns = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

FileIdentity IdentityOf(const struct stat& info) {
  constexpr int64_t kNanosPerSecond = 1'000'000'000;
  return FileIdentity{info.st_dev, info.st_ino, info.st_size,
                      int64_t{info.st_mtim.tv_sec} * kNanosPerSecond + info.st_mtim.tv_nsec};
}

// A file whose delivery failed and that stays in the drop.
struct KeptFile {
  FileIdentity identity;
  // Not retried until the file changes.
  bool permanent = false;
  // Consecutive retryable failures, and the round from which it is tried again.
  uint64_t failures = 0;
  uint64_t retry_round = 0;
};

class FileListener final : public Listener {
 public:
  FileListener(std::string root, std::string inbox, std::chrono::milliseconds poll_interval,
               PayloadLimits limits, PayloadSink& sink)
      : root_(std::move(root)),
        inbox_(std::move(inbox)),
        inbox_path_(InboxPath(root_, inbox_)),
        poll_interval_(poll_interval),
        limits_(limits),
        sink_(sink) {}

  ~FileListener() override { Stop(); }

  Status Start() override {
    internal::MutexLock lock(state_mutex_);
    if (started_ || stopped_) {
      return FailedPrecondition("file://{}: listener of inbox '{}' was started before", root_,
                                inbox_);
    }
    if (!IsDirectory(root_)) return Unavailable("drop directory '{}' is gone", root_);
    if (!inbox_.empty()) {
      bool created = false;
      const Status made = MakeDirectory(inbox_path_, created);
      if (made.code() == StatusCode::kNotFound) {
        return Unavailable("drop directory '{}' is gone", root_);
      }
      REFIT_RETURN_NOT_OK(made);
      if (created) REFIT_RETURN_NOT_OK(SyncDirectory(root_));
    }
    if (poll_interval_.count() > 0) {
      try {
        thread_ = std::jthread([this](const std::stop_token&) { RunPolling(); });
      } catch (const std::system_error& error) {
        return ResourceExhausted("file://{}: cannot start the polling thread: {}", root_,
                                 error.what());
      }
    }
    started_ = true;
    return Status::OK();
  }

  void Stop() override {
    {
      internal::MutexLock lock(state_mutex_);
      if (stopped_) return;
      stopped_ = true;
    }
    stop_.request_stop();
    if (thread_.joinable()) thread_.join();
    // Wait for a Poll running on another thread: after Stop the sink is never called again.
    internal::MutexLock poll_lock(poll_mutex_);
  }

  Result<PollReport> Poll() override { return PollRound(); }

  ListenerStats stats() const override {
    internal::MutexLock lock(state_mutex_);
    return stats_;
  }

  const std::string& endpoint() const override { return inbox_; }

 private:
  void RunPolling() {
    NameCurrentThread(kPollThreadName);
    const std::stop_token stop = stop_.get_token();
    internal::Mutex wait_mutex;
    internal::CondVar wake;
    Status previous;
    while (!stop.stop_requested()) {
      Result<PollReport> round = PollRound();
      if (stop.stop_requested()) break;
      // A round-level error (the inbox is gone) repeats every round: log it when it changes.
      if (!(round.status() == previous)) {
        if (round.ok()) {
          REFIT_LOG_INFO("file://{}: inbox '{}' readable again", root_, inbox_);
        } else {
          REFIT_LOG_WARN("file://{}: {}", root_, round.status().ToString());
        }
        previous = round.status();
      }
      internal::MutexLock lock(wait_mutex);
      wake.wait_for(lock, stop, poll_interval_, [] { return false; });
    }
  }

  Result<PollReport> PollRound() {
    internal::MutexLock poll_lock(poll_mutex_);
    {
      internal::MutexLock lock(state_mutex_);
      if (!started_ || stopped_) {
        return FailedPrecondition("file://{}: listener of inbox '{}' is {}", root_, inbox_,
                                  stopped_ ? "stopped" : "not started");
      }
    }
    ++round_;
    PollReport report;
    std::set<std::string> seen;
    const Status status = WalkInbox(report, seen);
    // Forget kept files that are gone (delivered by a replacement, or removed by an operator),
    // once a complete walk has seen every file that is still there.
    if (status.ok() && !stop_.stop_requested()) {
      std::erase_if(kept_, [&](const auto& entry) { return !seen.contains(entry.first); });
    }

    internal::MutexLock lock(state_mutex_);
    stats_.delivered += report.delivered;
    stats_.duplicates += report.duplicates;
    stats_.streams_ended += report.ended.size();
    stats_.failures += report.failures.size();
    if (!report.failures.empty()) stats_.last_error = report.failures.back().status;
    if (!status.ok()) {
      ++stats_.failures;
      stats_.last_error = status;
      return status;
    }
    return report;
  }

  Status WalkInbox(PollReport& report, std::set<std::string>& seen) {
    Result<std::vector<std::string>> transfers = ListDirectory(inbox_path_);
    if (!transfers.ok()) {
      if (transfers.status().code() == StatusCode::kNotFound) {
        return Unavailable("file://{}: inbox '{}' is gone (was the drop unmounted?)", root_,
                           inbox_path_);
      }
      return transfers.status();
    }
    std::sort(transfers->begin(), transfers->end());
    const std::stop_token stop = stop_.get_token();
    for (const std::string& transfer_name : *transfers) {
      const std::optional<TransferId> transfer_id = ParseTransferName(transfer_name);
      if (!transfer_id) continue;
      const std::string transfer_path = fmt::format("{}/{}", inbox_path_, transfer_name);
      Result<std::vector<std::string>> producers = ListDirectory(transfer_path);
      if (!producers.ok()) continue;  // Not a directory, or removed meanwhile.
      std::map<uint32_t, std::string> by_id;
      for (const std::string& name : *producers) {
        if (const std::optional<uint32_t> id = ParseIdName(name)) by_id.emplace(*id, name);
      }
      const size_t ended_before = report.ended.size();
      for (const auto& [producer_id, name] : by_id) {
        if (stop.stop_requested()) return Status::OK();
        const std::string producer_path = fmt::format("{}/{}", transfer_path, name);
        WalkProducer(*transfer_id, producer_id, producer_path, report, seen);
      }
      // Only after a stream ended here, so that a directory a sender has just created (and is
      // about to fill) is not taken from under it; succeeds once every producer's directory is
      // gone. A sender racing with it retries (kDirectoryAttempts).
      if (report.ended.size() > ended_before) ::rmdir(transfer_path.c_str());
    }
    return Status::OK();
  }

  void WalkProducer(const TransferId& transfer_id, uint32_t producer_id,
                    const std::string& producer_path, PollReport& report,
                    std::set<std::string>& seen) {
    Result<std::vector<std::string>> names = ListDirectory(producer_path);
    if (!names.ok()) return;
    std::map<uint32_t, std::string> payloads;
    bool done = false;
    for (const std::string& name : *names) {
      if (name == kDoneName) {
        done = true;
      } else if (const std::optional<uint32_t> id = ParsePayloadName(name)) {
        payloads.emplace(*id, name);
      }
    }
    bool all_delivered = true;
    for (const auto& [payload_id, name] : payloads) {
      const PayloadIds ids{transfer_id, producer_id, payload_id, 0, 0};
      all_delivered &= DeliverFile(fmt::format("{}/{}", producer_path, name), ids, report, seen);
    }
    if (done && all_delivered) EndStream(transfer_id, producer_id, producer_path, report, seen);
  }

  // Record a failed delivery of `path` (identity `identity`) and keep the file.
  void Keep(const std::string& path, const FileIdentity& identity, Status status,
            PollReport& report) {
    KeptFile& kept = kept_[path];
    if (!(kept.identity == identity)) kept = KeptFile{identity};
    kept.permanent = !IsRetryable(status.code());
    if (kept.permanent) {
      REFIT_LOG_WARN("file://{}: keeping '{}': {}", root_, path, status.ToString());
    } else {
      ++kept.failures;
      kept.retry_round =
          round_ + std::min(kMaxRetryBackoffRounds,
                            uint64_t{1} << std::min<uint64_t>(kept.failures - 1, 63));
      REFIT_LOG_DEBUG("file://{}: '{}' not delivered yet: {}", root_, path, status.ToString());
    }
    report.failures.push_back(DeliveryFailure{path, std::move(status)});
  }

  // Whether an earlier failure of this version of `path` says not to try it in this round.
  bool Skip(const std::string& path, const FileIdentity& identity) const {
    auto it = kept_.find(path);
    if (it == kept_.end() || !(it->second.identity == identity)) return false;
    return it->second.permanent || round_ < it->second.retry_round;
  }

  // One read of a kept-or-new file.
  struct FileRead {
    FileIdentity identity;
    // An earlier failure of this same version says not to try it in this round.
    bool skipped = false;
    std::vector<std::byte> bytes;
  };

  // Open `path` and, unless skipped, read it whole if it is a regular file of at most
  // `max_bytes`. `read.identity` is set whenever the file could be opened.
  // Errors: NotFound when the file is gone; DataLoss, ResourceExhausted, IoError.
  Status ReadFile(const std::string& path, uint64_t max_bytes, FileRead& read) const {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd.get() < 0) {
      if (errno == ENOENT) return NotFound("'{}' is gone", path);
      return IoErrorFromErrno(errno, fmt::format("open '{}'", path));
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0) {
      return IoErrorFromErrno(errno, fmt::format("stat '{}'", path));
    }
    read.identity = IdentityOf(info);
    read.skipped = Skip(path, read.identity);
    if (read.skipped) return Status::OK();
    if (!S_ISREG(info.st_mode)) return DataLoss("'{}' is not a regular file", path);
    const auto size = static_cast<uint64_t>(info.st_size);
    if (size > max_bytes) {
      return ResourceExhausted("'{}' has {} bytes > limit {}", path, size, max_bytes);
    }
    read.bytes.resize(size);
    return ReadAll(fd.get(), read.bytes, path);
  }

  // Deliver payload file `path`, whose name says `ids` (versions unknown). Return whether the
  // file is no longer pending (delivered and removed, or gone).
  bool DeliverFile(const std::string& path, const PayloadIds& ids, PollReport& report,
                   std::set<std::string>& seen) {
    FileRead read;
    const Status status = ReadFile(path, limits_.max_payload_bytes, read);
    if (status.code() == StatusCode::kNotFound) return true;
    seen.insert(path);
    const FileIdentity& identity = read.identity;
    if (read.skipped) return false;
    if (!status.ok()) {
      Keep(path, identity, status, report);
      return false;
    }
    Result<ValidatedPayload> payload = ValidatePayload(std::move(read.bytes), limits_);
    if (!payload.ok()) {
      Keep(path, identity, payload.status().WithContext(fmt::format("'{}'", path)), report);
      return false;
    }
    const PayloadIds& got = payload->ids();
    if (got.transfer_id != ids.transfer_id || got.producer_id != ids.producer_id ||
        got.payload_id != ids.payload_id) {
      Keep(path, identity,
           DataLoss("'{}' holds payload {} of producer {} in transfer {}", path, got.payload_id,
                    got.producer_id, got.transfer_id.ToHex()),
           report);
      return false;
    }
    Result<StageResult> staged = sink_.Deliver(std::move(*payload), stop_.get_token());
    if (!staged.ok()) {
      Keep(path, identity, staged.status().WithContext(fmt::format("delivering '{}'", path)),
           report);
      return false;
    }
    ++(*staged == StageResult::kDuplicate ? report.duplicates : report.delivered);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      // Staged, but it would be delivered again (as a duplicate) next round.
      Keep(path, identity, IoErrorFromErrno(errno, fmt::format("remove delivered '{}'", path)),
           report);
      return false;
    }
    kept_.erase(path);
    return true;
  }

  // Every payload file of the stream is delivered: deliver its end and remove its directory.
  void EndStream(const TransferId& transfer_id, uint32_t producer_id,
                 const std::string& producer_path, PollReport& report,
                 std::set<std::string>& seen) {
    // List again: a payload must never be missed because the first listing predates it.
    Result<std::vector<std::string>> names = ListDirectory(producer_path);
    if (!names.ok()) return;
    std::vector<std::string> debris;
    for (const std::string& name : *names) {
      if (ParsePayloadName(name)) return;
      if (EndsWith(name, kTmpSuffix)) debris.push_back(name);
    }
    const std::string done_path = fmt::format("{}/{}", producer_path, kDoneName);
    FileRead read;
    const Status status = ReadFile(done_path, kMaxDoneMarkerBytes, read);
    if (status.code() == StatusCode::kNotFound) return;
    seen.insert(done_path);
    const FileIdentity& identity = read.identity;
    if (read.skipped) return;
    if (!status.ok()) {
      Keep(done_path, identity, status, report);
      return;
    }
    std::string_view text(reinterpret_cast<const char*>(read.bytes.data()), read.bytes.size());
    if (EndsWith(text, "\n")) text.remove_suffix(1);
    uint64_t count = 0;
    const auto [ptr, error] = std::from_chars(text.data(), text.data() + text.size(), count);
    if (text.empty() || error != std::errc() || ptr != text.data() + text.size() ||
        count > std::numeric_limits<uint32_t>::max()) {
      Keep(done_path, identity,
           DataLoss("'{}' is not a payload count: '{}'", done_path, Printable(text)), report);
      return;
    }
    const StreamEnd end{transfer_id, producer_id, static_cast<uint32_t>(count)};
    const Status ended = sink_.EndOfStream(end);
    if (!ended.ok()) {
      Keep(done_path, identity, ended.WithContext(fmt::format("ending '{}'", done_path)), report);
      return;
    }
    report.ended.push_back(end);
    // Once `done` exists no Send of this stream is in flight, so `.tmp` files are debris of
    // failed writes. Removal is best effort: what stays is ignored by later rounds.
    for (const std::string& name : debris) {
      ::unlink(fmt::format("{}/{}", producer_path, name).c_str());
    }
    ::unlink(done_path.c_str());
    ::rmdir(producer_path.c_str());
    kept_.erase(done_path);
  }

  const std::string root_;
  const std::string inbox_;
  const std::string inbox_path_;
  const std::chrono::milliseconds poll_interval_;
  const PayloadLimits limits_;
  PayloadSink& sink_;
  std::stop_source stop_;

  mutable internal::Mutex state_mutex_;
  bool started_ = false;
  bool stopped_ = false;
  ListenerStats stats_;

  // Serialises rounds; guards round_ and kept_.
  internal::Mutex poll_mutex_;
  uint64_t round_ = 0;
  std::map<std::string, KeptFile> kept_;

  std::jthread thread_;
};

class FileTransport final : public Transport {
 public:
  FileTransport(TransportUri uri, std::string root, std::chrono::milliseconds poll_interval,
                TransportOptions options)
      : Transport(std::move(uri)),
        root_(std::move(root)),
        poll_interval_(poll_interval),
        options_(options) {}

  TransportCapabilities capabilities() const override { return kFileCapabilities; }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    for (const std::string& inbox : context.endpoints) {
      REFIT_RETURN_NOT_OK(CheckInboxName(root_, inbox));
    }
    // Temporary names of concurrent writers (threads, retries, other processes) must differ.
    const TransferId random = TransferId::Random();
    uint64_t nonce_base = 0;
    std::memcpy(&nonce_base, random.bytes.data(), sizeof(nonce_base));
    return std::unique_ptr<TransportSender>(
        std::make_unique<FileSender>(root_, context, options_.limits, nonce_base));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    REFIT_RETURN_NOT_OK(CheckInboxName(root_, context.endpoint));
    if (!context.peers.empty()) {
      return InvalidArgument("file://{}: listener '{}' given {} relay peers; file does not relay",
                             root_, context.endpoint, context.peers.size());
    }
    if (!context.bind_address.empty()) {
      return InvalidArgument(
          "file://{}: listener '{}' given bind address '{}'; file binds no address", root_,
          context.endpoint, Printable(context.bind_address));
    }
    return std::unique_ptr<Listener>(std::make_unique<FileListener>(
        root_, context.endpoint, poll_interval_, options_.limits, sink));
  }

 private:
  const std::string root_;
  const std::chrono::milliseconds poll_interval_;
  const TransportOptions options_;
};

}  // namespace

Result<std::unique_ptr<Transport>> MakeFileTransport(const TransportUri& uri,
                                                     const TransportOptions& options) {
  REFIT_RETURN_NOT_OK(CheckKnownParams(uri, {"poll_ms"}));
  REFIT_ASSIGN_OR_RETURN(const uint64_t poll_ms,
                         UintParam(uri, "poll_ms", kDefaultPollMs, kMaxPollMs));
  std::string root = uri.target;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (root.empty()) {
    return InvalidArgument("transport URI '{}': names no directory (file:///<path>)",
                           Printable(uri.ToString()));
  }
  return std::unique_ptr<Transport>(std::make_unique<FileTransport>(
      uri, std::move(root), std::chrono::milliseconds(poll_ms), options));
}

}  // namespace refit::internal
