#!/usr/bin/python3
"""Black-box test of the HTTP control plane with independent clients.

A fixture receiver (control_server_fixture) serves two known tensors on an ephemeral port. This
script talks to it with nothing but Python's urllib, and checks that:
  * /healthz answers without a key; every other route answers 401 without a key and 403 with a
    wrong one (Bearer and X-Refit-Api-Key both work), and a refused request changes nothing;
  * the JSON API runs a transfer (prepare -> flush -> commit), refuses a corrupt payload with
    422 DataLoss, aborts a second transfer, and reports it all in /v1/status;
  * GET /v1/tensors/{name} returns the tensor's little-endian bytes with dtype, shape and digest;
  * /metrics is valid Prometheus text exposition, as parsed by the reference client library
    (prometheus_client.parser), with every expected family and the values the activity implies.
Run with Debian's /usr/bin/python3 (it has python3-prometheus-client).
"""
import argparse
import json
import secrets
import struct
import subprocess
import sys
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

API_KEY = "integration-" + secrets.token_hex(8)
# Seconds any single request may take; the fixture answers in milliseconds.
REQUEST_TIMEOUT_S = 30
# Seconds the fixture may take to exit once its stdin closes.
EXIT_TIMEOUT_S = 30

# The families /metrics must expose (prometheus_client names counters without "_total").
EXPECTED_FAMILIES = {
    "refit_control_requests": "counter",
    "refit_transfers_committed": "counter",
    "refit_transfers_aborted": "counter",
    "refit_payloads_staged": "counter",
    "refit_payloads_duplicate": "counter",
    "refit_payloads_rejected": "counter",
    "refit_payload_bytes_received": "counter",
    "refit_transfer_apply_seconds": "histogram",
    "refit_weight_version": "gauge",
    "refit_undo_bytes": "gauge",
    "refit_queued_payloads": "gauge",
    "refit_transfer_open": "gauge",
}


