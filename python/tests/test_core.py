"""refit's core API from Python: numpy tensors, errors, groups, loaders, configuration."""

import threading

import numpy as np
import pytest

import refit
from conftest import perturb


def make_model(rng):
    return {
        "embed.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "layer.0.bias": rng.standard_normal(33).astype(np.float16),
        "odd name/with:chars.0": np.arange(5, dtype=np.int64),
        "scalar": np.array(3.5, dtype=np.float64),
    }


def held_copy(model):
    return {name: array.copy() for name, array in model.items()}


def serve(model):
    receiver = refit.Receiver()
    for name, array in model.items():
        receiver.register(name, array)
    return receiver.start()


def test_every_status_code_maps_to_its_class_and_builtin():
    assert issubclass(refit.InvalidArgument, ValueError)
    assert issubclass(refit.NotFound, KeyError)
    assert issubclass(refit.Unavailable, ConnectionError)
    assert issubclass(refit.DeadlineExceeded, TimeoutError)
    assert issubclass(refit.PermissionDenied, PermissionError)
    assert issubclass(refit.IoError, OSError)
    for cls in (refit.DataLoss, refit.FailedPrecondition, refit.Cancelled, refit.Internal):
        assert issubclass(cls, refit.Error) and issubclass(cls, RuntimeError)
    assert refit.errors.error_class("DataLoss") is refit.DataLoss
    assert refit.errors.error_class("NoSuchCode") is refit.Error


def test_sync_writes_the_registered_arrays_in_place(rng):
    trainer = make_model(rng)
    held = held_copy(trainer)
    addresses = {name: array.ctypes.data for name, array in held.items()}
    with serve(held) as receiver:
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline(held_copy(trainer), version=0)
        for step in range(1, 4):
            perturb(trainer["embed.weight"], rng)
            perturb(trainer["layer.0.bias"], rng, 0.2)
            trainer["scalar"][...] = step
            report = publisher.sync(trainer)
            assert not report.anchor and report.version == step
            assert 0 < report.changed_elements < report.total_elements
            assert receiver.version == step
            for name in trainer:
                assert held[name].tobytes() == trainer[name].tobytes(), name
                assert held[name].ctypes.data == addresses[name]


def test_the_trainers_arrays_are_handed_over_without_a_copy(rng):
    array = rng.standard_normal((8, 8)).astype(np.float32)
    name, dtype, shape, buffer = refit._tensors.as_buffer_tensor("x", array)
    assert (dtype, shape) == ("float32", [8, 8])
    assert buffer.__array_interface__["data"][0] == array.ctypes.data
    assert np.shares_memory(buffer, array)


def test_a_failed_sync_leaves_the_receiver_bit_identical(rng):
    trainer = make_model(rng)
    held = held_copy(trainer)
    with serve(held) as receiver:
        # The second payload of every transfer is lost: the first is applied, then rolled back.
        faulty = refit.Publisher(receivers=[receiver], transport="fault+zmq://?disconnect_after=1",
                                 bucket_bytes=1024, transfer_timeout=20)
        faulty.adopt_baseline(held_copy(trainer), version=0)
        before = held_copy(held)
        for name in ("embed.weight", "layer.0.bias", "odd name/with:chars.0"):
            trainer[name] += 1
        with pytest.raises(ConnectionError, match="payload"):
            faulty.sync(trainer)
        status = receiver.status()
        assert (status.state, status.version) == ("idle", 0)
        for name in held:
            assert held[name].tobytes() == before[name].tobytes(), name
        # A healthy publisher picks up from the version the receiver still holds.
        healthy = refit.Publisher(receivers=[receiver])
        healthy.adopt_baseline(before, version=0)
        received = receiver.status()
        report = healthy.sync(trainer)
        assert report.version == 1
        assert held["embed.weight"].tobytes() == trainer["embed.weight"].tobytes()
        # What the receiver was sent shows in its status: the sync's payloads, once each.
        status = receiver.status()
        assert status.received_payloads - received.received_payloads == report.payloads > 0
        assert status.received_bytes - received.received_bytes == report.wire_bytes


