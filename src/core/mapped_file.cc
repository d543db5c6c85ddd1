#include "core/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

#include "refit/status_format.h"

namespace refit::internal {
namespace {

// Return an IoError for the failed OS call that set errno. errno is read before the message is
// formatted: formatting allocates, and the allocator may clobber errno.
template <typename... Args>
Status ErrnoError(fmt::format_string<Args...> format, Args&&... args) {
  const int errnum = errno;
  return IoErrorFromErrno(errnum, fmt::format(format, std::forward<Args>(args)...));
}

// How a file is opened and mapped.
struct MapMode {
  int open_flags;
  int prot;
  int map_flags;
};

constexpr MapMode kReadOnly{O_RDONLY, PROT_READ, MAP_SHARED};
constexpr MapMode kReadWrite{O_RDWR, PROT_READ | PROT_WRITE, MAP_SHARED};
// Copy-on-write only needs read access to the file: writes never reach it.
constexpr MapMode kCopyOnWrite{O_RDONLY, PROT_READ | PROT_WRITE, MAP_PRIVATE};

// Owns a file descriptor until released; closes it on every early error return.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) = delete;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// The pieces of a MappedFile, assembled by the factories (which alone may call its constructor).
struct Mapping {
  void* base;
  size_t size;
  int fd;
};

// mmap `size` bytes of `fd` and take ownership of it. A zero-length mapping is invalid for mmap
// (EINVAL), so an empty file maps to a null base with size 0, which bytes() turns into an empty
// span.
Result<Mapping> MapFd(ScopedFd fd, size_t size, const MapMode& mode, const std::string& what) {
  void* base = nullptr;
  if (size > 0) {
    base = ::mmap(nullptr, size, mode.prot, mode.map_flags, fd.get(), 0);
    if (base == MAP_FAILED) {
      return ErrnoError("mmap {}", what);
    }
  }
  return Mapping{base, size, fd.release()};
}

Result<Mapping> MapPath(const std::string& path, const MapMode& mode) {
  const std::string what = fmt::format("'{}'", path);
  ScopedFd fd(::open(path.c_str(), mode.open_flags | O_CLOEXEC));
  if (fd.get() < 0) {
    return ErrnoError("open {}", what);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoError("fstat {}", what);
  }
  // mmap of a directory or a device would fail with an obscure errno (or map something that is
  // not file contents), so say plainly what is wrong.
  if (!S_ISREG(st.st_mode)) {
    return IoError("mmap {}: not a regular file", what);
  }
  return MapFd(std::move(fd), static_cast<size_t>(st.st_size), mode, what);
}

// Open an unnamed file in `dir`: O_TMPFILE where the kernel and filesystem support it, else a
// named file from mkstemp that is unlinked at once. Either way nothing is left behind on exit.
Result<ScopedFd> OpenUnnamedFile(const std::string& dir) {
  ScopedFd fd(::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, S_IRUSR | S_IWUSR));
  if (fd.get() >= 0) {
    return fd;
  }
  // EOPNOTSUPP: the filesystem lacks O_TMPFILE. EISDIR: the kernel predates O_TMPFILE and saw a
  // plain directory open. Anything else (ENOENT, EACCES, …) would fail for mkstemp too.
  if (errno != EOPNOTSUPP && errno != EISDIR) {
    return ErrnoError("open temporary file in '{}'", dir);
  }
  std::string name = dir + "/refit-tmp-XXXXXX";
  ScopedFd named(::mkostemp(name.data(), O_CLOEXEC));
  if (named.get() < 0) {
    return ErrnoError("mkstemp '{}'", name);
  }
  if (::unlink(name.c_str()) != 0) {
    return ErrnoError("unlink '{}'", name);
  }
  return named;
}

}  // namespace

MappedFile::~MappedFile() {
  if (base_ != nullptr) {
    ::munmap(base_, size_);
  }
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

Result<std::unique_ptr<MappedFile>> MappedFile::OpenReadOnly(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(Mapping m, MapPath(path, kReadOnly));
  return std::unique_ptr<MappedFile>(new MappedFile(m.base, m.size, m.fd));
}

Result<std::unique_ptr<MappedFile>> MappedFile::OpenReadWrite(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(Mapping m, MapPath(path, kReadWrite));
  return std::unique_ptr<MappedFile>(new MappedFile(m.base, m.size, m.fd));
}

Result<std::unique_ptr<MappedFile>> MappedFile::OpenCopyOnWrite(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(Mapping m, MapPath(path, kCopyOnWrite));
  return std::unique_ptr<MappedFile>(new MappedFile(m.base, m.size, m.fd));
}

Result<std::unique_ptr<MappedFile>> MappedFile::CreateTemporary(const std::string& dir,
                                                                size_t size) {
  REFIT_ASSIGN_OR_RETURN(ScopedFd fd, OpenUnnamedFile(dir));
  // ftruncate extends with a hole that reads as zeros, so no page is written up front.
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return ErrnoError("ftruncate temporary file in '{}' to {} bytes", dir, size);
  }
  REFIT_ASSIGN_OR_RETURN(Mapping m, MapFd(std::move(fd), size, kReadWrite,
                                          fmt::format("temporary file in '{}'", dir)));
  return std::unique_ptr<MappedFile>(new MappedFile(m.base, m.size, m.fd));
}

}  // namespace refit::internal
