"""What a new user meets in the first minutes of setting up a fleet from Python.

Two traps, each a regression test that failed before its fix:

- Receivers that were not told about each other (no ``peers``) were each a relay tree of their
  own; a publisher that named several of them sent every payload into one tree, so the others
  never got one and the sync waited for its flush timeout (300 s here). Later it was refused at
  once. Now every transfer's prepare names the relay tree, so receivers started independently,
  in any order, with or without a peers list, just work, and the fleet may change between syncs.
- ``api_key`` protected the control plane only; the data plane accepted anyone's payloads unless
  the transport URI carried a key of its own. One key now protects both planes.
"""

import threading
import time

import numpy as np
import pytest

import refit
from conftest import perturb


def model(rng):
    return {"w": rng.standard_normal((32, 16)).astype(np.float32), "b": np.zeros(16, np.float16)}


def copy(tensors):
    return {name: array.copy() for name, array in tensors.items()}


def serve(held, **options):
    receiver = refit.Receiver(**options)
    for name, array in held.items():
        receiver.register(name, array)
    return receiver.start()


def free_endpoints(count):
    return [f"127.0.0.1:{port}" for port in refit.free_ports(count)]


# ---- Relay trees --------------------------------------------------------------------------------


def assert_holds(helds, trainer):
    for held in helds:
        for name in trainer:
            assert held[name].tobytes() == trainer[name].tobytes(), name


def test_receivers_without_peers_sync_through_the_tree_each_prepare_names(rng):
    trainer = model(rng)
    helds = [copy(trainer) for _ in range(4)]
    # Started one by one with nothing in common: no peers, each its own data endpoint.
    receivers = [serve(held, version=0) for held in helds]
    try:
        publisher = refit.Publisher(receivers=receivers, transfer_timeout=60)
        publisher.adopt_baseline(copy(trainer), version=0)
        for step in range(1, 4):
            perturb(trainer["w"], rng)
            started = time.monotonic()
            assert publisher.sync(trainer).version == step
            # Well within the timeout: nobody waits for a payload that never comes.
            assert time.monotonic() - started < 30
            assert_holds(helds, trainer)
        # The publisher sends each payload to one root only; the others got it through relays.
        assert all(receiver.version == 3 for receiver in receivers)
        # The fleet changes between syncs: one leaves, the rest are named in another order, and
        # the next transfer's tree is that fleet's.
        receivers[1].stop()
        fleet = [receivers[3], receivers[0], receivers[2]]
        publisher.set_receivers(fleet)
        perturb(trainer["w"], rng)
        assert publisher.sync(trainer).version == 4
        assert_holds([helds[3], helds[0], helds[2]], trainer)
    finally:
        for receiver in receivers:
            receiver.stop()