def test_bad_inputs_raise_the_mapped_exceptions(rng, tmp_path):
    receiver = refit.Receiver()
    array = np.zeros(4, np.float32)
    receiver.register("a", array)
    with pytest.raises(refit.AlreadyExists, match="a"):
        receiver.register("a", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="not C-contiguous"):
        receiver.register("b", np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.zeros(4, np.float32)
        frozen.flags.writeable = False
        receiver.register("c", frozen)
    with pytest.raises(refit.InvalidArgument, match="complex"):
        receiver.register("d", np.zeros(2, np.complex64))
    with pytest.raises(KeyError):
        refit.Config.load(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("delta_compression:\n  encodng: xor\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*encodng"):
        refit.Config.load(str(tmp_path / "bad.yaml"))
    with pytest.raises(refit.InvalidArgument, match="kind"):
        refit.Loader(rules=[{"kind": "diagonal", "match": "x"}])
    with pytest.raises(refit.InvalidArgument, match="colour"):
        refit.Loader(rules=[{"kind": "row", "colour": "x"}])
    receiver.stop()


def test_an_unreachable_receiver_is_a_connection_error(rng):
    publisher = refit.Publisher(receivers=[("http://127.0.0.1:9", "127.0.0.1:9")], transfer_timeout=10)
    with pytest.raises(ConnectionError, match="127.0.0.1:9"):
        publisher.sync({"w": np.zeros(4, np.float32)})


def test_a_wrong_api_key_is_a_permission_error(rng):
    held = {"w": np.zeros(4, np.float32)}
    receiver = refit.Receiver(api_key="right")
    receiver.register("w", held["w"])
    with receiver.start():
        publisher = refit.Publisher(receivers=[receiver], api_key="wrong")
        with pytest.raises(PermissionError):
            publisher.sync({"w": np.ones(4, np.float32)})
        assert held["w"].tobytes() == np.zeros(4, np.float32).tobytes()


def test_a_tensor_the_receiver_does_not_hold_fails_the_sync_and_changes_nothing(rng):
    trainer = make_model(rng)
    held = held_copy(trainer)
    with serve(held) as receiver:
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline(held_copy(trainer), version=0)
        before = held_copy(held)
        trainer["embed.weight"] += 1.0
        trainer["extra"] = np.ones(3, np.float32)
        with pytest.raises(refit.Error, match="extra"):
            publisher.sync(trainer)
        assert receiver.status().version == 0
        for name in held:
            assert held[name].tobytes() == before[name].tobytes()


def test_a_sync_that_leaves_a_tensor_out_is_refused_and_changes_nothing(rng):
    trainer = make_model(rng)
    held = held_copy(trainer)
    with serve(held) as receiver:
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline(held_copy(trainer), version=0)
        before = held_copy(held)
        trainer["embed.weight"] += 1.0
        partial = {name: array for name, array in trainer.items() if name != "layer.0.bias"}
        with pytest.raises(refit.FailedPrecondition, match="layer.0.bias"):
            publisher.sync(partial)
        assert receiver.status().version == 0
        for name in held:
            assert held[name].tobytes() == before[name].tobytes()
        # An anchor may drop the tensor; the next delta covers the smaller model.
        assert publisher.sync(partial, force_anchor=True).anchor
        trainer["embed.weight"] += 1.0
        assert not publisher.sync(partial).anchor
        assert held["embed.weight"].tobytes() == trainer["embed.weight"].tobytes()


def test_hooks_bracket_each_transfer_and_wait_for_version_times_out(rng):
    events = []
    held = {"w": np.zeros(1000, np.float32)}
    receiver = refit.Receiver(
        before_first_apply=lambda transfer: events.append(("pause", transfer)),
        after_commit=lambda transfer, version: events.append(("commit", version)),
    )
    receiver.register("w", held["w"])
    with receiver.start():
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline({"w": np.zeros(1000, np.float32)}, version=0)
        report = publisher.sync({"w": np.ones(1000, np.float32)})
        assert receiver.wait_for_version(1, timeout=5) == 1
        assert events == [("pause", report.transfer_id), ("commit", 1)]
        with pytest.raises(TimeoutError, match="version 2"):
            receiver.wait_for_version(2, timeout=0.2)


def test_w_publishers_on_threads_share_the_chunks(rng):
    trainer = {f"t{i}": rng.standard_normal(3000).astype(np.float32) for i in range(6)}
    held = held_copy(trainer)
    with serve(held) as receiver:
        groups = refit.in_process_group(3)
        publishers = [refit.Publisher(receivers=[receiver], group=g, chunk_bytes=4096) for g in groups]
        for publisher in publishers:
            publisher.adopt_baseline(held_copy(trainer), version=0)
        for name in trainer:
            perturb(trainer[name], rng, 0.05)
        reports = [None] * 3

        def run(rank):
            reports[rank] = publishers[rank].sync(trainer)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [r.rank for r in reports] == [0, 1, 2]
        assert reports[0].version == 1 and reports[0].world_size == 3
        assert sum(r.payloads for r in reports[1:]) > 0  # the other ranks sent their share
        for name in trainer:
            assert held[name].tobytes() == trainer[name].tobytes()


def test_a_tensor_parallel_receiver_copies_a_whole_peer_through_its_loader(rng):
    # A fleet of one unsharded receiver at version 2; the two ranks of a TP = 2 group join with
    # bootstrap_peer = that receiver: each copies its version through its loader (the rows it
    # holds of the embedding, the rest whole), and the next syncs are deltas for all three.
    trainer = make_model(rng)
    held = held_copy(trainer)
    with serve(held) as peer:
        publisher = refit.Publisher(receivers=[peer])
        publisher.adopt_baseline(held_copy(trainer), version=0)
        for _ in range(2):
            perturb(trainer["embed.weight"], rng)
            publisher.sync(trainer)
        def rows(array, rank):
            return array[rank * 32:(rank + 1) * 32]

        shards = []
        for rank in range(2):
            local = held_copy(make_model(np.random.default_rng(99)))  # a stale checkpoint
            local["embed.weight"] = rows(local["embed.weight"], rank).copy()
            loader = refit.Loader(tp_rank=rank, tp_size=2,
                                  rules=[{"kind": "row", "match": r"embed\.weight"}])
            receiver = refit.Receiver(loader=loader, replica="tp2", bootstrap_peer=peer.control_url)
            for name, array in local.items():
                receiver.register(name, array)
            shards.append((receiver.start(), local))
        try:
            for rank, (receiver, local) in enumerate(shards):
                # It holds the version, but serves only once a publisher told it the fleet's.
                status = receiver.status()
                assert status.version == 2 and not status.ready, status
                assert status.ready_reason == "fleet_version_unknown", status
                assert local["embed.weight"].tobytes() == rows(trainer["embed.weight"], rank).tobytes()
                for name in ("layer.0.bias", "odd name/with:chars.0", "scalar"):
                    assert local[name].tobytes() == trainer[name].tobytes(), name
            publisher.set_receivers([peer] + [receiver for receiver, _ in shards])
            perturb(trainer["embed.weight"], rng)
            report = publisher.sync(trainer)
            assert not report.anchor and report.version == 3
            assert [c["caught_up_by"] for c in report.catch_ups] == ["delta"] * 3
            for rank, (receiver, local) in enumerate(shards):
                assert local["embed.weight"].tobytes() == rows(trainer["embed.weight"], rank).tobytes()
                assert receiver.ready
        finally:
            for receiver, _ in shards:
                receiver.stop()


def test_loader_specs_round_trip_through_yaml():
    loader = refit.Loader.from_yaml(
        "tp_rank: 1\ntp_size: 2\nrules:\n  - {kind: row, match: 'a\\..*'}\n"
        "  - {kind: qkv, q: 'q', k: 'k', v: 'v', to: qkv, num_heads: 4, num_kv_heads: 2}\n"
    )
    assert (loader.tp_rank, loader.tp_size) == (1, 2)
    assert loader.rules[0] == {"kind": "row", "match": "a\\..*"}
    assert loader.rules[1]["num_kv_heads"] == 2
    assert refit.Loader(**loader.to_dict()).to_dict() == loader.to_dict()


def test_expert_loader_rules_keep_their_keys_and_refuse_bad_ones():
    rule = {"kind": "stacked_down", "match": "d", "to": "w2", "num_experts": 8, "experts": [5, 1],
            "expert_tp_rank": 0, "expert_tp_size": 1}
    loader = refit.Loader(tp_rank=1, tp_size=2, rules=[rule])
    assert loader.rules == [rule]
    assert refit.Loader(**loader.to_dict()).to_dict() == loader.to_dict()
    with pytest.raises(refit.InvalidArgument, match="expert 1 is listed twice"):
        refit.Loader(rules=[dict(rule, experts=[1, 1])])
    with pytest.raises(refit.InvalidArgument, match="expert_group"):
        refit.Loader(rules=[{"kind": "expert_down", "match": "e(\\d+)", "to": "w2"}])


def test_config_files_configure_publishers_and_receivers(tmp_path):
    path = tmp_path / "refit.yaml"
    path.write_text("delta_compression:\n  full_sync_interval: 3\n  export_chunk_bytes: 65536\n"
                    "receivers:\n  - {control: 'http://10.0.0.5:8081', data: '10.0.0.5:5555'}\n")
    config = refit.Config.load(str(path))
    assert config.full_sync_interval == 3 and config.export_chunk_bytes == 65536
    assert config.receivers == [("http://10.0.0.5:8081", "10.0.0.5:5555")]
    held = {"w": np.zeros(10, np.float32)}
    receiver = refit.Receiver(config=config)
    receiver.register("w", held["w"])
    with receiver.start():
        publisher = refit.Publisher(config=config, receivers=[receiver])
        assert publisher.sync({"w": np.ones(10, np.float32)}).anchor  # no baseline: an anchor
        assert held["w"].tobytes() == np.ones(10, np.float32).tobytes()


def test_keywords_override_the_config_and_are_checked_as_its_keys(tmp_path):
    config = refit.Config.parse("delta_compression:\n  full_sync_interval: 5\n", "trainer.yaml")
    held = {"w": np.zeros(10, np.float32)}
    with refit.Receiver(config=config) as receiver:
        receiver.register("w", held["w"])
        receiver.start()
        # full_sync_interval=1 (the keyword) wins over the file's 5: every sync is an anchor.
        publisher = refit.Publisher(config=config, receivers=[receiver], full_sync_interval=np.int64(1))
        publisher.adopt_baseline({"w": held["w"].copy()}, version=0)
        assert publisher.sync({"w": np.ones(10, np.float32)}).anchor
        assert publisher.sync({"w": np.full(10, 2, np.float32)}).anchor
        assert held["w"].tobytes() == np.full(10, 2, np.float32).tobytes()
    # A keyword's value is read as the file's key would be, and its error names both.
    with pytest.raises(refit.InvalidArgument, match=r"Receiver\(anchor_undo=\) \(server\.anchor_undo\)"):
        refit.Receiver(anchor_undo="sometimes")
    with pytest.raises(refit.InvalidArgument, match=r"Publisher\(chunk_bytes=\).*must be a positive byte size"):
        refit.Publisher(receivers=[("http://127.0.0.1:1", "127.0.0.1:2")], chunk_bytes=0)
    with pytest.raises(refit.InvalidArgument, match=r"Publisher\(receivers=\) \(receivers\[1\]\.data\): '127\.0\.0\.1:2' repeats receivers\[0\]"):
        refit.Publisher(receivers=[("http://127.0.0.1:1", "127.0.0.1:2"), ("http://127.0.0.1:3", "127.0.0.1:2")])


def test_apply_threads_apply_a_large_tensor_in_slices_bit_identically():
    rng = np.random.default_rng(3)
    base = rng.standard_normal(400_000).astype(np.float32)
    held = {"big": base.copy(), "small": np.zeros(7, np.float32)}
    with refit.Receiver(apply_threads=3, decode_threads=0) as receiver:
        for name, array in held.items():
            receiver.register(name, array)
        receiver.start()
        publisher = refit.Publisher(receivers=[receiver])
        publisher.adopt_baseline({"big": base.copy(), "small": np.zeros(7, np.float32)}, version=0)
        for step in range(1, 3):
            trainer = {"big": base.copy(), "small": np.full(7, step, np.float32)}
            changed = rng.random(base.size) < 0.5  # about 200,000 changes: several slices
            trainer["big"][changed] += np.float32(step)
            report = publisher.sync(trainer)
            assert not report.anchor and report.changed_elements >= 150_000
            assert held["big"].tobytes() == trainer["big"].tobytes()
            assert held["small"].tobytes() == trainer["small"].tobytes()
    with pytest.raises(refit.InvalidArgument, match=r"Receiver\(apply_threads=\) \(tuning\.apply_threads\): 0 is outside"):
        refit.Receiver(apply_threads=0)


def test_the_package_version_is_the_projects():
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "python" / "pyproject.toml").read_text())["project"]
    cmake = re.search(r"project\(refit VERSION ([0-9.]+)", (root / "CMakeLists.txt").read_text())
    assert refit.__version__ == project["version"] == cmake.group(1)