class Receiver:
    """The fixture process and a tiny HTTP client for it."""

    def __init__(self, fixture):
        self.process = subprocess.Popen([fixture, "--api-key", API_KEY], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"fixture did not report its port: {line!r}")
        self.base = f"http://127.0.0.1:{int(line[1])}"

    def request(self, method, path, body=None, key=API_KEY, header="Authorization",
                content_type="application/json"):
        """Return (HTTP status, headers, body bytes); HTTP errors are returned, not raised."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if key is not None:
            req.add_header(header, f"Bearer {key}" if header == "Authorization" else key)
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def json(self, method, path, body=None, expect=200, **kwargs):
        status, _, raw = self.request(method, path, body, **kwargs)
        reply = json.loads(raw)
        check(status == expect, f"{method} {path}: HTTP {status}, expected {expect}: {reply}")
        check(reply["ok"] == (expect == 200), f"{method} {path}: 'ok' is {reply['ok']}")
        return reply

    def close(self):
        self.process.stdin.close()
        code = self.process.wait(timeout=EXIT_TIMEOUT_S)
        check(code == 0, f"fixture exited with {code}")


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def metrics(receiver):
    status, headers, raw = receiver.request("GET", "/metrics")
    check(status == 200, f"/metrics: HTTP {status}")
    check(headers["Content-Type"].startswith("text/plain; version=0.0.4"),
          f"/metrics content type {headers['Content-Type']}")
    families = {family.name: family for family in text_string_to_metric_families(raw.decode())}
    for name, kind in EXPECTED_FAMILIES.items():
        check(name in families, f"/metrics lacks family {name}: has {sorted(families)}")
        check(families[name].type == kind, f"{name} is a {families[name].type}, not a {kind}")
    return families


def value(families, family, sample, **labels):
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {sample}{labels} in {families[family].samples}")


def test_auth(receiver):
    status, _, raw = receiver.request("GET", "/healthz", key=None)
    check(status == 200 and json.loads(raw)["ok"] is True, f"/healthz without key: {status}")
    for method, path, body in [("GET", "/metrics", None), ("GET", "/v1/status", None),
                               ("GET", "/v1/tensors/model.norm.weight", None),
                               ("POST", "/v1/prepare",
                                {"transfer_id": secrets.token_hex(16), "base_version": 0}),
                               ("POST", "/v1/abort", {"transfer_id": secrets.token_hex(16)})]:
        status, headers, raw = receiver.request(method, path, body, key=None)
        check(status == 401, f"{method} {path} without key: HTTP {status}")
        check(headers["WWW-Authenticate"] == 'Bearer realm="refit"', "401 lacks a challenge")
        check(json.loads(raw)["code"] == "PermissionDenied", f"401 body {raw!r}")
        status, _, raw = receiver.request(method, path, body, key="wrong-" + API_KEY)
        check(status == 403, f"{method} {path} with a wrong key: HTTP {status}")
        check(json.loads(raw)["code"] == "PermissionDenied", f"403 body {raw!r}")
    status, _, _ = receiver.request("GET", "/v1/status", header="X-Refit-Api-Key")
    check(status == 200, f"X-Refit-Api-Key: HTTP {status}")
    reply = receiver.json("GET", "/v1/status")
    check(reply["state"] == "idle" and reply["version"] == 0,
          f"refused requests changed the state: {reply}")


def test_tensor_download(receiver):
    status, headers, raw = receiver.request("GET", "/v1/tensors/model.layers.0.weight")
    check(status == 200, f"tensor download: HTTP {status}")
    check(raw == struct.pack("<6f", 0, 1, 2, 3, 4, 5), f"tensor bytes {raw!r}")
    check(headers["X-Refit-Dtype"] == "float32", f"dtype {headers['X-Refit-Dtype']}")
    check(json.loads(headers["X-Refit-Shape"]) == [2, 3], f"shape {headers['X-Refit-Shape']}")
    check(len(headers["X-Refit-Digest"]) == 16, f"digest {headers['X-Refit-Digest']}")
    status, _, raw = receiver.request("GET", "/v1/tensors/model.missing")
    check(status == 404 and "model.missing" in json.loads(raw)["message"],
          f"unknown tensor: HTTP {status} {raw!r}")


def test_transfers(receiver):
    # An empty transfer: no tensor changed, so no payloads; it still moves the version.
    first = secrets.token_hex(16)
    reply = receiver.json("POST", "/v1/prepare",
                          {"transfer_id": first, "base_version": 0, "expected": {"total": 0}})
    check(reply["repeated"] is False and reply["implied_commit"] is None, f"prepare: {reply}")
    reply = receiver.json("POST", "/v1/flush", {"transfer_id": first, "timeout_ms": 10000})
    check(reply["target_version"] == 1 and reply["payloads"] == 0, f"flush: {reply}")
    check(sorted(reply["digests"]) == ["model.layers.0.weight", "model.norm.weight"],
          f"flush digests {reply['digests']}")
    reply = receiver.json("POST", "/v1/commit", {"transfer_id": first})
    check(reply["version"] == 1, f"commit: {reply}")

    # A corrupt payload is a NACK (DataLoss) and counted as rejected.
    second = secrets.token_hex(16)
    receiver.json("POST", "/v1/prepare", {"transfer_id": second, "base_version": 1})
    garbage = bytes(200)
    status, _, raw = receiver.request("POST", "/v1/payload", garbage,
                                      content_type="application/octet-stream")
    check(status == 422 and json.loads(raw)["code"] == "DataLoss",
          f"corrupt payload: HTTP {status} {raw!r}")
    reply = receiver.json("GET", "/v1/status")
    check(reply["state"] == "receiving" and reply["transfer_id"] == second, f"status: {reply}")
    check(reply["state_fingerprint"] is None, "fingerprint while receiving")
    receiver.json("POST", "/v1/abort", {"transfer_id": second})
    reply = receiver.json("GET", "/v1/status")
    check(reply["state"] == "idle" and reply["version"] == 1, f"status after abort: {reply}")
    check(len(reply["state_fingerprint"]) == 16, f"fingerprint {reply['state_fingerprint']}")

    # Malformed requests: 400 naming the field.
    reply = receiver.json("POST", "/v1/prepare", {"transfer_id": second}, expect=400)
    check("base_version" in reply["message"], f"missing field message: {reply['message']}")
    return len(garbage)


def test_metrics(receiver, rejected_bytes):
    families = metrics(receiver)
    check(value(families, "refit_transfers_committed", "refit_transfers_committed_total") == 1,
          "committed count")
    check(value(families, "refit_transfers_aborted", "refit_transfers_aborted_total") == 1,
          "aborted count")
    check(value(families, "refit_payloads_rejected", "refit_payloads_rejected_total") == 1,
          "rejected count")
    check(value(families, "refit_payloads_staged", "refit_payloads_staged_total") == 0,
          "staged count")
    check(value(families, "refit_payload_bytes_received",
                "refit_payload_bytes_received_total") == rejected_bytes, "payload bytes")
    check(value(families, "refit_weight_version", "refit_weight_version") == 1, "version gauge")
    check(value(families, "refit_transfer_open", "refit_transfer_open") == 0, "open gauge")
    check(value(families, "refit_transfer_apply_seconds", "refit_transfer_apply_seconds_count")
          == 1, "apply histogram count")
    requests = "refit_control_requests"
    check(value(families, requests, requests + "_total", route="/v1/commit", code="200") == 1,
          "commit request count")
    check(value(families, requests, requests + "_total", route="/metrics", code="401") == 1,
          "401 count")
    check(value(families, requests, requests + "_total", route="/metrics", code="403") == 1,
          "403 count")
    check(value(families, requests, requests + "_total", route="/v1/payload", code="422") == 1,
          "422 count")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fixture", required=True, help="path of control_server_fixture")
    args = parser.parse_args()
    receiver = Receiver(args.fixture)
    try:
        test_auth(receiver)
        test_tensor_download(receiver)
        rejected_bytes = test_transfers(receiver)
        test_metrics(receiver, rejected_bytes)
    finally:
        receiver.close()
    print("control_metrics: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
