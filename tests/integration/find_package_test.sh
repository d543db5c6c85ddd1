#!/usr/bin/env bash
# refit as an installed library, seen from a project outside the tree: install this build into a
# fresh prefix; check that the installed headers need only the standard library and are exactly
# the API refit/api.h includes; then build a tiny consumer against it twice — with CMake
# (find_package(refit), refit::refit) and with pkg-config (refit.pc) — and check that each runs
# and prints the project's version, and one more with CMake that includes refit/api.h alone and
# refits a receiver of its own memory from a trainer rank over loopback.
#
# Usage: find_package_test.sh BUILD_DIR WORK_DIR VERSION [CMAKE [CXX]]
set -euo pipefail

build_dir=$1
work_dir=$2
version=$3
cmake=${4:-cmake}
cxx=${5:-c++}

rm -rf "$work_dir"
mkdir -p "$work_dir"
prefix=$work_dir/prefix
consumer=$work_dir/consumer

echo "== cmake --install $build_dir --prefix $prefix"
"$cmake" --install "$build_dir" --prefix "$prefix" > "$work_dir/install.log"

# What must be there: headers (with the generated version.h), the archives, the CLI, the package.
libdir=
for candidate in "$prefix"/lib "$prefix"/lib64 "$prefix"/lib/*-linux-gnu; do
  if [[ -f $candidate/cmake/refit/refitConfig.cmake ]]; then libdir=$candidate; break; fi
done
[[ -n $libdir ]] || { echo "FAIL: no refitConfig.cmake under $prefix" >&2; exit 1; }
for f in "$prefix/include/refit/version.h" "$prefix/include/refit/dtype.h" "$prefix/bin/refit" \
         "$libdir/cmake/refit/refitConfigVersion.cmake" "$libdir/cmake/refit/refitTargets.cmake" \
         "$libdir/pkgconfig/refit.pc"; do
  [[ -e $f ]] || { echo "FAIL: not installed: $f" >&2; exit 1; }
done
for layer in util core codec pipeline receiver transport control node workload; do
  [[ -f $libdir/librefit_$layer.a ]] || { echo "FAIL: not installed: librefit_$layer.a" >&2; exit 1; }
done
if grep -rq "$(cd "$(dirname "$0")/../.." && pwd)" "$libdir/cmake/refit" "$libdir/pkgconfig/refit.pc"; then
  echo "FAIL: the installed package refers to the source tree:" >&2
  grep -rn "$(cd "$(dirname "$0")/../.." && pwd)" "$libdir/cmake/refit" "$libdir/pkgconfig/refit.pc" >&2
  exit 1
fi
cli_version=$("$prefix/bin/refit" --version)
[[ $cli_version == "refit $version" ]] || { echo "FAIL: refit --version: '$cli_version'" >&2; exit 1; }

# Including refit needs only the standard library: every installed header but
# refit/status_format.h (the {fmt}-formatting error constructors, for code that makes errors)
# compiles on its own include path with no third-party header behind it.
echo "== the installed headers, all in one translation unit"
probe=$work_dir/headers_probe.cc
(cd "$prefix/include" && for h in refit/*.h; do
   [[ $h == refit/status_format.h ]] || echo "#include \"$h\""
 done) > "$probe"
"$cxx" -std=c++20 -fsyntax-only -I"$prefix/include" -MD -MF "$work_dir/headers_probe.d" "$probe" \
  || { echo "FAIL: the installed headers do not compile together" >&2; exit 1; }
third_party=$(tr ' ' '\n' < "$work_dir/headers_probe.d" |
  grep -E '/(fmt|spdlog|nlohmann|zmq|zstd|hwy|yaml-cpp|pugixml|httplib|curl|openssl|prometheus|xxhash)' || true)
if [[ -n $third_party ]]; then
  echo "FAIL: the installed headers pull in third-party headers:" >&2
  echo "$third_party" >&2
  exit 1
fi
echo "$(grep -c '^#include' "$probe") headers: standard library only"
# The installed headers are the API and nothing else: every one of them is refit/api.h or reached
# from it (the facades and the types they use), but refit/status_format.h (opt-in, above). A
# header installed beside them that the API does not use is an internal that belongs in src/.
echo '#include "refit/api.h"' > "$work_dir/api_probe.cc"
"$cxx" -std=c++20 -fsyntax-only -DREFIT_HAVE_MPI=1 -I"$prefix/include" -MD \
  -MF "$work_dir/api_probe.d" "$work_dir/api_probe.cc" \
  || { echo "FAIL: refit/api.h does not compile on its own" >&2; exit 1; }
reached=$(tr ' ' '\n' < "$work_dir/api_probe.d" | grep -o 'refit/[a-z_0-9]*\.h$' | sort -u)
installed=$(cd "$prefix/include" && ls refit/*.h | grep -v '^refit/status_format\.h$' | sort -u)
outside=$(comm -13 <(echo "$reached") <(echo "$installed"))
if [[ -n $outside ]]; then
  echo "FAIL: installed, but not part of the API that refit/api.h includes:" >&2
  echo "$outside" >&2
  exit 1
fi
echo "$(echo "$installed" | wc -l) installed headers, every one reached from refit/api.h"

mkdir -p "$consumer"
cat > "$consumer/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.25)
project(refit_consumer LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
find_package(refit $version EXACT REQUIRED)
if(NOT refit_VERSION STREQUAL "$version")
  message(FATAL_ERROR "refit_VERSION is '\${refit_VERSION}', expected $version")
endif()
add_executable(consumer main.cc)
target_link_libraries(consumer PRIVATE refit::refit)
add_executable(refit_consumer refit_main.cc)
target_link_libraries(refit_consumer PRIVATE refit::refit)
CMAKE
cat > "$consumer/refit_main.cc" <<'CXX'
// The front door from outside: refit/api.h alone, a receiver holding this process's memory and a
// trainer rank refitting it over the real data and control planes on loopback. Prints
// "refit ok" and the changed count, or why not.
#include <cstdio>
#include <span>
#include <vector>
#include "refit/api.h"
int main() {
  std::vector<float> held(1000, 0.0f);
  std::vector<float> trainer(1000, 0.0f);
  refit::ReceiverNodeOptions receiver_options;
  receiver_options.data_endpoint = "127.0.0.1:0";
  auto node = refit::ReceiverNode::Make(receiver_options);
  if (!node.ok()) { std::fprintf(stderr, "%s\n", node.status().ToString().c_str()); return 1; }
  refit::Status registered = (*node)->RegisterTensor(refit::MutableTensorView{
      "w", refit::DType::kFloat32, {1000}, std::as_writable_bytes(std::span<float>(held))});
  refit::Status started = registered.ok() ? (*node)->Start() : registered;
  if (!started.ok()) { std::fprintf(stderr, "%s\n", started.ToString().c_str()); return 1; }
  auto group = refit::MakeInProcessGroup(1);
  if (!group.ok()) { std::fprintf(stderr, "%s\n", group.status().ToString().c_str()); return 1; }
  refit::PublisherOptions publisher_options;
  publisher_options.receivers = {{(*node)->control_url(), (*node)->producer_endpoint()}};
  auto publisher = refit::Publisher::Make(publisher_options, std::move((*group)[0]));
  if (!publisher.ok()) { std::fprintf(stderr, "%s\n", publisher.status().ToString().c_str()); return 1; }
  const auto view = [&] {
    return std::vector<refit::TensorView>{refit::TensorView{
        "w", refit::DType::kFloat32, {1000}, std::as_bytes(std::span<const float>(trainer))}};
  };
  refit::Status adopted = (*publisher)->AdoptBaseline(std::span<const refit::TensorView>(view()), 0);
  if (!adopted.ok()) { std::fprintf(stderr, "%s\n", adopted.ToString().c_str()); return 1; }
  trainer[7] = 1.5f;
  trainer[900] = -2.0f;
  auto report = (*publisher)->Sync(view());
  if (!report.ok()) { std::fprintf(stderr, "%s\n", report.status().ToString().c_str()); return 1; }
  (*node)->Stop();
  if (held != trainer || report->transfer.changed_elements != 2 || report->transfer.plan.anchor) {
    std::fprintf(stderr, "the receiver does not hold the trainer's weights\n");
    return 1;
  }
  std::printf("refit ok: %llu changed\n",
              static_cast<unsigned long long>(report->transfer.changed_elements));
  return 0;
}
CXX
cat > "$consumer/main.cc" <<'CXX'
// Prints refit::VersionString() and nothing else on stdout; checks a few real API calls.
#include <cstdio>
#include <string>

#include "refit/dtype.h"
#include "refit/producer_group.h"
#include "refit/version.h"
#ifdef REFIT_HAVE_MPI
#include "refit/mpi_producer_group.h"
#endif

int main() {
  static_assert(refit::Version().major == REFIT_VERSION_MAJOR);
  auto dtype = refit::ParseDType("bf16");
  if (!dtype.ok() || refit::DTypeName(*dtype) != "bfloat16" || refit::DTypeSize(*dtype) != 2) {
    std::fprintf(stderr, "ParseDType(\"bf16\") went wrong\n");
    return 1;
  }
  // The top layer (refit_node) and so every archive below it.
  auto group = refit::MakeInProcessGroup(2);
  if (!group.ok() || group->size() != 2) {
    std::fprintf(stderr, "MakeInProcessGroup(2) went wrong\n");
    return 1;
  }
#ifdef REFIT_HAVE_MPI
  // Pulls in the MPI group's object file, so its (private) MPI dependency must link.
  using MakeMpi = decltype(&refit::MakeMpiGroup);
  volatile MakeMpi make_mpi = &refit::MakeMpiGroup;
  if (make_mpi == nullptr) return 1;
#endif
  auto v = refit::Version();
  std::string joined = std::to_string(v.major) + "." + std::to_string(v.minor) + "." +
                       std::to_string(v.patch);
  if (joined != refit::VersionString()) {
    std::fprintf(stderr, "Version() %s != VersionString()\n", joined.c_str());
    return 1;
  }
  std::printf("%s\n", std::string(refit::VersionString()).c_str());
  return 0;
}
CXX

echo "== CMake consumer: find_package(refit), refit::refit"
generator=()
if command -v ninja > /dev/null; then generator=(-G Ninja); fi
# A clean environment for the consumer: only the prefix, nothing from this build's cache.
"$cmake" -S "$consumer" -B "$consumer/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" > "$work_dir/consumer-configure.log" \
  || { cat "$work_dir/consumer-configure.log" >&2; exit 1; }
"$cmake" --build "$consumer/build" > "$work_dir/consumer-build.log" \
  || { cat "$work_dir/consumer-build.log" >&2; exit 1; }
out=$("$consumer/build/consumer")
echo "consumer (CMake) printed: $out"
[[ $out == "$version" ]] || { echo "FAIL: expected '$version'" >&2; exit 1; }
out=$("$consumer/build/refit_consumer")
echo "refit_consumer (refit/api.h, CMake) printed: $out"
[[ $out == "refit ok: 2 changed" ]] || { echo "FAIL: expected 'refit ok: 2 changed'" >&2; exit 1; }

echo "== pkg-config consumer: refit.pc"
export PKG_CONFIG_PATH=$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
pc_version=$(pkg-config --modversion refit)
[[ $pc_version == "$version" ]] || { echo "FAIL: pkg-config --modversion refit: '$pc_version'" >&2; exit 1; }
flags=$(pkg-config --cflags --libs refit)
echo "pkg-config --cflags --libs refit: $flags"
# shellcheck disable=SC2086  # the flags are meant to be split
"$cxx" -std=c++20 -o "$work_dir/consumer-pc" "$consumer/main.cc" $flags \
  || { echo "FAIL: building against pkg-config's flags" >&2; exit 1; }
out=$("$work_dir/consumer-pc")
echo "consumer (pkg-config) printed: $out"
[[ $out == "$version" ]] || { echo "FAIL: expected '$version'" >&2; exit 1; }

echo "PASS"
