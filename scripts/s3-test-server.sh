#!/usr/bin/env bash
# Real S3 server for refit's s3:// integration tests and benchmarks: a single-node Ceph cluster
# (one monitor, one OSD, one RADOS Gateway) from Debian 12's Ceph 16.2 packages, bound to
# loopback only.
#
#   scripts/s3-test-server.sh start    install packages if missing, start, wait until healthy
#   scripts/s3-test-server.sh stop     stop rgw, osd, mon (in that order) and remove ROOT
#   scripts/s3-test-server.sh status   exit 0 and print the endpoint if healthy
#   scripts/s3-test-server.sh env      print export lines: eval "$(scripts/s3-test-server.sh env)"
#
# Why Ceph RGW: it is a production S3 implementation and strict about SigV4, payload hashes and
# multipart rules, so a client that passes against it is not relying on a lenient test double.
# Debian 12 ships no MinIO/SeaweedFS/Garage.
#
# Why these settings:
#   - No cephx (auth none) and no mgr: nothing to provision, and the cluster still reports
#     HEALTH_OK. The only credentials are the S3 keys TESTACCESSKEY / TESTSECRETKEY. Without a
#     mgr, commands that need one ("ceph df", "ceph osd df") hang: wrap them in timeout.
#   - memstore OSD: objects live in the OSD's RAM, nothing is written to disk and teardown is
#     instant. The cost is memory: the OSD's RSS grows with the data stored, up to
#     S3_SERVER_MEMSTORE_BYTES (default 4 GiB) plus overhead; idle, the three daemons use about
#     130 MB RSS together. Past the cap the OSD marks itself full and, as Ceph is designed to,
#     writes then block (the client sees a timeout, not an error): raise the cap for large
#     benchmarks. Data does not survive stop.
#   - RGW garbage collection every 5 s with no grace period: a deleted object's data is otherwise
#     kept for 2 hours, and a benchmark that uploads and deletes a few GiB fills the memstore,
#     after which every write blocks.
#   - Pool size 1 and small PG counts: one OSD cannot hold replicas, and the default PG count
#     would exceed the per-OSD limit once RGW creates its half-dozen pools.
#   - "mon data avail crit = 0": otherwise the monitor shuts itself down when the disk holding
#     ROOT has under 5% free, which looks like a random test failure.
#   - Every path (config, data, pid files, admin sockets, daemon and cluster logs) is under ROOT
#     and every command gets "-c ROOT/ceph.conf", so /etc/ceph, /var/run/ceph and /var/log/ceph
#     are not touched (checked with strace).
#
# Ports (all bound to 127.0.0.1): S3_SERVER_MON_PORT (mon, default 6789), the first free ones
# from 6800-7300 (OSD, Ceph's default range) and S3_SERVER_PORT (RGW, default 7480). A second
# server (another ROOT) can run beside the first given other values for both named ports.
#
# Environment: S3_SERVER_ROOT (default /tmp/refit-s3-server), S3_SERVER_PORT (default 7480),
# S3_SERVER_MON_PORT (default 6789), S3_SERVER_MEMSTORE_BYTES (default 4294967296).
set -euo pipefail

ROOT=${S3_SERVER_ROOT:-/tmp/refit-s3-server}
PORT=${S3_SERVER_PORT:-7480}
MON_PORT=${S3_SERVER_MON_PORT:-6789}
# 4 GiB: room for multi-GiB benchmark objects while leaving most of a 24 GiB machine free; the
# RAM is only taken as data is stored.
MEMSTORE_BYTES=${S3_SERVER_MEMSTORE_BYTES:-4294967296}
for port in "$PORT" "$MON_PORT"; do
  [[ "$port" =~ ^[0-9]+$ ]] || {
    echo "s3-test-server: port '${port}' (S3_SERVER_PORT / S3_SERVER_MON_PORT) is not a number" >&2
    exit 2
  }
