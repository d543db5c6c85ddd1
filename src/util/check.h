// Internal invariant checks. Anything from the wire, a file, a user or a peer is input and gets a
// Status; REFIT_DCHECK is only for conditions the code itself guarantees.
#pragma once

#include <cstdio>
#include <cstdlib>

#ifndef NDEBUG
#define REFIT_DCHECK(condition, message)                                                           \
  do {                                                                                             \
    if (!(condition)) {                                                                            \
      std::fprintf(stderr, "%s:%d: REFIT_DCHECK(%s) failed: %s\n", __FILE__, __LINE__, #condition, \
                   message);                                                                       \
      std::abort();                                                                                \
    }                                                                                              \
  } while (false)
#else
#define REFIT_DCHECK(condition, message) \
  do {                                   \
  } while (false && (condition))
#endif
