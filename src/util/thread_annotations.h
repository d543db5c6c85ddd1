// Clang's thread-safety analysis (-Wthread-safety, on in clang builds as an error): which mutex
// guards which member, and which functions need it held. Under other compilers the macros expand
// to nothing. See https://clang.llvm.org/docs/ThreadSafetyAnalysis.html; the names follow Abseil's.
#pragma once

#if defined(__clang__)
#define REFIT_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define REFIT_THREAD_ANNOTATION(x)
#endif

/// A type that is a lock (refit::internal::Mutex).
#define REFIT_CAPABILITY(name) REFIT_THREAD_ANNOTATION(capability(name))
/// An RAII type that holds a lock for its lifetime (refit::internal::MutexLock).
#define REFIT_SCOPED_CAPABILITY REFIT_THREAD_ANNOTATION(scoped_lockable)
/// A member read or written only with `mu` held.
#define REFIT_GUARDED_BY(mu) REFIT_THREAD_ANNOTATION(guarded_by(mu))
/// A pointer member whose pointee is read or written only with `mu` held.
#define REFIT_PT_GUARDED_BY(mu) REFIT_THREAD_ANNOTATION(pt_guarded_by(mu))
/// A function called with the locks held (and returning with them held).
#define REFIT_REQUIRES(...) REFIT_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
/// A function called without the locks held (it takes them itself).
#define REFIT_EXCLUDES(...) REFIT_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
/// A function that takes the locks, or releases them.
#define REFIT_ACQUIRE(...) REFIT_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define REFIT_RELEASE(...) REFIT_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
/// A function that returns a reference to the lock `mu` (so that callers may name it).
#define REFIT_RETURN_CAPABILITY(mu) REFIT_THREAD_ANNOTATION(lock_returned(mu))
/// A function the analysis does not check (say why where it is used).
#define REFIT_NO_THREAD_SAFETY_ANALYSIS REFIT_THREAD_ANNOTATION(no_thread_safety_analysis)
