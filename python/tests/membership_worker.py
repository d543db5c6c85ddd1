"""One inference worker of the membership test, in a process of its own: it holds the trainer's
step-0 weights (the same seeded model), starts a receiver on free ports, prints one JSON line
with its endpoints, optionally joins a publisher itself (``--join URL``, the Python call), and
serves until its stdin closes (or it is killed)."""

import argparse
import json
import os
import sys

import numpy as np

import refit


def step0_model(seed):
    rng = np.random.default_rng(seed)
    return {
        "layers.0.w": rng.standard_normal((64, 48)).astype(np.float32),
        "layers.1.w": rng.standard_normal((48, 32)).astype(np.float16),
        "bias": np.zeros(32, np.float32),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--join", default="")
    args = parser.parse_args()
    receiver = refit.Receiver(version=0, api_key=os.environ["REFIT_MEMBERSHIP_TEST_KEY"])
    held = step0_model(args.seed)
    for name, array in held.items():
        receiver.register(name, array)
    receiver.start()
    line = {"control": receiver.control_url, "data": receiver.producer_endpoint}
    if args.join:
        line["joined"] = receiver.join(args.join)["fleet_version"]
    print(json.dumps(line), flush=True)
    sys.stdin.read()  # until the test closes stdin
    receiver.stop()


if __name__ == "__main__":
    main()