def test_w_publishers_and_receivers_started_in_any_order_sync(rng):
    trainer = model(rng)
    helds = [copy(trainer) for _ in range(3)]
    receivers = [serve(held, version=0) for held in helds]
    try:
        groups = refit.in_process_group(3)
        # Rank 0 names the receivers in another order than they started in.
        named = [receivers[2], receivers[0], receivers[1]]
        publishers = [
            refit.Publisher(receivers=named if rank == 0 else None, group=group, transfer_timeout=60)
            for rank, group in enumerate(groups)
        ]
        for publisher in publishers:
            publisher.adopt_baseline(copy(trainer), version=0)
        for step in (1, 2):
            perturb(trainer["w"], rng)
            errors = [None] * 3

            def sync(rank):
                try:
                    publishers[rank].sync(trainer)
                except refit.Error as error:
                    errors[rank] = error

            threads = [threading.Thread(target=sync, args=(rank,)) for rank in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert errors == [None] * 3
            assert all(receiver.version == step for receiver in receivers)
            assert_holds(helds, trainer)
    finally:
        for receiver in receivers:
            receiver.stop()


def test_a_static_peers_list_in_another_order_than_the_publishers_still_syncs(rng):
    # Static peers are a hint now: the tree a prepare names wins.
    trainer = model(rng)
    endpoints = free_endpoints(3)
    helds = [copy(trainer) for _ in range(3)]
    receivers = [
        serve(held, version=0, data_endpoint=endpoint, peers=endpoints) for held, endpoint in zip(helds, endpoints)
    ]
    try:
        publisher = refit.Publisher(receivers=list(reversed(receivers)), transfer_timeout=60)
        publisher.adopt_baseline(copy(trainer), version=0)
        perturb(trainer["w"], rng)
        assert publisher.sync(trainer).version == 1
        assert_holds(helds, trainer)
    finally:
        for receiver in receivers:
            receiver.stop()


# ---- One key for both planes ---------------------------------------------------------------------


def test_api_key_protects_the_data_plane_too(rng):
    trainer = model(rng)
    held = copy(trainer)
    with serve(held, version=0, api_key="k1") as receiver:
        # The right control-plane key, but payloads sent with another data-plane key: before the
        # fix the receiver's data plane had no key and took them.
        intruder = refit.Publisher(receivers=[receiver], api_key="k1", transport="zmq://?api_key=guess",
                                   transfer_timeout=20)
        intruder.adopt_baseline(copy(trainer), version=0)
        changed = copy(trainer)
        perturb(changed["w"], rng)
        with pytest.raises(refit.Error):
            intruder.sync(changed)
        assert receiver.version == 0
        assert held["w"].tobytes() == trainer["w"].tobytes()

        # The same key on both, given once: the sync goes through.
        publisher = refit.Publisher(receivers=[receiver], api_key="k1", transfer_timeout=20)
        publisher.adopt_baseline(copy(trainer), version=0)
        assert publisher.sync(changed).version == 1
        assert held["w"].tobytes() == changed["w"].tobytes()


def test_a_key_on_the_data_plane_alone_is_refused(rng, monkeypatch):
    monkeypatch.setenv("REFIT_TEST_DATA_KEY", "k2")
    with pytest.raises(refit.InvalidArgument, match="data plane .* has an api key but the control plane has none"):
        refit.Receiver(transport="zmq://?api_key_env=REFIT_TEST_DATA_KEY").start()
    receiver = serve({"w": np.zeros(4, np.float32)}, api_key="k2")
    try:
        with pytest.raises(refit.InvalidArgument, match="has an api key but the control plane has none"):
            refit.Publisher(receivers=[receiver], transport="zmq://?api_key_env=REFIT_TEST_DATA_KEY")
    finally:
        receiver.stop()


def test_a_different_key_per_plane_is_an_explicit_choice(rng, monkeypatch):
    monkeypatch.setenv("REFIT_TEST_DATA_KEY", "data-key")
    trainer = model(rng)
    held = copy(trainer)
    with serve(held, version=0, api_key="control-key", transport="zmq://?api_key_env=REFIT_TEST_DATA_KEY") as receiver:
        publisher = refit.Publisher(receivers=[receiver], api_key="control-key",
                                    transport="zmq://?api_key_env=REFIT_TEST_DATA_KEY", transfer_timeout=20)
        publisher.adopt_baseline(copy(trainer), version=0)
        perturb(trainer["w"], rng)
        assert publisher.sync(trainer).version == 1
        assert held["w"].tobytes() == trainer["w"].tobytes()


# ---- Stragglers and quorum ------------------------------------------------------------------------


def test_a_quorum_fences_a_receiver_that_is_gone_and_commits_on_the_others(rng):
    trainer = model(rng)
    helds = [copy(trainer) for _ in range(3)]
    receivers = [serve(held, version=0) for held in helds]
    try:
        publisher = refit.Publisher(receivers=receivers, transfer_timeout=30, commit_policy="quorum:2")
        publisher.adopt_baseline(copy(trainer), version=0)
        perturb(trainer["w"], rng)
        report = publisher.sync(trainer)
        assert report.version == 1 and report.fenced == ()
        assert all(not entry["fenced"] for entry in report.catch_ups)
        before = copy(helds[1])
        gone = receivers[1].control_url
        receivers[1].stop()
        perturb(trainer["w"], rng)
        report = publisher.sync(trainer)
        # 2 of 3 replicas answered: the sync commits on them, the one that is gone is fenced.
        assert report.version == 2
        assert report.fenced == (gone,)
        fenced = [entry for entry in report.catch_ups if entry["fenced"]]
        assert [entry["name"] for entry in fenced] == [gone]
        assert "status" in fenced[0]["fenced_because"]
        assert_holds([helds[0], helds[2]], trainer)
        assert all(helds[1][name].tobytes() == before[name].tobytes() for name in before)
        assert publisher.version == 2
    finally:
        for receiver in receivers:
            receiver.stop()


def test_a_bad_commit_policy_is_refused_naming_the_keyword():
    for bad in ("most", "quorum:0", "quorum:1.5"):
        with pytest.raises(refit.InvalidArgument, match=r"Publisher\(commit_policy=\).*quorum"):
            refit.Publisher(receivers=[("http://127.0.0.1:1", "127.0.0.1:2")], commit_policy=bad)