done
[[ "$MEMSTORE_BYTES" =~ ^[0-9]+$ ]] || {
  echo "s3-test-server: S3_SERVER_MEMSTORE_BYTES '${MEMSTORE_BYTES}' is not a byte count" >&2
  exit 2
}
readonly ROOT PORT MON_PORT MEMSTORE_BYTES
readonly ACCESS_KEY=TESTACCESSKEY
readonly SECRET_KEY=TESTSECRETKEY
readonly REGION=us-east-1
readonly ENDPOINT="http://127.0.0.1:${PORT}"
# Written into ROOT by start; stop refuses to delete a directory without it, so a mistyped
# S3_SERVER_ROOT can never remove someone else's files.
readonly MARKER="${ROOT}/.refit-s3-test-server"
readonly CONF="${ROOT}/ceph.conf"

# Bounded waits, in 0.1 s steps. RGW creates its pools on first start, which takes about a
# second here; 60 s leaves ample room on a loaded CI machine without hanging a test run forever.
readonly WAIT_STEPS=600
# Per-command limit for the ceph / radosgw-admin CLIs, which otherwise retry a dead mon forever.
readonly CLI_TIMEOUT_S=30
# SIGTERM grace before SIGKILL: the memstore OSD can take over 5 s to exit cleanly, and its data
# is thrown away anyway.
readonly STOP_GRACE_STEPS=30

packages=(ceph-mon ceph-osd radosgw ceph-common uuid-runtime curl)

log() { echo "s3-test-server: $*" >&2; }

die() {
  log "error: $*"
  exit 1
}

# Prints the last lines of ROOT/log/NAME.log to stderr, for an error report.
show_log() {
  local f="${ROOT}/log/$1.log"
  if [ -s "$f" ]; then
    log "last lines of ${f}:"
    tail -n 20 "$f" >&2
  else
    log "(no log at ${f})"
  fi
}

install_packages() {
  local missing=() p
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Wait for the dpkg lock instead of failing when another install (setup.sh, a colleague) runs.
  $sudo apt-get -o DPkg::Lock::Timeout=300 update -qq ||
    die "apt-get update failed"
  $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
}

# True while PID runs. A zombie counts as gone: its ports are already closed, and in a container
# whose init reaps late it would otherwise hold up stop for the whole grace period.
alive() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$state" ] && [ "$state" != Z ]
}

# Prints the pid recorded in ROOT/run/NAME.pid if that process is alive and is the expected
# daemon (a recycled pid must never be killed).
live_pid() {
  local name=$1 comm=$2 f="${ROOT}/run/$1.pid" pid
  [ -r "$f" ] || return 1
  pid=$(tr -dc '0-9' <"$f")
  [ -n "$pid" ] || return 1
  [ "$(cat "/proc/${pid}/comm" 2>/dev/null)" = "$comm" ] || return 1
  alive "$pid" || return 1
  echo "$pid"
}

# Daemon names and their process names, in stop order. The OSD id is always 0 because start
# creates exactly one OSD in a fresh cluster.
# Created at start for the README's example; tests make their own buckets.
readonly DEFAULT_BUCKET=refit
readonly DAEMONS=("client.rgw:radosgw" "osd.0:ceph-osd" "mon.a:ceph-mon")

# A signed ListBuckets request: 200 only when RGW is up, reaches RADOS and knows the test user.
signed_request_ok() {
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 \
    --aws-sigv4 "aws:amz:${REGION}:s3" --user "${ACCESS_KEY}:${SECRET_KEY}" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "${ENDPOINT}/" 2>/dev/null) || return 1
  [ "$code" = 200 ]
}

is_healthy() {
  [ -f "$MARKER" ] || return 1
  [ "$(cat "$MARKER")" = "port=${PORT} mon_port=${MON_PORT}" ] || return 1
  local entry
  for entry in "${DAEMONS[@]}"; do
    live_pid "${entry%%:*}" "${entry##*:}" >/dev/null || return 1
  done
  signed_request_ok
}

