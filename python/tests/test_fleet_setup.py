"""What a new user meets in the first minutes of setting up a fleet from Python.

Two traps, each a regression test that failed before its fix:

- Receivers that were not told about each other (no ``peers``) are each a relay tree of their
  own; a publisher that names several of them used to send every payload into one tree, so the
  others never got one and the sync waited for its flush timeout (300 s here). It is refused
  now before anything is sent, with an error that says what to do.
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


def test_receivers_without_peers_are_refused_at_once_before_anything_is_sent(rng):
    trainer = model(rng)
    helds = [copy(trainer), copy(trainer)]
    receivers = [serve(held, version=0) for held in helds]
    try:
        publisher = refit.Publisher(receivers=receivers, transfer_timeout=300)
        publisher.adopt_baseline(copy(trainer), version=0)
        perturb(trainer["w"], rng)
        started = time.monotonic()
        with pytest.raises(refit.FailedPrecondition, match="relay tree of 1 receiver.*same peers list"):
            publisher.sync(trainer)
        # At once: not after the 300 s transfer timeout (nor any lease).
        assert time.monotonic() - started < 30
        for receiver, held in zip(receivers, helds):
            status = receiver.status()
            assert status.version == 0 and status.state == "idle" and status.transfer_id is None
            assert held["w"].tobytes() != trainer["w"].tobytes()
    finally:
        for receiver in receivers:
            receiver.stop()


def test_w_publishers_with_receivers_outside_their_tree_are_refused_on_every_rank(rng):
    trainer = model(rng)
    helds = [copy(trainer), copy(trainer)]
    receivers = [serve(held, version=0) for held in helds]
    try:
        groups = refit.in_process_group(3)
        publishers = [
            refit.Publisher(receivers=receivers if rank == 0 else None, group=group, transfer_timeout=300)
            for rank, group in enumerate(groups)
        ]
        for publisher in publishers:
            publisher.adopt_baseline(copy(trainer), version=0)
        perturb(trainer["w"], rng)
        errors = [None] * 3

        def sync(rank):
            try:
                publishers[rank].sync(trainer)
            except refit.Error as error:
                errors[rank] = error

        started = time.monotonic()
        threads = [threading.Thread(target=sync, args=(rank,)) for rank in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert time.monotonic() - started < 30
        assert all(error is not None for error in errors), errors
        assert isinstance(errors[0], refit.FailedPrecondition) and "peers" in str(errors[0])
        assert all(receiver.version == 0 for receiver in receivers)
    finally:
        for receiver in receivers:
            receiver.stop()


def test_receivers_in_another_order_than_the_publishers_are_refused(rng):
    trainer = model(rng)
    endpoints = free_endpoints(2)
    helds = [copy(trainer), copy(trainer)]
    receivers = [
        serve(held, version=0, data_endpoint=endpoint, peers=endpoints) for held, endpoint in zip(helds, endpoints)
    ]
    try:
        publisher = refit.Publisher(receivers=list(reversed(receivers)), transfer_timeout=300)
        publisher.adopt_baseline(copy(trainer), version=0)
        with pytest.raises(refit.FailedPrecondition, match="is relay 1 of its tree, but this publisher names it receiver 0"):
            publisher.sync(trainer)
        # Named in tree order, the same fleet syncs.
        publisher.set_receivers(receivers)
        perturb(trainer["w"], rng)
        assert publisher.sync(trainer).version == 1
        for held in helds:
            assert held["w"].tobytes() == trainer["w"].tobytes()
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