def test_plan_layouts_assigns_each_box_once_and_names_a_gap():
    def piece(offset, extent, **extra):
        return dict({"tensor": "w", "dtype": "bfloat16", "shape": [5, 4], "offset": offset, "extent": extent}, **extra)

    # Rank 2 is a data-parallel copy of rank 0; rank 3 holds an empty shard.
    plan = refit.plan_layouts([
        [piece([0, 0], [3, 4])], [piece([3, 0], [2, 4])], [piece([0, 0], [3, 4])], [piece([5, 0], [0, 4])],
    ])
    assert plan["roles"] == [["send"], ["send"], ["copy"], ["empty"]]
    (w,) = plan["tensors"]
    assert (w["name"], w["dtype"], w["shape"]) == ("w", "bfloat16", [5, 4])
    assert [(b["offset"], b["sender"], b["copies"]) for b in w["boxes"]] == [([0, 0], 0, [2]), ([3, 0], 1, [])]
    with pytest.raises(refit.InvalidArgument, match=r"tensor 'w' \[5, 4\].*element \[3, 0\] is held by no rank"):
        refit.plan_layouts([[piece([0, 0], [3, 4])]])
    with pytest.raises(refit.InvalidArgument, match="rank 0 piece 0: unknown key 'offsets'"):
        refit.plan_layouts([[{"tensor": "w", "offsets": [0]}]])


