// `refit demo --transport mpi://`: the demo as an MPI job on this machine. Started outside
// mpirun, it runs itself under `mpirun -np W+R`; each rank then plays its part: ranks 0 … W−1 a
// simulated trainer's producers (the same simulation on each, every one owning its chunks), the
// others receivers with the initial export in memory. Step 0 is a FULL; right after it, a plain
// MPI_Bcast of the model's bytes to every rank is the raw-copy yardstick every step's time is
// compared with. At the end every receiver's bytes are compared with the trainer's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit::cli {

struct MpiDemoSettings {
  std::string transport;  // mpi://…
  uint64_t model_bytes = 0;
  std::string dtype = "bfloat16";
  std::string op = "xor";
  int steps = 5;
  std::vector<double> densities;
  uint32_t receivers = 2;
  uint32_t producers = 1;
  uint64_t seed = 42;
  int threads = 2;
  bool json = false;
};

/// Run the MPI demo: re-execute under mpirun when not inside an MPI job, else this rank's part.
Status RunMpiDemo(const MpiDemoSettings& settings);

}  // namespace refit::cli
