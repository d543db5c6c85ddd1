"""Build refit._core with the project's CMake build, then package it with the Python sources.

The extension is the CMake target ``refit_python`` (python/CMakeLists.txt), built against the
system's libraries. Where it is built — the first that applies:

- ``REFIT_CMAKE_BUILD_DIR``: an existing (or new) CMake build tree to reuse;
- an existing build tree of the checkout, ``build/release`` (scripts/demo.sh) or ``build/dev``
  (scripts/test.sh): installing then compiles only the module and what changed, instead of the
  whole core a second time (a tree built for another Python version is skipped);
- otherwise ``<checkout>/build/python``, configured here once (Release, no tests or benchmarks).

pip shows a build's output only with ``-v``; so that an install is not silent for minutes, each
step and the build's progress are also written to the terminal (``/dev/tty``) when there is one,
unless ``CI=true`` or ``REFIT_BUILD_PROGRESS=0`` (the offline-install test sets it).

``REFIT_SOURCE_DIR`` names the checkout when this file does not sit in its ``python/`` folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# The checkout's own build trees that an install reuses, in this order (scripts/demo.sh makes the
# first, scripts/test.sh the second).
REUSED_TREES = ("build/release", "build/dev")
# A line of Ninja's progress: "[12/80] Building CXX object ...".
NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


class Progress:
    """Lines for the user while pip captures the build's output: to the terminal, if any."""

    def __init__(self) -> None:
        self.tty = None
        if os.environ.get("CI") != "true" and os.environ.get("REFIT_BUILD_PROGRESS") != "0":
            try:
                self.tty = open("/dev/tty", "w")  # noqa: SIM115 (closed in close())
            except OSError:
                self.tty = None

    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        if self.tty is not None:
            self.tty.write(f"\r\033[K{text}\n")
            self.tty.flush()

    def status(self, text: str) -> None:
        """Overwrite the terminal's last line (the build's [done/total])."""
        if self.tty is not None:
            self.tty.write(f"\r\033[K{text}")
            self.tty.flush()

    def close(self) -> None:
        if self.tty is not None:
            self.tty.write("\r\033[K")
            self.tty.close()
            self.tty = None


def has_python_target(build: Path) -> bool:
    """Whether the configured tree `build` has the refit_python target (pybind11 was found)."""
    ninja = build / "build.ninja"
    if ninja.exists():
        return "refit_python" in ninja.read_text(errors="replace")
    return (build / "python" / "Makefile").exists()


def extension_suffix(python: str) -> str | None:
    """The extension modules' file suffix of the interpreter `python` (its version and ABI)."""
    try:
        answer = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
            capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.strip()


def reusable_tree(source: Path) -> Path | None:
    """The checkout's first build tree that builds the module for this Python's ABI, if any."""
    ours = sysconfig.get_config_var("EXT_SUFFIX")
    for name in REUSED_TREES:
        cache = source / name / "CMakeCache.txt"
        if not cache.exists():
            continue
        found = re.search(r"^Python_EXECUTABLE:FILEPATH=(.+)$", cache.read_text(errors="replace"),
                          re.MULTILINE)
        # A tree configured without Python is configured again before the build (below).
        if found is None or extension_suffix(found[1].strip()) == ours:
            return source / name
    return None


class CMakeBuild(build_ext):
    """Build every extension by building the CMake target of the same name's module."""

    def build_extension(self, ext: Extension) -> None:
        progress = Progress()
        try:
            self.build_with(progress, ext)
        finally:
            progress.close()

    def build_with(self, progress: Progress, ext: Extension) -> None:
        source = Path(os.environ.get("REFIT_SOURCE_DIR", HERE.parent)).resolve()
        if not (source / "CMakeLists.txt").exists():
            raise RuntimeError(f"refit: no CMakeLists.txt in {source}; set REFIT_SOURCE_DIR to the checkout")
        if "REFIT_CMAKE_BUILD_DIR" in os.environ:
            build = Path(os.environ["REFIT_CMAKE_BUILD_DIR"]).resolve()
            why = "REFIT_CMAKE_BUILD_DIR"
        elif (tree := reusable_tree(source)) is not None:
            build = tree
            why = "reusing the checkout's CMake build"
        else:
            build = source / "build" / "python"
            why = "no CMake build to reuse (scripts/demo.sh or scripts/test.sh make one)"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        if not (build / "CMakeCache.txt").exists():
            progress.line(f"refit: configuring {build} ({why})")
            subprocess.run(
                ["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                 "-DREFIT_BUILD_TESTS=OFF", "-DREFIT_BUILD_BENCHMARKS=OFF",
                 f"-DREFIT_PYTHON={sys.executable}"],
                check=True, stdout=sys.stderr,
            )
        elif not has_python_target(build):
            # Configured before pybind11 or Python's headers were installed: look again.
            progress.line(f"refit: configuring {build} again to find pybind11 ({why})")
            subprocess.run(["cmake", "-S", str(source), "-B", str(build)], check=True, stdout=sys.stderr)
        if not has_python_target(build):
            raise RuntimeError(
                f"refit: the CMake build in {build} has no refit_python target: pybind11 or Python's "
                "development files were not found (Debian: apt-get install pybind11-dev python3-dev)")
        progress.line(f"refit: building the core module (target refit_python) in {build}, {why}")
        self.run_build(progress, build)
        built = sorted((build / "python" / "refit").glob("_core*.so"))
        if not built:
            raise RuntimeError(f"refit: the build in {build} made no python/refit/_core*.so")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], target)
        progress.line(f"refit: built {built[-1].name}")

    @staticmethod
    def run_build(progress: Progress, build: Path) -> None:
        """cmake --build, its output to stderr (pip -v shows it) and its [done/total] to the tty."""
        jobs = str(os.cpu_count() or 2)
        command = ["cmake", "--build", str(build), "--target", "refit_python", "-j", jobs]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as child:
            assert child.stdout is not None
            for text in child.stdout:
                sys.stderr.write(text)
                match = NINJA_PROGRESS.match(text)
                if match:
                    progress.status(f"refit: building the core [{match[1]}/{match[2]}]")
            if child.wait() != 0:
                raise RuntimeError(f"refit: {' '.join(command)} failed (exit {child.returncode}); "
                                   "pip install -v shows its output")


setup(ext_modules=[Extension("refit._core", sources=[])], cmdclass={"build_ext": CMakeBuild})