def test_max_payload_bytes_bounds_what_a_receiver_accepts():
    """Receiver(max_payload_bytes=) is the file's server.max_payload_bytes (and `refit serve
    --max-payload-bytes`): a payload above it never reaches the receiver (the relay refuses it by
    its declared parts, docs/protocol.md), so the sync fails and changes nothing; a size string
    works too."""
    base = np.random.default_rng(5).standard_normal(64_000).astype(np.float32)  # 256 KB, incompressible
    for limit, fits in ((64 * 1024, False), ("4MiB", True)):
        held = {"w": np.zeros_like(base)}
        with refit.Receiver(max_payload_bytes=limit) as receiver:
            receiver.register("w", held["w"])
            receiver.start()
            # One attempt, 1 s.
            publisher = refit.Publisher(receivers=[receiver], transport="zmq://?timeout_ms=1000&retries=0")
            if fits:
                assert publisher.sync({"w": base}).version == 1
                assert held["w"].tobytes() == base.tobytes()
            else:
                with pytest.raises(refit.ResourceExhausted, match="payload of .* exceeds the limit of 65536 bytes"):
                    publisher.sync({"w": base})
                assert receiver.version == 0 and not held["w"].any()
    with pytest.raises(refit.InvalidArgument, match=r"Receiver\(max_payload_bytes=\) \(server\.max_payload_bytes\)"):
        refit.Receiver(max_payload_bytes=0)
