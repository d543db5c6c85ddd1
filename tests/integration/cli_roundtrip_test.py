#!/usr/bin/python3
"""Black-box test of the `refit` CLI against an independent implementation.

Checkpoints are written and read here with numpy and a few lines of safetensors code of our own
(independent of the C++ reader/writer), so this test checks that:
  * `refit diff --json` reports the same changed counts as numpy,
  * `refit encode` + `refit apply` reproduce NEW bit-exactly for bf16, fp16, fp32 and fp8,
    for every op and with forced location encodings,
  * a corrupted or truncated payload file is refused and nothing is written.
Run with Debian's /usr/bin/python3 (it has numpy).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

# safetensors dtype code -> (numpy storage dtype of the same width, element size)
STORAGE = {
    "BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "F64": np.uint64,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "I32": np.uint32, "I64": np.uint64, "U8": np.uint8,
}


def write_safetensors(path, tensors, metadata=None):
    """tensors: list of (name, code, shape, numpy array of the storage dtype)."""
    header, offset, blobs = {}, 0, []
    for name, code, shape, array in tensors:
        blob = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = data[8 + n + begin:8 + n + end]
        out[name] = (info["dtype"], tuple(info["shape"]), np.frombuffer(raw, dtype=np.dtype(STORAGE[info["dtype"]]).newbyteorder("<")))
    return out


def realistic_pair(rng, code, shape, density):
    """Old weights ~N(0, 0.02) and new = old nudged by about one ulp at `density` of elements."""
    n = int(np.prod(shape))
    if code == "BF16":
        f = (rng.standard_normal(n) * 0.02).astype(np.float32)
        old = (f.view(np.uint32) >> 16).astype(np.uint16)
    elif code == "F16":
        old = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)
    elif code == "F32":
        old = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
    elif code == "F64":
        old = (rng.standard_normal(n) * 0.02).astype(np.float64).view(np.uint64)
    else:  # FP8 and integers: any bit pattern, including NaN encodings
        old = rng.integers(0, np.iinfo(STORAGE[code]).max, n, dtype=STORAGE[code], endpoint=True)
    new = old.copy()
    mask = rng.random(n) < density
    step = rng.choice(np.array([1, -1], dtype=np.int64), size=int(mask.sum()))
    new[mask] = (new[mask].astype(np.int64) + step).astype(old.dtype)  # +-1 ulp on the bits
    # A few special patterns: NaN payload change and +0 -> -0 (must count as changed).
    if code in ("BF16", "F16") and n > 4:
        old[0], new[0] = 0x0000, 0x8000
        old[1], new[1] = 0x7FC1 if code == "BF16" else 0x7E01, 0x7FC2 if code == "BF16" else 0x7E02
    return old, new


def run(cmd, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


class Failures:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, condition, what):
        if condition:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL: {what}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--refit", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    rng = np.random.default_rng(1234)
    results = Failures()

    codes = ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "F64", "I64"]
    for code in codes:
        old_tensors, new_tensors = [], []
        for i, (shape, density) in enumerate([((256, 64), 0.01), ((1000,), 0.05), ((17, 3), 0.5), ((8,), 0.0)]):
            old, new = realistic_pair(rng, code, shape, density)
            old_tensors.append((f"model.layers.{i}.weight", code, shape, old))
            new_tensors.append((f"model.layers.{i}.weight", code, shape, new))
        old_path = os.path.join(args.workdir, f"old_{code}.safetensors")
        new_path = os.path.join(args.workdir, f"new_{code}.safetensors")
        write_safetensors(old_path, old_tensors)
        write_safetensors(new_path, new_tensors)

        report = json.loads(run([args.refit, "diff", "--json", old_path, new_path]).stdout)
        by_name = {t["name"]: t for t in report["tensors"]}
        total_changed = 0
        for (name, _, _, old), (_, _, _, new) in zip(old_tensors, new_tensors):
            expected = int(np.count_nonzero(old != new))
            total_changed += expected
            results.check(by_name[name]["changed"] == expected,
                          f"{code} {name}: diff says {by_name[name]['changed']}, numpy {expected}")
        results.check(report["total"]["changed"] == total_changed, f"{code}: total changed")

        variants = [["--op", "xor"], ["--op", "overwrite"], ["--full"]]
        if code in ("BF16", "F16", "F32", "F64"):
            variants += [["--op", "add"], ["--op", "add", "--add-dtype", "float32"]]
        for forced in ("range", "gap16", "gap32", "gap64", "bitmask"):
            variants.append(["--force-encoding", forced])
        variants.append(["--no-byte-planes", "--bucket", "4KiB"])
        for variant in variants:
            tag = f"{code} {' '.join(variant)}"
            delta = os.path.join(args.workdir, "delta.rfp")
            out = os.path.join(args.workdir, "out.safetensors")
            if os.path.exists(out):
                os.remove(out)
            enc = run([args.refit, "encode", old_path, new_path, "-o", delta] + variant, check=False)
            if variant[:2] == ["--force-encoding", "gap16"] and enc.returncode != 0:
                # A forced width that cannot hold the largest gap must be refused with a message.
                results.check("gap16" in enc.stderr, f"{tag}: refused without naming the encoding")
                continue
            results.check(enc.returncode == 0, f"{tag}: encode failed: {enc.stderr}")
            if enc.returncode != 0:
                continue
            run([args.refit, "apply", old_path, delta, "-o", out])
            got = read_safetensors(out)
            for name, _, shape, new in new_tensors:
                results.check(got[name][1] == tuple(shape) and np.array_equal(got[name][2], new),
                              f"{tag}: {name} not bit-identical after apply")
            inspect = json.loads(run([args.refit, "inspect", "--json", delta]).stdout)
            results.check(len(inspect) >= 1 and inspect[0]["base_version"] == 0 and
                          inspect[0]["target_version"] == 1, f"{tag}: inspect header")

        # A corrupted or truncated payload file is refused and no output is written.
        delta = os.path.join(args.workdir, "delta.rfp")
        run([args.refit, "encode", old_path, new_path, "-o", delta])
        blob = bytearray(open(delta, "rb").read())
        for label, mutated in [("flipped body byte", blob[:-1] + bytes([blob[-1] ^ 0x01])),
                               ("flipped header byte", blob[:20] + bytes([blob[20] ^ 0x80]) + blob[21:]),
                               ("truncated", blob[:len(blob) // 2])]:
            bad = os.path.join(args.workdir, "bad.rfp")
            out = os.path.join(args.workdir, "bad_out.safetensors")
            with open(bad, "wb") as f:
                f.write(mutated)
            proc = run([args.refit, "apply", old_path, bad, "-o", out], check=False)
            results.check(proc.returncode != 0 and not os.path.exists(out),
                          f"{code}: {label} payload was not refused ({proc.returncode})")
            results.check(("DataLoss" in proc.stderr) or ("InvalidArgument" in proc.stderr),
                          f"{code}: {label}: error code missing in '{proc.stderr.strip()}'")

    # Simulated checkpoints: the chain step0 -> step1 -> step2 applied in sequence.
    sim_dir = os.path.join(args.workdir, "sim")
    run([args.refit, "simulate", "-o", sim_dir, "--checkpoints", "3", "--model-bytes", "4MiB", "--density", "0.03"])
    current = os.path.join(sim_dir, "step_0000.safetensors")
    for k in (1, 2):
        new_path = os.path.join(sim_dir, f"step_{k:04d}.safetensors")
        delta = os.path.join(args.workdir, f"sim_{k}.rfp")
        out = os.path.join(args.workdir, f"sim_out_{k}.safetensors")
        run([args.refit, "encode", os.path.join(sim_dir, f"step_{k - 1:04d}.safetensors"), new_path, "-o", delta])
        run([args.refit, "apply", current, delta, "-o", out])
        got, want = read_safetensors(out), read_safetensors(new_path)
        results.check(all(np.array_equal(got[n][2], want[n][2]) for n in want), f"simulated step {k} not bit-identical")
        report = json.loads(run([args.refit, "diff", "--json", os.path.join(sim_dir, f"step_{k - 1:04d}.safetensors"), new_path]).stdout)
        prev = read_safetensors(os.path.join(sim_dir, f"step_{k - 1:04d}.safetensors"))
        expected = sum(int(np.count_nonzero(prev[n][2] != want[n][2])) for n in want)
        results.check(report["total"]["changed"] == expected, f"simulated step {k}: diff count")
        density = report["total"]["density"]
        results.check(0.015 < density < 0.06, f"simulated step {k}: density {density} far from 3%")
        current = out
    # Version fencing: the step-2 delta cannot apply to step 0.
    proc = run([args.refit, "apply", os.path.join(sim_dir, "step_0000.safetensors"),
                os.path.join(args.workdir, "sim_2.rfp"), "-o", os.path.join(args.workdir, "fenced.safetensors")], check=False)
    results.check(proc.returncode != 0 and "FailedPrecondition" in proc.stderr, "version fencing")

    print(f"{results.passed} passed, {results.failed} failed")
    return 0 if results.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