# Stops whatever daemons ROOT's pid files name, then removes ROOT (unless keep_root=1).
stop_daemons() {
  local keep_root=${1:-0} entry name comm pid i
  for entry in "${DAEMONS[@]}"; do
    name=${entry%%:*}
    comm=${entry##*:}
    pid=$(live_pid "$name" "$comm") || continue
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < STOP_GRACE_STEPS; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
      # Wait for the kernel to reap it so the ports are free for an immediate restart.
      for ((i = 0; i < STOP_GRACE_STEPS; i++)); do
        alive "$pid" || break
        sleep 0.1
      done
    fi
  done
  if [ "$keep_root" != 1 ] && [ -d "$ROOT" ]; then
    [ -f "$MARKER" ] || die "${ROOT} exists but was not created by this script; not removing it"
    rm -rf "$ROOT"
  fi
}

port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Stops the partly started cluster but keeps ROOT so the logs named in the message can be read;
# the next start cleans it up.
fail_start() {
  local what=$1 logname=$2
  log "error: ${what}"
  show_log "$logname"
  stop_daemons 1
  log "daemons stopped; logs kept under ${ROOT}/log (removed by the next start or stop)"
  exit 1
}

write_conf() {
  local fsid=$1
  # \$name is expanded by Ceph, per daemon or client (mon.a, osd.0, client.rgw, client.admin).
  cat >"$CONF" <<EOC
[global]
fsid = ${fsid}
mon host = v1:127.0.0.1:${MON_PORT}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 0
mon warn on msgr2 not enabled = false
mon warn on insecure global id reclaim allowed = false
osd crush chooseleaf type = 0
run dir = ${ROOT}/run
admin socket = ${ROOT}/run/\$name.\$pid.asok
log file = ${ROOT}/log/\$name.log
pid file = ${ROOT}/run/\$name.pid
keyring = ${ROOT}/keyring
[mon]
mon data = ${ROOT}/mon
mon cluster log file = ${ROOT}/log/cluster.log
# The default 1 s batching of map updates makes every pool RGW creates (at start-up and on the
# first bucket, object and multipart upload) cost about 2 s; 50 ms cuts a cold start from ~11 s
# to ~2 s and the first requests from ~2 s to ~0.2 s. Harmless at this cluster's update rate.
paxos propose interval = 0.05
[osd]
osd data = ${ROOT}/osd0
osd objectstore = memstore
# Start-up CRUSH updates off: with auth none the OSD sends them before its first monmap arrives,
# so they carry fsid 00000000-... and the mon rejects them ("wrong fsid"), killing the OSD in
# about one start in five. start places the OSD with "ceph osd crush add" instead.
osd class update on start = false
osd crush update on start = false
memstore device bytes = ${MEMSTORE_BYTES}
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:${PORT}
rgw data = ${ROOT}/rgw
rgw dns name = localhost
rgw thread pool size = 64
rgw gc obj min wait = 0
rgw gc processor period = 5
rgw gc processor max time = 5
EOC
}

# Runs a ceph CLI with the cluster's config and a time limit.
ceph_cli() {
  timeout "$CLI_TIMEOUT_S" "$@" -c "$CONF"
}

start() {
  install_packages
  if is_healthy; then
    log "already running at ${ENDPOINT} (ROOT ${ROOT})"
    return 0
  fi
  if [ -e "$ROOT" ]; then
    log "cleaning up stale server state in ${ROOT}"
    stop_daemons
  fi
  port_in_use "$MON_PORT" &&
    die "port ${MON_PORT} (ceph mon) is already in use; another Ceph cluster is running" \
      "(set S3_SERVER_MON_PORT to run beside it)"
  port_in_use "$PORT" && die "port ${PORT} (S3 endpoint) is already in use"

  mkdir -p "$ROOT"/{mon,osd0,run,log,rgw}
  echo "port=${PORT} mon_port=${MON_PORT}" >"$MARKER"
  write_conf "$(uuidgen)"

  ceph-authtool --create-keyring "${ROOT}/keyring" --gen-key -n mon. --cap mon 'allow *' \
    >/dev/null || die "ceph-authtool failed to create ${ROOT}/keyring"
  ceph-authtool "${ROOT}/keyring" --gen-key -n client.admin --cap mon 'allow *' \
    --cap osd 'allow *' --cap mgr 'allow *' >/dev/null ||
    die "ceph-authtool failed to add client.admin to ${ROOT}/keyring"
  local fsid
  fsid=$(sed -n 's/^fsid = //p' "$CONF")
  monmaptool --create --addv a "v1:127.0.0.1:${MON_PORT}" --fsid "$fsid" "${ROOT}/monmap" \
    >/dev/null || die "monmaptool failed to create ${ROOT}/monmap"

  ceph-mon --mkfs -i a --monmap "${ROOT}/monmap" --keyring "${ROOT}/keyring" -c "$CONF" \
    >"${ROOT}/log/mkfs-mon.log" 2>&1 || fail_start "ceph-mon --mkfs failed" mkfs-mon
  # The daemons fork into the background once initialised.
  ceph-mon -i a -c "$CONF" >>"${ROOT}/log/mon.a.log" 2>&1 || fail_start "ceph-mon did not start" mon.a
  log "mon started on 127.0.0.1:${MON_PORT}"

  # Register the OSD under its own uuid, as ceph-volume does, so its superblock carries a real
  # identity rather than 00000000-...
  local osd_uuid osd_id
  osd_uuid=$(uuidgen)
  osd_id=$(ceph_cli ceph osd create "$osd_uuid" 2>>"${ROOT}/log/client.admin.log") ||
    fail_start "'ceph osd create' failed (mon not answering?)" mon.a
  [ "$osd_id" = 0 ] || fail_start "'ceph osd create' returned id '${osd_id}', expected 0" mon.a
  ceph_cli ceph osd crush add osd.0 1.0 root=default host=localhost \
    >/dev/null 2>>"${ROOT}/log/client.admin.log" ||
    fail_start "'ceph osd crush add osd.0' failed" client.admin
  ceph-osd -i 0 --mkfs --osd-uuid "$osd_uuid" -c "$CONF" >"${ROOT}/log/mkfs-osd.log" 2>&1 ||
    fail_start "ceph-osd --mkfs failed" mkfs-osd
  ceph-osd -i 0 -c "$CONF" >>"${ROOT}/log/osd.0.log" 2>&1 || fail_start "ceph-osd did not start" osd.0
  log "memstore osd started (cap ${MEMSTORE_BYTES} bytes)"

  radosgw -n client.rgw -c "$CONF" >>"${ROOT}/log/client.rgw.log" 2>&1 ||
    fail_start "radosgw did not start" client.rgw
  local i
  for ((i = 0; i < WAIT_STEPS; i++)); do
    curl -s -o /dev/null --max-time 2 "${ENDPOINT}/" && break
    # radosgw writes its pid file a moment after forking; only a written one proves it exited.
    if [ -s "${ROOT}/run/client.rgw.pid" ] && ! live_pid client.rgw radosgw >/dev/null; then
      fail_start "radosgw exited during startup" client.rgw
    fi
    sleep 0.1
  done
  ((i < WAIT_STEPS)) || fail_start "radosgw did not answer on ${ENDPOINT} within 60 s" client.rgw
  log "radosgw answering on ${ENDPOINT}"

  ceph_cli radosgw-admin user create --uid=test --display-name=test \
    --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" \
    >/dev/null 2>>"${ROOT}/log/client.admin.log" ||
    fail_start "radosgw-admin user create failed" client.admin
  for ((i = 0; i < WAIT_STEPS; i++)); do
    signed_request_ok && break
    sleep 0.1
  done
  ((i < WAIT_STEPS)) ||
    fail_start "a signed request to ${ENDPOINT} still fails after creating the user" client.rgw
  # The bucket the README's example uses, so that a copy-paste run needs no S3 tool.
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 -X PUT \
    --aws-sigv4 "aws:amz:${REGION}:s3" --user "${ACCESS_KEY}:${SECRET_KEY}" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "${ENDPOINT}/${DEFAULT_BUCKET}") || code=000
  [ "$code" = 200 ] || fail_start "creating bucket ${DEFAULT_BUCKET} answered HTTP ${code}" client.rgw
  log "ready: ${ENDPOINT} (access key ${ACCESS_KEY}, bucket ${DEFAULT_BUCKET})"
}

stop() {
  if [ ! -e "$ROOT" ]; then
    log "not running (no ${ROOT})"
    return 0
  fi
  stop_daemons
  log "stopped; removed ${ROOT}"
}

status() {
  if is_healthy; then
    echo "$ENDPOINT"
    return 0
  fi
  log "not running (or unhealthy) at ${ENDPOINT} (ROOT ${ROOT})"
  return 1
}

print_env() {
  echo "export REFIT_TEST_S3_ENDPOINT=${ENDPOINT}"
  echo "export AWS_ACCESS_KEY_ID=${ACCESS_KEY}"
  echo "export AWS_SECRET_ACCESS_KEY=${SECRET_KEY}"
  echo "export AWS_REGION=${REGION}"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) print_env ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac
