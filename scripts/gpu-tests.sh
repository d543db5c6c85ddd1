#!/usr/bin/env bash
# Run the tests that need a GPU on a machine with CUDA devices, NCCL and Open MPI. Usage:
#   scripts/gpu-tests.sh
#
# 1. nccl://
# Builds the dev preset (CMake finds CUDA under /usr/local/cuda, or CUDAToolkit_ROOT, and NCCL
# beside it; the configure log says "refit: nccl:// with CUDA …"), checks that a device is
# visible, then runs the ctest label `nccl`: mpi_transport_test's whole scenario (deltas, an empty
# delta, a forced anchor, a corrupted payload rolled back, the additive mode) with every
# broadcast of the data plane made by ncclBroadcast, for 1 producer -> 1 receiver and
# 2 producers -> 2 receivers. Each rank takes device (local rank % devices); one GPU serves all.
# Elsewhere those tests exit 77 and ctest reports them skipped, which this script refuses.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-tests.sh: no CUDA device visible (nvidia-smi -L failed): run this on a GPU machine" >&2
  exit 1
fi
nvidia-smi -L
bash scripts/setup.sh
cmake --preset dev | grep -E "refit: nccl://" || {
  echo "gpu-tests.sh: CMake did not find CUDA and NCCL (set CUDAToolkit_ROOT)" >&2
  exit 1
}
cmake --build --preset dev -j"$(nproc)" --target mpi_transport_test refit_python
ctest --preset dev -L nccl --output-on-failure --timeout 600 | tee /tmp/refit-gpu-tests.log
if grep -q "Skipped" /tmp/refit-gpu-tests.log; then
  echo "gpu-tests.sh: a nccl test was skipped although a device is visible" >&2
  exit 1
fi

# 2. The device boundary's torch backend on CUDA tensors (refit.torch.TorchTensorMemory): the
# tests named *cuda* in python/tests/test_torch.py (deltas and an anchor applied in place into a
# module on the GPU, the traffic counted, an aborted sync rolled back on the device) and in
# python/tests/test_torch_staging.py (a trainer on the GPU publishing through the staging pool).
# They skip without a device, which this script refuses.
PYTHONPATH=python:build/dev/python .venv/bin/python -m pytest -q -rs -p no:cacheprovider \
  python/tests/test_torch.py python/tests/test_torch_staging.py -k cuda | tee /tmp/refit-gpu-torch.log
if grep -qi "skipped" /tmp/refit-gpu-torch.log; then
  echo "gpu-tests.sh: a CUDA torch test was skipped although a device is visible" >&2
  exit 1
fi
