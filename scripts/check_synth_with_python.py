#!/usr/bin/env python3
"""Check that a DeepSeek-V4/V4.1-style checkpoint directory is readable by Python's `safetensors`.

Used to show that checkpoints written by our Rust code (and the Python fixtures) are ordinary
Hugging Face checkpoints as described in ../shared/spec/dsv41-mega-attention.md section 3.

Run (Python 3.11, `pip install safetensors numpy ml_dtypes xxhash`):
    python3 scripts/check_synth_with_python.py DIR [--quiet]

It:
  - parses config.json (model fields under `text_config` for V4.1, top level for V4) and
    `quantization_config` if present (fp8 / e4m3 / ue8m0, weight_block_size [32,32] or [128,128]);
  - parses model.safetensors.index.json if present (otherwise expects a single model.safetensors):
    every listed shard exists, every tensor is in the shard the index names and nowhere else,
    every shard tensor is in the index, `metadata.total_size` (if given) equals the data bytes;
  - opens every shard with `safetensors.safe_open(..., framework="numpy")` (keys, dtypes, shapes,
    metadata) and `safetensors.deserialize` (raw bytes, which handles F8_E4M3 / F8_E8M0), and
    independently re-parses the header (offsets contiguous, sizes = dtype size x shape);
  - checks the in-scope attention tensors of every layer against the config: names, dtypes,
    shapes, scale tensors (present iff quantized, F8_E8M0, no 0xFF), no E4M3 NaN bytes (0x7F/0xFF),
    finite BF16/F32 values, attn_sink F32 [heads], and the spec's geometry rules (head_dim 512,
    8 heads per group, 32-divisible ranks);
  - prints every tensor's name, dtype and shape (unless --quiet), and exits 1 listing every problem.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np
import safetensors
from safetensors import safe_open

FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
)
DTYPE_SIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}


class Problems(list):
    def add(self, msg: str) -> None:
        self.append(msg)


def raw_header(path: Path, problems: Problems) -> dict:
    raw = path.read_bytes()
    if len(raw) < 8:
        problems.add(f"{path.name}: shorter than 8 bytes")
        return {}
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        problems.add(f"{path.name}: header length {n} beyond end of file")
        return {}
    try:
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        problems.add(f"{path.name}: header is not JSON: {err}")
        return {}
    header.pop("__metadata__", None)
    data_len = len(raw) - 8 - n
    spans = []
    for name, info in header.items():
        dt, shape, (a, b) = info.get("dtype"), info.get("shape"), info.get("data_offsets", (0, 0))
        if dt not in DTYPE_SIZE:
            problems.add(f"{path.name}: {name}: unknown dtype {dt}")
            continue
        want = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZE[dt]
        if b - a != want:
            problems.add(f"{path.name}: {name}: {b - a} data bytes, dtype x shape needs {want}")
        spans.append((a, b, name))
    spans.sort()
    pos = 0
    for a, b, name in spans:
        if a != pos:
            problems.add(f"{path.name}: {name}: data starts at {a}, expected {pos} (gap or overlap)")
        pos = b
    if pos != data_len:
        problems.add(f"{path.name}: tensors cover {pos} data bytes, file has {data_len}")
    return header


def load_config(root: Path, problems: Problems) -> tuple[dict, dict | None, str]:
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        problems.add(f"config.json: {err}")
        return {}, None, "?"
    if "text_config" in cfg:
        text, style = cfg["text_config"], "V4.1 (text_config)"
    else:
        text, style = cfg, "V4 (top level)"
    geom = {}
    for k in FIELDS:
        v = text.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            problems.add(f"config.json: {k} missing or not a positive integer ({v!r})")
        else:
            geom[k] = v
    q = cfg.get("quantization_config")
    if q is not None:
        if (q.get("quant_method"), q.get("fmt"), q.get("scale_fmt")) != ("fp8", "e4m3", "ue8m0"):
            problems.add(f"config.json: unsupported quantization_config {q}")
        if list(q.get("weight_block_size", [])) not in ([32, 32], [128, 128]):
            problems.add(f"config.json: weight_block_size {q.get('weight_block_size')}")
    return geom, q, style


def check_geometry(g: dict, problems: Problems) -> None:
    if len(g) != len(FIELDS):
        return
    if g["head_dim"] != 512:
        problems.add(f"geometry: head_dim {g['head_dim']} != 512")
    if g["num_attention_heads"] % g["o_groups"] or g["num_attention_heads"] // g["o_groups"] != 8:
        problems.add(f"geometry: {g['num_attention_heads']} heads / {g['o_groups']} groups is not 8 per group")
    for k in ("q_lora_rank", "o_lora_rank", "hidden_size"):
        if g[k] % 32:
            problems.add(f"geometry: {k} {g[k]} not a multiple of 32")
    if g["qk_rope_head_dim"] > g["head_dim"]:
        problems.add("geometry: qk_rope_head_dim > head_dim")


def finite_check(name: str, dtype: str, data: bytes, problems: Problems) -> None:
    if dtype == "F8_E4M3":
        b = np.frombuffer(data, dtype=np.uint8)
        nan = int(((b & 0x7F) == 0x7F).sum())
        if nan:
            problems.add(f"{name}: {nan} E4M3 NaN bytes (0x7F/0xFF)")
    elif dtype == "F8_E8M0":
        b = np.frombuffer(data, dtype=np.uint8)
        if (b == 0xFF).any():
            problems.add(f"{name}: {int((b == 0xFF).sum())} E8M0 NaN bytes (0xFF)")
    elif dtype == "BF16":
        u = np.frombuffer(data, dtype="<u2")
        if ((u & 0x7F80) == 0x7F80).any():
            problems.add(f"{name}: BF16 NaN/Inf")
    elif dtype in ("F32", "F16", "F64"):
        a = np.frombuffer(data, dtype={"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype])
        if not np.isfinite(a).all():
            problems.add(f"{name}: {dtype} NaN/Inf")


def main() -> int:
    ap = argparse.ArgumentParser(description="Check a checkpoint directory with Python safetensors.")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--quiet", action="store_true", help="do not list tensors")
    args = ap.parse_args()
    root: Path = args.dir
    problems = Problems()
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 1

    geom, quant, style = load_config(root, problems)
    check_geometry(geom, problems)

    index_path = root / "model.safetensors.index.json"
    weight_map = None
    total_size = None
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            total_size = index.get("metadata", {}).get("total_size")
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            problems.add(f"model.safetensors.index.json: {err}")
            weight_map = None
        files = sorted(set(weight_map.values())) if weight_map else []
    else:
        files = ["model.safetensors"]
    on_disk = sorted(p.name for p in root.glob("*.safetensors"))
    for extra in sorted(set(on_disk) - set(files)):
        problems.add(f"{extra}: shard on disk but not in the index")

    tensors: dict[str, tuple[str, list[int], bytes, str]] = {}  # name -> dtype, shape, data, file
    data_bytes = 0
    for f in files:
        path = root / f
        if not path.exists():
            problems.add(f"{f}: listed in the index but missing")
            continue
        header = raw_header(path, problems)
        try:
            with safe_open(str(path), framework="numpy") as sf:
                keys = set(sf.keys())
                meta = sf.metadata()
                for k in keys:
                    sl = sf.get_slice(k)
                    info = header.get(k, {})
                    if str(sl.get_dtype()) != info.get("dtype") or list(sl.get_shape()) != info.get("shape"):
                        problems.add(f"{f}: {k}: safe_open says {sl.get_dtype()} {sl.get_shape()}, header {info}")
                    if sl.get_dtype() in ("F32", "I32", "I64", "F64", "U8", "I8", "F16"):
                        arr = sf.get_tensor(k)  # numpy-native dtypes: full read through safetensors
                        assert list(arr.shape) == list(sl.get_shape())
            if keys != set(header):
                problems.add(f"{f}: safe_open keys differ from the raw header")
            parsed = safetensors.deserialize(path.read_bytes())
        except Exception as err:  # noqa: BLE001 - any failure to read is the finding
            problems.add(f"{f}: safetensors could not read it: {type(err).__name__}: {err}")
            continue
        if not args.quiet:
            print(f"== {f} ({path.stat().st_size} bytes, metadata {meta})")
        for name, t in sorted(parsed, key=lambda x: x[0]):
            data = bytes(t["data"])
            data_bytes += len(data)
            if name in tensors:
                problems.add(f"{name}: in {tensors[name][3]} and in {f}")
            tensors[name] = (t["dtype"], list(t["shape"]), data, f)
            if weight_map is not None and weight_map.get(name) != f:
                where = weight_map.get(name)
                problems.add(f"{name}: in {f}, " + (f"index says {where}" if where else "not in the index"))
            if not args.quiet:
                print(f"  {name:44s} {t['dtype']:8s} {list(t['shape'])}")
            finite_check(name, t["dtype"], data, problems)
    if weight_map is not None:
        for name in sorted(set(weight_map) - set(tensors)):
            problems.add(f"{name}: in the index, in no shard")
    if total_size is not None and total_size != data_bytes:
        problems.add(f"index metadata.total_size {total_size} != {data_bytes} data bytes")

    # in-scope attention tensors (spec section 3)
    if len(geom) == len(FIELDS):
        g = geom
        H, D, K, G, OL, hid = (g["num_attention_heads"], g["head_dim"], g["q_lora_rank"], g["o_groups"],
                               g["o_lora_rank"], g["hidden_size"])
        KA = (H // G) * D if G and H % G == 0 else 8 * D
        bs = list(quant.get("weight_block_size", [32, 32])) if quant else None
        wdt = "F8_E4M3" if quant else "BF16"
        for i in range(g["num_hidden_layers"]):
            p = f"layers.{i}.attn."
            for n, shape in (("wq_b", [H * D, K]), ("wo_a", [G * OL, KA]), ("wo_b", [hid, G * OL])):
                w = tensors.get(p + n + ".weight")
                if w is None:
                    problems.add(f"{p}{n}.weight: missing")
                elif w[0] != wdt or w[1] != shape:
                    problems.add(f"{p}{n}.weight: {w[0]} {w[1]}, want {wdt} {shape}")
                s = tensors.get(p + n + ".scale")
                if quant:
                    want = [-(-shape[0] // bs[0]), -(-shape[1] // bs[1])]
                    if s is None:
                        problems.add(f"{p}{n}.scale: missing")
                    elif s[0] != "F8_E8M0" or s[1] != want:
                        problems.add(f"{p}{n}.scale: {s[0]} {s[1]}, want F8_E8M0 {want}")
                elif s is not None:
                    problems.add(f"{p}{n}.scale: present in an unquantized checkpoint")
            sink = tensors.get(p + "attn_sink")
            if sink is None:
                problems.add(f"{p}attn_sink: missing")
            elif sink[0] != "F32" or sink[1] != [H]:
                problems.add(f"{p}attn_sink: {sink[0]} {sink[1]}, want F32 [{H}]")

    print(f"{root}: config {style}, {'fp8 ' + str(quant.get('weight_block_size')) if quant else 'unquantized'}, "
          f"{len(files)} shard(s), {len(tensors)} tensors, {data_bytes} data bytes, geometry {geom}")
    if problems:
        for msg in problems:
            print(f"PROBLEM: {msg}", file=sys.stderr)
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
