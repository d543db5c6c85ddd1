"""Admission and visibility of an elastic fleet, with real processes and sockets.

A Publisher serves a membership endpoint; inference workers are separate processes
(membership_worker.py) and one embedded receiver. Each joins with one call — its own Python
``Receiver.join``, its control plane's ``POST /v1/join``, or ``refit join`` — and leaves the same
way or by dying. Asserted, from the receivers' own byte counters and ``GET /ready``:

- an unauthenticated (or wrongly keyed) join is refused with a clear error;
- a worker that has not joined, or joined behind the fleet, is not ready (503, with the reason);
  one whose transfer is open is not ready; every member is ready after its catch-up;
- a worker that joins between syncs at the step-0 checkpoint is caught up on its own — folded
  deltas within the producers' history, an anchor for it alone beyond it (a `refit serve --join`
  daemon 10 versions behind) — while the current members receive exactly the fleet's delta;
- one that leaves is out of the next sync and says "left"; one killed is left out while
  unreachable and dropped after ``drop_after_missed_syncs`` syncs, reported in the SyncReport;
- ``refit status`` (a receiver, and ``--members`` at the publisher), ``/metrics`` on both ends and
  the SyncReport show each member's version, lag, how it caught up and its bytes.
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import refit
from conftest import perturb

KEY = "membership-" + secrets.token_hex(8)
os.environ["REFIT_MEMBERSHIP_TEST_KEY"] = KEY
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from membership_worker import step0_model  # noqa: E402

SEED = 7
REQUEST_TIMEOUT_S = 30


def refit_cli():
    path = os.environ.get("REFIT_CLI") or str(HERE.parents[1] / "build" / "dev" / "src" / "apps" / "refit")
    assert os.path.exists(path), f"the refit CLI is not at {path} (set REFIT_CLI)"
    return path


def http(method, url, body=None, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            raw = reply.read()
            status = reply.status
    except urllib.error.HTTPError as error:
        raw = error.read()
        status = error.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def received_bytes(control):
    status, body = http("GET", control + "/v1/status")
    assert status == 200, body
    return body["received_bytes"]


def tensor_bytes(control, name):
    status, body = None, None
    request = urllib.request.Request(
        control + "/v1/tensors/" + urllib.parse.quote(name, safe=""), headers={"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        return reply.read()


def assert_holds(control, trainer):
    for name, array in trainer.items():
        assert tensor_bytes(control, name) == array.tobytes(), f"{control}: {name}"


class Worker:
    def __init__(self, join=""):
        command = [sys.executable, str(HERE / "membership_worker.py"), "--seed", str(SEED)]
        if join:
            command += ["--join", join]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line, f"worker exited with {self.process.wait()} before it started"
        endpoints = json.loads(line)
        self.control, self.data = endpoints["control"], endpoints["data"]
        self.joined_at = endpoints.get("joined")

    def stop(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def copy(tensors):
    return {name: array.copy() for name, array in tensors.items()}


def step(trainer, rng):
    for array in trainer.values():
        if array.dtype != np.float32 or array.ndim > 1:
            perturb(array, rng, fraction=0.02)


def test_join_leave_fail_readiness_and_visibility(tmp_path):
    rng = np.random.default_rng(SEED + 1)
    trainer = step0_model(SEED)
    publisher = refit.Publisher(api_key=KEY, membership_port=0, drop_after_missed_syncs=2, transfer_timeout=60)
    publisher.adopt_baseline(copy(trainer), version=0)
    url = publisher.membership_url
    assert url.startswith("http://127.0.0.1:")

    # ---- An unauthenticated or wrongly keyed join is refused, and changes nothing. -------------
    stranger = {"control_url": "http://127.0.0.1:9", "data_endpoint": "127.0.0.1:10"}
    status, body = http("POST", url + "/v1/members/join", stranger, key=None)
    assert status == 401 and "missing API key" in body["message"], body
    status, body = http("POST", url + "/v1/members/join", stranger, key="not-the-key")
    assert status == 403 and "wrong API key" in body["message"], body
    assert publisher.membership()["members"] == []
    with pytest.raises(refit.Error, match="no members"):
        publisher.sync(trainer)

    workers = []
    embedded = None
    try:
        # ---- Joining: worker A by its own Python call, B through its control plane. -------------
        a = Worker(join=url)
        workers.append(a)
        assert a.joined_at == 0
        b = Worker()
        workers.append(b)
        status, body = http("GET", b.control + "/ready", key=None)
        assert status == 503 and body["ready_reason"] == "fleet_version_unknown", body
        status, body = http("POST", b.control + "/v1/join", {"publisher_url": url})
        assert status == 200 and body["fleet_version"] == 0, body
        status, body = http("GET", b.control + "/ready", key=None)
        assert status == 200 and body["ready"] is True, body

        # An embedded receiver, whose hook looks at its readiness while its transfer is open.
        held = step0_model(SEED)
        seen = []
        at_commit = []
        embedded = refit.Receiver(
            version=0,
            api_key=KEY,
            before_first_apply=lambda transfer_id: seen.append(embedded.status()),
            after_commit=lambda transfer_id, version: at_commit.append(embedded.status()),
        )
        for name, array in held.items():
            embedded.register(name, array)
        embedded.start()
        assert not embedded.ready and embedded.status().ready_reason == "fleet_version_unknown"
        embedded.join(url)
        assert embedded.ready
        assert len(publisher.membership()["members"]) == 3

        bytes_by_sync = []
        for version in (1, 2):
            before = {w.control: received_bytes(w.control) for w in workers}
            step(trainer, rng)
            report = publisher.sync(trainer)
            assert report.version == version and not report.anchor
            assert {c["caught_up_by"] for c in report.catch_ups} == {"delta"}
            bytes_by_sync.append({w.control: received_bytes(w.control) - before[w.control] for w in workers})
            for worker in workers:
                assert_holds(worker.control, trainer)
        assert seen and not seen[0].ready and seen[0].ready_reason == "transfer_open", seen[:1]
        # Inside the commit hook (the engine takes the new bytes) the receiver is not ready yet:
        # the fleet's version is already the new one, the version it reports not yet.
        assert [s.ready_reason for s in at_commit] and all(
            not s.ready and s.ready_reason in ("behind", "transfer_open") for s in at_commit
        ), at_commit
        assert embedded.status().ready and embedded.status().last_catch_up == "delta"
        assert all(held[name].tobytes() == trainer[name].tobytes() for name in trainer)

        # ---- A newcomer at the step-0 checkpoint joins with one call (`refit join`). -----------
        c = Worker()
        workers.append(c)
        env = dict(os.environ, MEMBERSHIP_KEY=KEY)
        joined = subprocess.run(
            [refit_cli(), "join", "--receiver", c.control, "--publisher", url, "--api-key-env", "MEMBERSHIP_KEY"],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert joined.returncode == 0, joined.stderr
        assert "fleet version 2, 4 member(s)" in joined.stdout, joined.stdout
        status, body = http("GET", c.control + "/ready", key=None)
        assert status == 503 and body["ready_reason"] == "behind" and body["fleet_version"] == 2, body

        before = {w.control: received_bytes(w.control) for w in workers}
        step(trainer, rng)
        report = publisher.sync(trainer)
        assert report.version == 3 and not report.anchor
        how = {entry["name"]: entry for entry in report.catch_ups}
        assert how[c.control]["caught_up_by"] in ("folded", "anchor"), how
        assert how[c.control]["held_version"] == 0 and how[c.control]["lag"] == 2, how
        for current in (a.control, b.control, embedded.control_url):
            assert how[current]["caught_up_by"] == "delta", how
        got = {w.control: received_bytes(w.control) - before[w.control] for w in workers}
        # The current members received exactly their route's bytes: the fleet's delta, the same
        # for each, delta-sized (within 2x of the deltas before); the newcomer its own payloads.
        assert got[a.control] == got[b.control] == how[a.control]["wire_bytes"] > 0, (got, how)
        assert got[a.control] < 2 * max(bytes_by_sync[0][a.control], bytes_by_sync[1][a.control]), (got, bytes_by_sync)
        assert got[c.control] == how[c.control]["wire_bytes"] > 0, (got, how)
        for worker in workers:
            assert_holds(worker.control, trainer)
        status, body = http("GET", c.control + "/ready", key=None)
        assert status == 200 and body["version"] == 3 and body["last_catch_up"] == how[c.control]["caught_up_by"], body

        # ---- Visibility: refit status at a receiver and at the publisher, both /metrics. --------
        shown = subprocess.run(
            [refit_cli(), "status", c.control, "--api-key-env", "MEMBERSHIP_KEY"],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert shown.returncode == 0 and "ready" in shown.stdout and "yes" in shown.stdout, shown.stdout
        fleet = subprocess.run(
            [refit_cli(), "status", url, "--members", "--api-key-env", "MEMBERSHIP_KEY"],
            capture_output=True, text=True, env=env, timeout=60,
        )
        assert fleet.returncode == 0, fleet.stderr
        assert "version 3, 4 member(s)" in fleet.stdout and how[c.control]["caught_up_by"] in fleet.stdout, fleet.stdout
        listed = json.loads(
            subprocess.run(
                [refit_cli(), "status", url, "--members", "--json", "--api-key-env", "MEMBERSHIP_KEY"],
                capture_output=True, text=True, env=env, timeout=60,
            ).stdout
        )
        by_url = {m["control_url"]: m for m in listed["members"]}
        assert by_url[c.control]["lag"] == 2 and by_url[c.control]["version"] == 3
        assert by_url[a.control]["caught_up_by"] == "delta" and by_url[a.control]["fenced"] is False
        status, metrics = http("GET", url + "/metrics")
        assert status == 200 and f'refit_member_version{{member="{c.control}"}} 3' in metrics, metrics
        status, metrics = http("GET", c.control + "/metrics")
        assert status == 200 and "refit_receiver_ready 1" in metrics and "refit_fleet_version 3" in metrics, metrics

        # ---- Leaving with one call (`refit join --leave`). ---------------------------------------
        left = subprocess.run(
            [refit_cli(), "join", "--receiver", b.control, "--leave", "--api-key-env", "MEMBERSHIP_KEY"],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert left.returncode == 0, left.stderr
        status, body = http("GET", b.control + "/ready", key=None)
        assert status == 503 and body["ready_reason"] == "left", body
        at_leave = copy(trainer)
        step(trainer, rng)
        report = publisher.sync(trainer)
        assert report.version == 4 and b.control not in report.receivers, report.receivers
        assert_holds(b.control, at_leave)

        # ---- Leaving by failing: a member killed is left out, then dropped. ----------------------
        a.process.kill()
        a.process.wait()
        step(trainer, rng)
        report = publisher.sync(trainer)
        assert report.version == 5 and a.control not in report.receivers
        assert len(report.unreachable) == 1 and report.unreachable[0].startswith(a.control), report.unreachable
        assert report.dropped == ()
        step(trainer, rng)
        report = publisher.sync(trainer)
        assert report.version == 6 and report.dropped == (a.control,), report
        assert a.control not in [m["control_url"] for m in publisher.membership()["members"]]
        assert_holds(c.control, trainer)
        assert embedded.ready and embedded.version == 6
        assert all(held[name].tobytes() == trainer[name].tobytes() for name in trainer)
    finally:
        if embedded is not None:
            embedded.stop()
        for worker in workers:
            worker.stop()


def write_safetensors(path, tensors):
    """A safetensors file straight from the format's definition: 8-byte little-endian header
    length, the JSON header, the tensors' bytes."""
    dtypes = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtypes[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


# The producers' retained history (PublisherOptions::history_versions): a newcomer further behind
# than this is caught up by an anchor of its own.
HISTORY_VERSIONS = 8


def embedded_member_at_step0():
    """A started embedded receiver holding the step-0 model at version 0 (not joined yet)."""
    receiver = refit.Receiver(version=0, api_key=KEY)
    for name, array in step0_model(SEED).items():
        receiver.register(name, array)
    receiver.start()
    return receiver


def test_a_serve_daemon_beyond_the_history_joins_on_start_is_anchored_alone_and_leaves_at_shutdown(tmp_path):
    rng = np.random.default_rng(SEED + 2)
    trainer = step0_model(SEED)
    model = tmp_path / "step0.safetensors"
    write_safetensors(model, trainer)
    publisher = refit.Publisher(api_key=KEY, membership_port=0, transfer_timeout=60)
    publisher.adopt_baseline(copy(trainer), version=0)
    current = embedded_member_at_step0()
    daemon = None
    try:
        current.join(publisher.membership_url)
        for _ in range(HISTORY_VERSIONS + 1):
            step(trainer, rng)
            publisher.sync(trainer)
        delta_before = current.status().received_bytes
        step(trainer, rng)
        publisher.sync(trainer)
        one_delta = current.status().received_bytes - delta_before

        # A worker restarted from the step-0 checkpoint, 10 versions behind, joins as it starts.
        ready_file = tmp_path / "ready.json"
        env = dict(os.environ, MEMBERSHIP_KEY=KEY)
        daemon = subprocess.Popen(
            [refit_cli(), "serve", "--model", str(model), "--version", "0", "--bind", "127.0.0.1",
             "--control-port", "0", "--api-key-env", "MEMBERSHIP_KEY", "--ready-file", str(ready_file),
             "--join", publisher.membership_url],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        lines = []
        for line in daemon.stdout:
            lines.append(line)
            if "joined the fleet of" in line:
                break
        assert any("joined the fleet of" in line for line in lines), "".join(lines) + str(daemon.poll())
        control = json.loads(ready_file.read_text())["control_url"]
        assert [m["control_url"] for m in publisher.membership()["members"]] == [current.control_url, control]
        status, body = http("GET", control + "/ready", key=None)
        assert status == 503 and body["ready_reason"] == "behind" and body["fleet_version"] == 10, body

        before = current.status().received_bytes
        step(trainer, rng)
        report = publisher.sync(trainer)
        how = {entry["name"]: entry for entry in report.catch_ups}
        assert how[control]["caught_up_by"] == "anchor" and how[control]["lag"] == 10, how
        assert how[current.control_url]["caught_up_by"] == "delta", how
        got = current.status().received_bytes - before
        # The current member got the fleet's delta only, delta-sized; the newcomer its anchor.
        assert got == how[current.control_url]["wire_bytes"] and got < 2 * one_delta, (got, one_delta, how)
        _, daemon_status = http("GET", control + "/v1/status")
        assert daemon_status["received_bytes"] == how[control]["wire_bytes"] > 4 * got, (daemon_status, how)
        assert_holds(control, trainer)
        status, body = http("GET", control + "/ready", key=None)
        assert status == 200 and body["last_catch_up"] == "anchor", body

        daemon.terminate()
        assert daemon.wait(timeout=60) == 0
        assert [m["control_url"] for m in publisher.membership()["members"]] == [current.control_url]
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        current.stop()


def test_a_member_stopped_through_a_sync_says_it_is_behind_as_soon_as_it_resumes(tmp_path):
    """A joined `refit serve` member that cannot be reached when a sync starts (SIGSTOP) is left
    out and fenced under a quorum; it never hears of that sync, so it learns that the fleet moved
    on from its publisher (server.fleet_watch_s): resumed, its /ready says "behind" at once, never
    "ready" at the version it held, and the next sync catches it up."""
    rng = np.random.default_rng(SEED + 3)
    trainer = step0_model(SEED)
    model = tmp_path / "step0.safetensors"
    write_safetensors(model, trainer)
    # A member whose status does not answer within 5 s is left out; 1 of 2 replicas commits. (Long
    # enough for a loaded CI machine's healthy members; the stop then outlasts two watch intervals.)
    publisher = refit.Publisher(api_key=KEY, membership_port=0, transfer_timeout=60, commit_policy="quorum:0.5",
                                config=refit.Config.parse("request_timeout_s: 5\n"))
    publisher.adopt_baseline(copy(trainer), version=0)
    current = embedded_member_at_step0()
    log = tmp_path / "daemon.log"
    ready_file = tmp_path / "ready.json"
    daemon = subprocess.Popen(
        [refit_cli(), "serve", "--model", str(model), "--version", "0", "--bind", "127.0.0.1",
         "--control-port", "0", "--api-key-env", "MEMBERSHIP_KEY", "--ready-file", str(ready_file),
         "--join", publisher.membership_url],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, MEMBERSHIP_KEY=KEY),
    )
    stopped = False
    try:
        current.join(publisher.membership_url)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while "joined the fleet of" not in log.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        control = json.loads(ready_file.read_text())["control_url"]
        step(trainer, rng)
        publisher.sync(trainer)
        status, body = http("GET", control + "/ready", key=None)
        assert status == 200 and body["version"] == 1, body

        daemon.send_signal(signal.SIGSTOP)
        stopped = True
        step(trainer, rng)
        report = publisher.sync(trainer)
        assert report.fenced == (control,), report
        assert current.status().version == 2
        daemon.send_signal(signal.SIGCONT)
        stopped = False
        # Every answer after it resumed: not ready, behind the fleet's version 2.
        answers = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            answers.append(http("GET", control + "/ready", key=None))
            time.sleep(0.1)
        assert all(status == 503 for status, _ in answers), answers[:3]
        status, body = answers[-1]
        assert body["ready_reason"] == "behind" and body["version"] == 1 and body["fleet_version"] == 2, body

        step(trainer, rng)
        report = publisher.sync(trainer)
        how = {entry["name"]: entry for entry in report.catch_ups}
        assert how[control]["caught_up_by"] == "folded" and how[control]["lag"] == 1, how
        assert_holds(control, trainer)
        status, body = http("GET", control + "/ready", key=None)
        assert status == 200 and body["version"] == 3, body
    finally:
        if stopped:
            daemon.send_signal(signal.SIGCONT)
        daemon.terminate()
        daemon.wait(timeout=60)
        current.stop()


def test_with_two_ranks_the_fleet_is_rank_0s_snapshot_at_each_sync(tmp_path):
    """W = 2: only rank 0 serves the membership endpoint; a member that joins between syncs is
    sent both ranks' chunks in the next sync (rank 0's begin message carries the fleet)."""
    import threading  # noqa: PLC0415

    rng = np.random.default_rng(SEED + 3)
    trainer = step0_model(SEED)
    groups = refit.in_process_group(2)
    publishers = [
        refit.Publisher(group=group, api_key=KEY, transfer_timeout=60, chunk_bytes=4096,
                        **({"membership_port": 0} if rank == 0 else {}))
        for rank, group in enumerate(groups)
    ]
    assert publishers[0].membership_url and publishers[1].membership_url == ""
    for publisher in publishers:
        publisher.adopt_baseline(copy(trainer), version=0)

    def sync_all():
        errors, reports = [None, None], [None, None]

        def run(rank):
            try:
                reports[rank] = publishers[rank].sync(trainer)
            except refit.Error as error:
                errors[rank] = error

        threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == [None, None], errors
        # Rank 1 sent its own chunks to the members rank 0 listed.
        assert reports[1].wire_bytes > 0 and reports[1].rank == 1
        return reports[0]

    helds = [step0_model(SEED), step0_model(SEED)]
    receivers = []
    try:
        for held in helds:
            receiver = refit.Receiver(version=0, api_key=KEY)
            for name, array in held.items():
                receiver.register(name, array)
            receivers.append(receiver.start())
        receivers[0].join(publishers[0].membership_url)
        step(trainer, rng)
        assert sync_all().receivers == (receivers[0].control_url,)
        receivers[1].join(publishers[0].membership_url)
        step(trainer, rng)
        report = sync_all()
        assert set(report.receivers) == {r.control_url for r in receivers}
        assert {c["name"]: c["caught_up_by"] for c in report.catch_ups}[receivers[1].control_url] in ("folded", "anchor")
        for held in helds:
            assert all(held[name].tobytes() == trainer[name].tobytes() for name in trainer)
        assert all(r.ready and r.version == 2 for r in receivers)
    finally:
        for receiver in receivers:
            receiver.stop()
