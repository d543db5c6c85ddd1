"""Build refit._core with the project's CMake build, then package it with the Python sources.

The extension is the CMake target ``refit_python`` (python/CMakeLists.txt), built against the
system's libraries. Where it is built:

- ``REFIT_CMAKE_BUILD_DIR``: an existing (or new) CMake build tree to reuse — e.g. ``build/dev``
  after ``scripts/test.sh``, so that installing compiles only what changed;
- otherwise ``<checkout>/build/python``, configured here once (Release, no tests or benchmarks).

``REFIT_SOURCE_DIR`` names the checkout when this file does not sit in its ``python/`` folder.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    """Build every extension by building the CMake target of the same name's module."""

    def build_extension(self, ext: Extension) -> None:
        source = Path(os.environ.get("REFIT_SOURCE_DIR", HERE.parent)).resolve()
        if not (source / "CMakeLists.txt").exists():
            raise RuntimeError(f"refit: no CMakeLists.txt in {source}; set REFIT_SOURCE_DIR to the checkout")
        build = Path(os.environ.get("REFIT_CMAKE_BUILD_DIR", source / "build" / "python")).resolve()
        if not (build / "CMakeCache.txt").exists():
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.run(
                ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                 "-DREFIT_BUILD_TESTS=OFF", "-DREFIT_BUILD_BENCHMARKS=OFF",
                 f"-DREFIT_PYTHON={sys.executable}"],
                check=True,
            )
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", str(build), "--target", "refit_python", "-j", jobs], check=True)
        built = sorted((build / "python" / "refit").glob("_core*.so"))
        if not built:
            raise RuntimeError(f"refit: the build in {build} made no python/refit/_core*.so")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], target)


setup(ext_modules=[Extension("refit._core", sources=[])], cmdclass={"build_ext": CMakeBuild})
