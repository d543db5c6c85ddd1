"""Load the CUDA libraries of PyPI's ``nvidia-*`` wheels before ``refit._core``, when present.

A core built on a machine with CUDA links ``libnccl.so.2`` and ``libcudart.so.13`` (the
``nccl://`` transport) from the system's CUDA directory. PyPI's torch loads the same sonames from
its ``nvidia-*`` wheels, and the dynamic loader keeps whichever copy came first: imported before
torch, the core's system NCCL would stand in for torch's newer one, and ``import torch`` then
fails (``libtorch_cuda.so: undefined symbol: ncclCommResume`` with torch 2.14). Loading the
wheels' copies first, globally, as torch itself does, gives both the same, newer libraries (one
soname, one ABI). Nothing happens where the wheels are not installed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

#: (package of the nvidia wheel, library file), in dependency order.
_LIBRARIES = (("nvidia.cu13", "libcudart.so.13"), ("nvidia.cuda_runtime", "libcudart.so.13"), ("nvidia.nccl", "libnccl.so.2"))


def preload() -> None:
    """dlopen (RTLD_GLOBAL) each library above that an installed nvidia wheel ships."""
    loaded = set()
    for package, library in _LIBRARIES:
        if library in loaded:
            continue
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for directory in list(spec.submodule_search_locations or []) if spec else []:
            path = os.path.join(directory, "lib", library)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    loaded.add(library)
                except OSError:
                    pass
                break
