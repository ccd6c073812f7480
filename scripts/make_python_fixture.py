#!/usr/bin/env python3
"""Independent Python/numpy reference for the DeepSeek-V4.1 mega-attention weight layouts.

Written from ../shared/spec/dsv41-mega-attention.md alone (sections 2-7 and 9), without looking at
the Rust code, so that the Rust loader can be tested against it. It does two things:

1. writes two small DeepSeek-V4.1-style Hugging Face checkpoints with Python's `safetensors`
   package ("micro" geometry: hidden 64, heads 16, head_dim 512, q_lora 32, o_lora 32, 2 groups):
     tests/fixtures/python-v41-micro-fp8/   2 layers, 2 shards, FP8 E4M3 + UE8M0 32x32 scales
     tests/fixtures/python-v41-micro-bf16/  1 layer, 1 shard, BF16 weights (a trainer's export)
2. reads each checkpoint back FROM DISK (its own minimal safetensors reader) and computes, for every
   TP size the geometry allows and every rank, the kernel-visible tensors (spec sections 3, 5, 7),
   their XXH3-64 digests and the source-slice digests (section 9); it writes them to
   `expected.json` beside the checkpoint. BF16 checkpoints get both MXFP8 scale rules
   (`rceil`, `floor`, section 6); FP8 checkpoints only `rceil` (the rule does not apply to them).

Before writing anything it asserts the spec's worked examples: the Q/O permutation examples
(section 5), the MXFP8 scale table (section 6, both rules) and a few extra edge cases (subnormal
quotients, RNE ties), and it cross-checks its own integer-exact E4M3 rounding against ml_dtypes.

Requirements: Python 3.11, `pip install safetensors numpy ml_dtypes xxhash`.

Run (from the repository root):
    python3 scripts/make_python_fixture.py                # (re)write both fixtures + expected.json
    python3 scripts/make_python_fixture.py --check        # regenerate in memory, compare with disk
    python3 scripts/make_python_fixture.py --self-test    # only the spec asserts
    python3 scripts/make_python_fixture.py --expected DIR [--tp 1 2] [--rules rceil floor]
        # print the expected.json document for ANY checkpoint directory (e.g. one written by Rust)
    python3 scripts/make_python_fixture.py --dump OUT --checkpoint DIR --tp 2 --rank 0 \
        [--layout permutation_skipped] [--rules floor] [--as-rank 1]
        # write OUT/rank0.safetensors as an engine would dump its kernel tensors, in the expected
        # layout or a known wrong one (--as-rank 1: rank 1's tensors under rank 0's name)

Output is deterministic (fixed seeds), so `--check` must report no difference.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import xxhash

# ---------------------------------------------------------------------------------------------
# Constants fixed by the spec (section 2): the layouts are defined by these.
HEAD_DIM = 512
Q_CHUNK = 16
O_CHUNK = 32
HEADS_PER_GROUP = 8
MX_BLOCK = 32  # MXFP8 block along K, and the V4.1 checkpoint's 32x32 weight block
E4M3_MAX = 448.0

MICRO = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=32,
    o_lora_rank=32,
    o_groups=2,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"
FP8_NAME = "python-v41-micro-fp8"
BF16_NAME = "python-v41-micro-bf16"

# safetensors dtype code -> (numpy storage dtype, element size in bytes)
ST_DTYPES = {
    "F8_E4M3": (np.uint8, 1),
    "F8_E8M0": (np.uint8, 1),
    "U8": (np.uint8, 1),
    "I8": (np.int8, 1),
    "BF16": (np.uint16, 2),
    "F16": (np.float16, 2),
    "I32": (np.int32, 4),
    "F32": (np.float32, 4),
    "I64": (np.int64, 8),
    "F64": (np.float64, 8),
}
# safetensors >= 0.7 TensorSpec dtype names for the codes we write
ST_SPEC_NAMES = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "BF16": "bfloat16",
    "F32": "float32",
    "I32": "int32",
    "U8": "uint8",
}


# ---------------------------------------------------------------------------------------------
# Digests (section 9)
def dump_json(doc) -> str:
    """json.dumps with indent 2, but short lists of numbers kept on one line."""
    text = json.dumps(doc, indent=2)
    return re.sub(r"\[\s+(-?[\d.e+-]+(?:,\s+-?[\d.e+-]+)*)\s+\]",
                  lambda mm: "[" + ", ".join(x.strip() for x in mm.group(1).split(",")) + "]", text) + "\n"


def xxh3_hex(data: bytes) -> str:
    return format(xxhash.xxh3_64_intdigest(data, seed=0), "016x")


def rank_digest(digests: dict[str, str]) -> str:
    names = sorted(digests, key=lambda n: n.encode("utf-8"))
    text = "".join(f"{n} {digests[n]}\n" for n in names)
    return xxh3_hex(text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Permutations (section 5), convention fused = standard[perm]
def q_permutation(n_local_heads: int, head_dim: int = HEAD_DIM) -> np.ndarray:
    """perm[f] = s for s = h*D + d, f = (d//16)*(H*16) + h*16 + d%16."""
    assert head_dim == HEAD_DIM
    H = n_local_heads
    perm = np.full(H * head_dim, -1, dtype=np.int64)
    for h in range(H):
        for d in range(head_dim):
            s = h * head_dim + d
            f = (d // Q_CHUNK) * (H * Q_CHUNK) + h * Q_CHUNK + d % Q_CHUNK
            assert perm[f] == -1
            perm[f] = s
    assert (perm >= 0).all()
    return perm


def o_permutation() -> np.ndarray:
    """perm[f] = s for s = h*512 + c*32 + j, f = (c*8 + h)*32 + j (h<8, c<16, j<32)."""
    n = HEADS_PER_GROUP * HEAD_DIM
    perm = np.full(n, -1, dtype=np.int64)
    for h in range(HEADS_PER_GROUP):
        for c in range(HEAD_DIM // O_CHUNK):
            for j in range(O_CHUNK):
                s = h * HEAD_DIM + c * O_CHUNK + j
                f = (c * HEADS_PER_GROUP + h) * O_CHUNK + j
                assert perm[f] == -1
                perm[f] = s
    assert (perm >= 0).all()
    return perm


def o_chunk_permutation() -> np.ndarray:
    """Per-32 scale column permutation perm[::32] / 32."""
    p = o_permutation()
    chunks = p[::O_CHUNK]
    assert (chunks % O_CHUNK == 0).all()
    return chunks // O_CHUNK


def check_permutation_examples() -> None:
    p = q_permutation(8)
    assert list(p[0:4]) == [0, 1, 2, 3]
    assert list(p[16:20]) == [512, 513, 514, 515]
    assert list(p[128:132]) == [16, 17, 18, 19]
    assert sorted(p.tolist()) == list(range(8 * 512))
    p16 = q_permutation(16)
    assert sorted(p16.tolist()) == list(range(16 * 512))
    assert list(p16[16:20]) == [512, 513, 514, 515] and list(p16[256:260]) == [16, 17, 18, 19]
    o = o_permutation()
    assert list(o[0:3]) == [0, 1, 2]
    assert list(o[32:35]) == [512, 513, 514]
    assert list(o[256:259]) == [32, 33, 34]
    assert sorted(o.tolist()) == list(range(4096))
    oc = o_chunk_permutation()
    assert list(oc[:10]) == [0, 16, 32, 48, 64, 80, 96, 112, 1, 17]
    assert sorted(oc.tolist()) == list(range(128))
    # O: 32-column blocks survive the column permutation (so MXFP8 along K commutes with it);
    # Q permutes whole rows, so K-blocks are untouched and each row keeps its own scale row.
    blocks = o.reshape(-1, MX_BLOCK)
    assert (blocks - blocks[:, :1] == np.arange(MX_BLOCK)).all() and (blocks[:, 0] % MX_BLOCK == 0).all()
    for perm in (p, p16):  # 16-row chunks stay contiguous runs
        runs = perm.reshape(-1, Q_CHUNK)
        assert (runs - runs[:, :1] == np.arange(Q_CHUNK)).all()


# ---------------------------------------------------------------------------------------------
# E4M3fn rounding, integer/table exact (independent of ml_dtypes; cross-checked against it)
def _e4m3_table() -> np.ndarray:
    vals = np.zeros(0x7F, dtype=np.float64)  # bytes 0x00..0x7E (0x7F is NaN)
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        vals[b] = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    assert vals[0x7E] == 448.0 and (np.diff(vals) > 0).all()
    return vals


E4M3_VALUES = _e4m3_table()


def e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Round float64 values (|v| <= 448, finite) to E4M3fn bytes, nearest-even, sign kept
    (a negative value that rounds to zero gives 0x80, IEEE style)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    if not np.isfinite(a).all() or (a > E4M3_MAX).any():
        raise ValueError("e4m3_rne: input must be finite and clamped to +-448")
    hi = np.searchsorted(E4M3_VALUES, a, side="left")  # E4M3_VALUES[hi] >= a
    hi = np.minimum(hi, 0x7E)
    lo = np.maximum(hi - 1, 0)
    d_hi = E4M3_VALUES[hi] - a
    d_lo = a - E4M3_VALUES[lo]
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(d_hi == 0, hi, np.where(pick_hi, hi, lo)).astype(np.uint8)
    sign = np.signbit(v).astype(np.uint8) << 7
    return code | sign


def check_e4m3_against_ml_dtypes() -> None:
    rng = np.random.default_rng(1234)
    mids = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
    cases = [
        E4M3_VALUES,
        mids,
        np.nextafter(mids, 0),
        np.nextafter(mids, 1000),
        rng.uniform(0, 448, 200000),
        np.exp2(rng.uniform(-14, np.log2(448), 200000)),
        np.array([0.0, 2.0**-10, 3 * 2.0**-10, 2.0**-11, 447.9, 448.0]),
    ]
    x = np.concatenate(cases)
    x = np.clip(x, 0, 448)
    x = np.concatenate([x, -x]).astype(np.float32).astype(np.float64)  # values the quantizer feeds
    mine = e4m3_rne(x)
    ref = x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bad = np.nonzero(mine != ref)[0]
    assert bad.size == 0, f"E4M3 RNE mismatch vs ml_dtypes at {x[bad[:5]]}: {mine[bad[:5]]} vs {ref[bad[:5]]}"
    # ties to even, explicitly
    assert e4m3_rne(np.array([17.0]))[0] == e4m3_rne(np.array([16.0]))[0]  # 17 -> 16
    assert e4m3_rne(np.array([19.0]))[0] == e4m3_rne(np.array([20.0]))[0]  # 19 -> 20
    assert e4m3_rne(np.array([2.0**-10]))[0] == 0x00  # half the smallest subnormal -> 0
    assert e4m3_rne(np.array([3 * 2.0**-10]))[0] == 0x02  # -> 2^-8 (even)
    assert e4m3_rne(np.array([-1e-9]))[0] == 0x80


def e4m3_value(byte: int) -> float:
    b = int(byte)
    v = E4M3_VALUES[b & 0x7F]
    return -v if b & 0x80 else v


# ---------------------------------------------------------------------------------------------
# MXFP8 quantization (section 6), exact bit arithmetic on float32
def _bit_length(m: np.ndarray) -> np.ndarray:
    n = np.zeros(m.shape, dtype=np.int64)
    for b in range(32):
        n += (m >> b) > 0
    return n


def f32_exponent(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For positive finite float32 `a` (non-zero): (true binary exponent, is exact power of two).
    Subnormals use their true exponent (position of the leading mantissa bit)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.int64)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    if (e == 0xFF).any():
        raise ValueError("f32_exponent: NaN/Inf")
    normal = e != 0
    exp = np.where(normal, e - 127, _bit_length(m) - 1 - 149)
    pow2 = np.where(normal, m == 0, (m & (m - 1)) == 0)
    return exp, pow2


def mx_scale_exponents(amax: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """amax: float32 block maxima. Returns (exponent int64 clamped to [-127,127], scale byte u8).
    All-zero blocks get byte 0 (exponent -127, their elements are zero whatever the exponent)."""
    amax = np.asarray(amax, dtype=np.float32)
    zero = amax == 0
    safe = np.where(zero, np.float32(1), amax).astype(np.float32)
    if rule == "rceil":
        s = (safe / np.float32(E4M3_MAX)).astype(np.float32)  # f32 division, IEEE RNE
        s_zero = s == 0  # amax so tiny the f32 quotient underflows: exponent < -149 -> clamps
        e, pow2 = f32_exponent(np.where(s_zero, np.float32(1), s))
        exp = e + np.where(pow2, 0, 1)
        exp = np.where(s_zero, -127, exp)
    elif rule == "floor":
        e, _ = f32_exponent(safe)
        exp = e - 8
    else:
        raise ValueError(f"unknown scale rule {rule!r}")
    exp = np.clip(exp, -127, 127)
    exp = np.where(zero, -127, exp)
    byte = (exp + 127).astype(np.uint8)
    return exp.astype(np.int64), byte


def mxfp8_quantize(x: np.ndarray, rule: str, tensor: str = "?") -> tuple[np.ndarray, np.ndarray]:
    """x: float32 [R, K] (K % 32 == 0). Returns (E4M3 bytes [R, K], E8M0 scale bytes [R, K/32])."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    assert K % MX_BLOCK == 0
    bad = ~np.isfinite(x)
    if bad.any():
        r = int(np.nonzero(bad.any(axis=1))[0][0])
        raise ValueError(f"NaN/Inf in tensor {tensor} row {r}")
    blocks = x.reshape(R, K // MX_BLOCK, MX_BLOCK)
    amax = np.abs(blocks).max(axis=2)  # exact in f32
    exp, sbyte = mx_scale_exponents(amax, rule)
    scaled = blocks.astype(np.float64) * np.exp2(-exp.astype(np.float64))[:, :, None]  # exact
    scaled = np.clip(scaled, -E4M3_MAX, E4M3_MAX)
    q = e4m3_rne(scaled)  # an all-zero block: +0 -> 0x00 (and -0.0 -> 0x80, sign kept)
    return q.reshape(R, K), sbyte.reshape(R, K // MX_BLOCK)


def check_scale_table() -> None:
    f32 = np.float32
    tiny = f32(np.float64(448) * 2.0**-18 * (1 + 2.0**-20))
    assert np.float64(tiny) == 448 * 2.0**-18 * (1 + 2.0**-20)  # exactly representable
    table = [
        # amax, all_equal, (rceil byte, elem), (floor byte, elem)
        (f32(300), False, (127, 288), (127, 288)),
        (f32(448), False, (127, 448), (127, 448)),
        (f32(460), False, (128, 224), (127, 448)),
        (f32(500), False, (128, 256), (127, 448)),
        (f32(1.0), False, (119, 256), (119, 256)),
        (f32(0.0), True, (0, 0), (0, 0)),
        (f32(0.001), True, (109, 256), (109, 256)),
        (tiny, False, (110, 224), (109, 448)),
    ]
    for amax, all_equal, want_rceil, want_floor in table:
        for sign in (1, -1):
            block = np.full((1, 32), amax if all_equal else 0, dtype=np.float32)
            block[0, 5] = sign * amax
            for rule, (wb, we) in (("rceil", want_rceil), ("floor", want_floor)):
                q, s = mxfp8_quantize(block, rule)
                got = (int(s[0, 0]), e4m3_value(q[0, 5]))
                want = (wb, float(sign * we) if we else 0.0)
                assert got[0] == want[0] and got[1] == want[1], (float(amax), sign, rule, got, want)
                if amax == 0 and sign == 1:
                    assert (q == 0).all() and s[0, 0] == 0
    # extra edge cases (spec: subnormals through their true exponent, clamp to [-127, 127])
    sub = lambda m: np.array([m], dtype=np.uint32).view(np.float32)[0]  # noqa: E731
    e, p = f32_exponent(np.array([sub(1), sub(2), sub(3), sub(0x400000), sub(0x7FFFFF)], np.float32))
    assert e.tolist() == [-149, -148, -148, -127, -127] and p.tolist() == [True, True, False, True, False]
    cases = [
        # amax (f32), rule, expected byte
        (f32(448 * 2.0**-127), "rceil", 0),  # s = 2^-127 exactly (subnormal, power of two)
        (f32(448 * 1.5 * 2.0**-127), "rceil", 1),  # s = 1.5*2^-127 (subnormal) -> -126
        (f32(448 * 2.0**-126), "rceil", 1),  # s = 2^-126 (smallest normal)
        (sub(1), "rceil", 0),  # quotient underflows to 0 -> clamped
        (sub(1), "floor", 0),
        (f32(2.0**-119), "floor", 0),  # -119-8 = -127
        (f32(2.0**-118), "floor", 1),
        (f32(3.0e38), "rceil", 127 + 120),
        (f32(3.0e38), "floor", 127 + 119),
        (f32(460 * 2.0**-9), "rceil", 119),
        (f32(460 * 2.0**-9), "floor", 118),
    ]
    for amax, rule, want in cases:
        _, b = mx_scale_exponents(np.array([amax], np.float32), rule)
        assert int(b[0]) == want, (float(amax), rule, int(b[0]), want)
    # element for the s = 2^-127 case is exactly 448
    q, s = mxfp8_quantize(np.full((1, 32), f32(448 * 2.0**-127), np.float32), "rceil")
    assert s[0, 0] == 0 and e4m3_value(q[0, 0]) == 448.0
    # NaN must be an error naming tensor and row
    bad = np.zeros((3, 32), np.float32)
    bad[2, 7] = np.nan
    try:
        mxfp8_quantize(bad, "rceil", "t")
    except ValueError as err:
        assert "row 2" in str(err) and "t" in str(err)
    else:
        raise AssertionError("NaN not rejected")


# ---------------------------------------------------------------------------------------------
# Kernel layouts (section 7)
def swizzle_128x4(scale: np.ndarray) -> np.ndarray:
    """F8_128x4 swizzle of a per-row scale [M, C] (bytes) -> 1-D bytes."""
    M, C = scale.shape
    Mp = 128 * -(-M // 128)
    cb = -(-C // 4)
    Cp = 4 * cb
    padded = np.zeros((Mp, Cp), dtype=np.uint8)
    padded[:M, :C] = scale
    out = np.full(Mp * Cp, 0xAA, dtype=np.uint8)  # sentinel: every byte must be written
    i = np.arange(Mp)[:, None]
    j = np.arange(Cp)[None, :]
    off = ((i // 128) * cb + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
    assert np.unique(off).size == Mp * Cp and off.max() == Mp * Cp - 1
    out[off] = padded
    return out


def check_swizzle() -> None:
    # V4.1-Flash at TP4: M = 8192, C = 40 -> 327680 bytes (section 7)
    assert swizzle_128x4(np.zeros((8192, 40), np.uint8)).size == 327680
    s = np.arange(5 * 3, dtype=np.uint8).reshape(5, 3) + 1
    z = swizzle_128x4(s)
    assert z.size == 512
    assert z[0] == 1 and z[1] == 2 and z[2] == 3 and z[3] == 0  # row 0, j = 0..3 (3 = pad)
    assert z[16] == 4  # row 1 at (i%32)*16
    assert z.sum() == s.sum()
    t = np.zeros((200, 5), np.uint8)
    t[33, 4] = 7  # i=33: i//128=0, j//4=1 -> 512 ; (33%32)*16=16 ; (33//32)*4=4 ; j%4=0
    assert swizzle_128x4(t)[512 + 16 + 4] == 7
    t = np.zeros((200, 5), np.uint8)
    t[130, 1] = 9  # i//128=1, cb=2 -> block 2 -> 1024 ; (130%32)*16=32 ; 0 ; 1
    assert swizzle_128x4(t)[1024 + 32 + 1] == 9


def pack_wo_a_scale(scale: np.ndarray, groups: int, o_lora: int) -> np.ndarray:
    """[g*o_lora, 128] chunk-permuted per-row scale bytes -> storage bytes of int32 [g][k4][row]."""
    assert scale.shape == (groups * o_lora, 128)
    assert o_lora % 4 == 0  # align4(o_lora) == o_lora: no padding rows
    return np.ascontiguousarray(scale.reshape(groups, o_lora, 32, 4).transpose(0, 2, 1, 3)).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Minimal safetensors reader (raw; handles every dtype as bytes)
class Shard:
    def __init__(self, path: Path):
        self.path = path
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n].decode("utf-8"))
        self.metadata = header.pop("__metadata__", None)
        self.header = header
        self.data = raw[8 + n :]
        for name, info in header.items():
            dt = info["dtype"]
            if dt not in ST_DTYPES:
                raise ValueError(f"{path}: {name}: unsupported dtype {dt}")
            a, b = info["data_offsets"]
            if b - a != int(np.prod(info["shape"], dtype=np.int64)) * ST_DTYPES[dt][1] or b > len(self.data):
                raise ValueError(f"{path}: {name}: bad data_offsets {a},{b}")

    def array(self, name: str) -> tuple[str, np.ndarray]:
        info = self.header[name]
        a, b = info["data_offsets"]
        np_dt = np.dtype(ST_DTYPES[info["dtype"]][0]).newbyteorder("<")
        arr = np.frombuffer(self.data[a:b], dtype=np_dt).reshape(info["shape"])
        return info["dtype"], arr.astype(np_dt.newbyteorder("="))


class Checkpoint:
    def __init__(self, root: Path):
        self.root = Path(root)
        cfg = json.loads((self.root / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        self.geom = {k: int(text[k]) for k in MICRO}
        self.quant = cfg.get("quantization_config")
        if self.quant is not None:
            if self.quant.get("quant_method") != "fp8" or self.quant.get("fmt") != "e4m3" \
                    or self.quant.get("scale_fmt") != "ue8m0" \
                    or list(self.quant.get("weight_block_size", [])) != [MX_BLOCK, MX_BLOCK]:
                raise ValueError(f"unsupported quantization_config {self.quant}")
        index_path = self.root / "model.safetensors.index.json"
        if index_path.exists():
            wm = json.loads(index_path.read_text())["weight_map"]
        else:
            wm = None
        shards: dict[str, Shard] = {}
        self.where: dict[str, Shard] = {}
        files = sorted(set(wm.values())) if wm is not None else ["model.safetensors"]
        for f in files:
            shards[f] = Shard(self.root / f)
            for name in shards[f].header:
                if name in self.where:
                    raise ValueError(f"tensor {name} in two shards")
                self.where[name] = shards[f]
                if wm is not None and wm.get(name) != f:
                    raise ValueError(f"index says {name} is in {wm.get(name)}, found in {f}")
        if wm is not None and set(wm) != set(self.where):
            raise ValueError("index weight_map and shard contents differ")

    def get(self, name: str) -> tuple[str, np.ndarray]:
        return self.where[name].array(name)


# ---------------------------------------------------------------------------------------------
# Expected kernel / source tensors (sections 3, 4, 5, 7, 9)
def validate_tp(g: dict, tp: int) -> tuple[int, int]:
    H, G = g["num_attention_heads"], g["o_groups"]
    if g["head_dim"] != HEAD_DIM:
        raise ValueError("head_dim must be 512")
    if H % tp or G % tp:
        raise ValueError(f"tp {tp} does not divide heads {H} / groups {G}")
    h_local, g_local = H // tp, G // tp
    if h_local % HEADS_PER_GROUP or h_local // g_local != HEADS_PER_GROUP:
        raise ValueError(f"tp {tp} leaves {h_local} heads / {g_local} groups per rank")
    return h_local, g_local


def valid_tps(g: dict) -> list[int]:
    out = []
    for t in range(1, g["num_attention_heads"] + 1):
        try:
            validate_tp(g, t)
            out.append(t)
        except ValueError:
            pass
    return out


def _entry(dtype: str, shape: list[int], data: bytes) -> dict:
    return {"dtype": dtype, "shape": [int(x) for x in shape], "xxh3": xxh3_hex(data)}


LAYOUTS = ("expected", "permutation_skipped", "permuted_twice", "scales_not_swizzled", "scales_not_packed")


def expected_case(ck: Checkpoint, tp: int, rank: int, rule: str, layout: str = "expected",
                  tensors: dict | None = None) -> dict:
    """The kernel tensors of one rank. `layout` other than "expected" reproduces a known loader
    bug (permutation skipped or applied twice, scales left per-row instead of swizzled or
    packed); `tensors`, when given, receives name -> (dtype, shape, numpy bytes) for dumps."""
    assert layout in LAYOUTS, layout
    g = ck.geom
    D, K = HEAD_DIM, g["q_lora_rank"]
    H, G, OL, hidden = g["num_attention_heads"], g["o_groups"], g["o_lora_rank"], g["hidden_size"]
    h_local, g_local = validate_tp(g, tp)
    assert 0 <= rank < tp
    fp8 = ck.quant is not None
    qperm = q_permutation(h_local)
    operm = o_permutation()
    ochunk = o_chunk_permutation()
    assert G * OL % MX_BLOCK == 0 and OL % MX_BLOCK == 0 and K % MX_BLOCK == 0
    wo_a_k = HEADS_PER_GROUP * D

    q_rows = slice(rank * h_local * D, (rank + 1) * h_local * D)
    a_rows = slice(rank * g_local * OL, (rank + 1) * g_local * OL)
    b_cols = slice(rank * g_local * OL, (rank + 1) * g_local * OL)
    heads = slice(rank * h_local, (rank + 1) * h_local)

    def blk(s: slice) -> slice:
        if s.start is None and s.stop is None:
            return s
        assert s.start % MX_BLOCK == 0 and s.stop % MX_BLOCK == 0
        return slice(s.start // MX_BLOCK, s.stop // MX_BLOCK)

    kernel: dict[str, dict] = {}
    source: dict[str, str] = {}
    wdt = "F8_E4M3" if fp8 else "BF16"

    def entry(name: str, dtype: str, shape, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr).tobytes()
        kernel[name] = _entry(dtype, list(shape), data)
        if tensors is not None:
            tensors[name] = (dtype, [int(x) for x in shape], np.frombuffer(data, dtype=np.uint8))

    def permute_rows(a: np.ndarray, perm: np.ndarray) -> np.ndarray:
        if layout == "permutation_skipped":
            return a
        return a[perm][perm] if layout == "permuted_twice" else a[perm]

    def permute_cols(a: np.ndarray, perm: np.ndarray) -> np.ndarray:
        if layout == "permutation_skipped":
            return a
        return a[:, perm][:, perm] if layout == "permuted_twice" else a[:, perm]

    def load_weight(name, shape, rows, cols, scale_shape):
        """Returns (E4M3 bytes of the rank's slice, per-row scale of the slice)."""
        dt, w = ck.get(name + ".weight")
        if dt != wdt or list(w.shape) != shape:
            raise ValueError(f"{name}.weight: {dt} {list(w.shape)}, want {wdt} {shape}")
        w_local = np.ascontiguousarray(w[rows, cols])
        source[name + ".weight"] = xxh3_hex(w_local.tobytes())
        if fp8:
            sdt, s = ck.get(name + ".scale")
            if sdt != "F8_E8M0" or list(s.shape) != scale_shape:
                raise ValueError(f"{name}.scale: {sdt} {list(s.shape)}, want F8_E8M0 {scale_shape}")
            if (s == 0xFF).any():
                raise ValueError(f"{name}.scale: E8M0 NaN (0xFF)")
            if ((w == 0x7F) | (w == 0xFF)).any():
                raise ValueError(f"{name}.weight: E4M3 NaN")
            s_local = np.ascontiguousarray(s[blk(rows), blk(cols)])
            source[name + ".scale"] = xxh3_hex(s_local.tobytes())
            per_row = np.repeat(s_local, MX_BLOCK, axis=0)  # [rows, K/32]
            return w_local.astype(np.uint8), per_row.astype(np.uint8)
        x = bf16_to_f32(w_local)
        q, sc = mxfp8_quantize(x, rule, name + ".weight")
        # quantizing the whole tensor and slicing gives the same bytes (32-aligned slices)
        xf = bf16_to_f32(w)
        qf, scf = mxfp8_quantize(xf, rule, name + ".weight")
        assert (qf[rows, cols] == q).all() and (scf[rows, blk(cols)] == sc).all()
        return q, sc

    for i in range(g["num_hidden_layers"]):
        p = f"layers.{i}.attn."
        # wq_b: rows by heads, Q row permutation
        w, sc = load_weight(p + "wq_b", [H * D, K], q_rows, slice(None), [H * D // 32, K // 32])
        wf, scf = permute_rows(w, qperm), permute_rows(sc, qperm)
        entry(p + "wq_b.weight", "F8_E4M3", wf.shape, wf)
        sw = scf.reshape(-1) if layout == "scales_not_swizzled" else swizzle_128x4(scf)
        entry(p + "wq_b.weight_scale", "F8_E8M0", [sw.size], sw)
        # wo_a: rows by groups, O column permutation, packed scales
        w, sc = load_weight(p + "wo_a", [G * OL, wo_a_k], a_rows, slice(None), [G * OL // 32, wo_a_k // 32])
        wf = permute_cols(w, operm).reshape(g_local, OL, wo_a_k)
        entry(p + "wo_a.weight", "F8_E4M3", wf.shape, wf)
        scf = permute_cols(sc, ochunk)
        packed = np.ascontiguousarray(scf).reshape(-1) if layout == "scales_not_packed" else pack_wo_a_scale(scf, g_local, OL)
        entry(p + "wo_a.weight_scale", "I32", [g_local, wo_a_k // 32 // 4, OL], packed)
        # wo_b: columns by groups, unpermuted
        w, sc = load_weight(p + "wo_b", [hidden, G * OL], slice(None), b_cols, [hidden // 32, G * OL // 32])
        entry(p + "wo_b.weight", "F8_E4M3", w.shape, w)
        sw = np.ascontiguousarray(sc).reshape(-1) if layout == "scales_not_swizzled" else swizzle_128x4(sc)
        entry(p + "wo_b.weight_scale", "F8_E8M0", [sw.size], sw)
        # attn_sink: the rank's heads
        dt, sink = ck.get(p + "attn_sink")
        if dt != "F32" or list(sink.shape) != [H]:
            raise ValueError(f"{p}attn_sink: {dt} {list(sink.shape)}")
        sl = np.ascontiguousarray(sink[heads]).astype("<f4")
        source[p + "attn_sink"] = xxh3_hex(sl.tobytes())
        entry(p + "attn_sink", "F32", [h_local], sl)

    return {
        "tp": tp,
        "rank": rank,
        "scale_rule": rule,
        "kernel": dict(sorted(kernel.items())),
        "kernel_rank_digest": rank_digest({k: v["xxh3"] for k, v in kernel.items()}),
        "source": dict(sorted(source.items())),
        "source_rank_digest": rank_digest(source),
    }


def expected_document(root: Path, tps: list[int] | None = None, rules: list[str] | None = None) -> dict:
    ck = Checkpoint(root)
    if tps is None:
        tps = valid_tps(ck.geom)
    if rules is None:
        rules = ["rceil"] if ck.quant is not None else ["rceil", "floor"]
    cases = []
    for rule in rules:
        for tp in tps:
            for rank in range(tp):
                cases.append(expected_case(ck, tp, rank, rule))
    return {"cases": cases}


# ---------------------------------------------------------------------------------------------
# Checkpoint writing
def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], np.ndarray]]) -> int:
    """tensors: name -> (safetensors dtype code, shape, little-endian numpy array holding the bytes).
    Returns the data size in bytes."""
    import safetensors

    keep = {}
    specs = {}
    total = 0
    for name, (code, shape, arr) in tensors.items():
        buf = np.ascontiguousarray(arr)
        nbytes = int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[code][1]
        assert buf.nbytes == nbytes, (name, buf.nbytes, nbytes)
        keep[name] = buf
        total += nbytes
        if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.7
            specs[name] = safetensors.TensorSpec(
                dtype=ST_SPEC_NAMES[code], shape=list(shape), data_ptr=buf.ctypes.data, data_len=nbytes
            )
        else:  # older bindings take raw bytes
            specs[name] = {"dtype": code, "shape": list(shape), "data": buf.tobytes()}
    if hasattr(safetensors, "serialize_file"):
        safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})
    else:
        from safetensors import _safetensors_rust

        _safetensors_rust.serialize_file(specs, str(path), metadata={"format": "pt"})
    del keep
    # read back the header and check dtypes/shapes
    sh = Shard(path)
    for name, (code, shape, _arr) in tensors.items():
        assert sh.header[name]["dtype"] == code and sh.header[name]["shape"] == list(shape), name
    return total


def e4m3_random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape)
    x = x * (440.0 / np.abs(x).max())
    b = np.clip(x, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert not ((b == 0x7F) | (b == 0xFF)).any()
    return np.ascontiguousarray(b)


def e8m0_random(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(112, 119, size=shape, dtype=np.uint8)  # 112..=118


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float values -> BF16 bit patterns (uint16), round-to-nearest-even."""
    b = np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.ascontiguousarray(b)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def config_json(geom: dict, fp8: bool) -> dict:
    text = dict(geom)
    text.update(
        {
            "vocab_size": 128,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "sliding_window": 128,
            "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16",
        }
    )
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.99.0",
    }
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
        }
    return cfg


def write_checkpoint(root: Path, geom: dict, shards: dict[str, dict], fp8: bool, write_index: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.safetensors"):
        stale.unlink()
    (root / "config.json").write_text(dump_json(config_json(geom, fp8)))
    weight_map = {}
    total = 0
    for fname, tensors in shards.items():
        total += write_safetensors(root / fname, tensors)
        (root / fname).chmod(0o644)
        for n in tensors:
            weight_map[n] = fname
    index = root / "model.safetensors.index.json"
    if write_index:
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index.write_text(dump_json(doc))
    elif index.exists():
        index.unlink()


def build_fp8(root: Path) -> None:
    g = dict(MICRO)
    rng = np.random.default_rng(20260401)
    H, D, K, G, OL, hid = (g[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                                         "o_lora_rank", "hidden_size"))
    KA = HEADS_PER_GROUP * D
    shards: dict[str, dict] = {}
    n = g["num_hidden_layers"]
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        t: dict = {}
        p = f"layers.{i}."
        if i == 0:
            t["embed.weight"] = ("BF16", [128, hid], bf16_bits(rng.standard_normal((128, hid)) * 0.02))
        # out of scope: the loader must ignore these
        t[p + "attn_norm.weight"] = ("BF16", [hid], bf16_bits(1 + 0.1 * rng.standard_normal(hid)))
        t[p + "attn.wq_a.weight"] = ("F8_E4M3", [K, hid], e4m3_random(rng, (K, hid)))
        t[p + "attn.wq_a.scale"] = ("F8_E8M0", [K // 32, hid // 32], e8m0_random(rng, (K // 32, hid // 32)))
        t[p + "attn.wkv.weight"] = ("F8_E4M3", [D, hid], e4m3_random(rng, (D, hid)))
        t[p + "attn.wkv.scale"] = ("F8_E8M0", [D // 32, hid // 32], e8m0_random(rng, (D // 32, hid // 32)))
        t[p + "attn.q_norm.weight"] = ("BF16", [K], bf16_bits(1 + 0.1 * rng.standard_normal(K)))
        # in scope
        t[p + "attn.wq_b.weight"] = ("F8_E4M3", [H * D, K], e4m3_random(rng, (H * D, K)))
        t[p + "attn.wq_b.scale"] = ("F8_E8M0", [H * D // 32, K // 32], e8m0_random(rng, (H * D // 32, K // 32)))
        t[p + "attn.wo_a.weight"] = ("F8_E4M3", [G * OL, KA], e4m3_random(rng, (G * OL, KA)))
        t[p + "attn.wo_a.scale"] = ("F8_E8M0", [G * OL // 32, KA // 32], e8m0_random(rng, (G * OL // 32, KA // 32)))
        t[p + "attn.wo_b.weight"] = ("F8_E4M3", [hid, G * OL], e4m3_random(rng, (hid, G * OL)))
        t[p + "attn.wo_b.scale"] = ("F8_E8M0", [hid // 32, G * OL // 32], e8m0_random(rng, (hid // 32, G * OL // 32)))
        t[p + "attn.attn_sink"] = ("F32", [H], rng.standard_normal(H).astype("<f4"))
        shards[fname] = t
    write_checkpoint(root, g, shards, fp8=True, write_index=True)


def bf16_weight(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def plant_special_blocks(x: np.ndarray, rng: np.random.Generator, where: list[tuple[int, int, str]]) -> None:
    """Overwrite 32-blocks (row, block index) of a float32 weight with edge cases (all values
    exactly representable in BF16)."""
    for row, b, kind in where:
        blk = x[row, b * 32 : (b + 1) * 32]
        base = bf16_to_f32(bf16_bits(np.clip(rng.standard_normal(32) * 0.01, -0.03, 0.03)))
        if kind.startswith("pow2-"):  # amax exactly 448 * 2^-k
            k = int(kind[5:])
            blk[:] = base * 2.0 ** (13 - k)
            blk[3] = 448 * 2.0**-k
        elif kind.startswith("negpow2-"):
            k = int(kind[8:])
            blk[:] = base * 2.0 ** (13 - k)
            blk[9] = -448 * 2.0**-k
        elif kind == "zero":
            blk[:] = 0.0
        elif kind.startswith("460-"):  # rceil and floor differ: 460*2^-k
            k = int(kind[4:])
            blk[:] = base * 2.0 ** (13 - k)
            blk[11] = 460 * 2.0**-k
        elif kind == "ties":  # amax 448*2^-13 -> scale 2^-13 under both rules; RNE ties + -0
            blk[:] = base
            blk[0] = 448 * 2.0**-13
            blk[1] = 17 * 2.0**-13  # -> 16
            blk[2] = 19 * 2.0**-13  # -> 20
            blk[3] = -17 * 2.0**-13  # -> -16
            blk[4] = 2.0**-10 * 2.0**-13  # half the smallest subnormal -> +0
            blk[5] = 3 * 2.0**-10 * 2.0**-13  # -> 2^-8
            blk[6] = -1.0 * 2.0**-20 * 2.0**-13  # tiny negative -> -0 (0x80)
            blk[7] = 300 * 2.0**-13  # -> 288
            blk[8] = 464 * 2.0**-14  # 232 -> 224 (tie between 224 and 240, even)
        else:
            raise ValueError(kind)
    assert np.array_equal(x, bf16_to_f32(bf16_bits(x))), "planted values must be exact in BF16"


def build_bf16(root: Path) -> None:
    g = dict(MICRO)
    g["num_hidden_layers"] = 1
    rng = np.random.default_rng(20260402)
    H, D, K, G, OL, hid = (g[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                                         "o_lora_rank", "hidden_size"))
    KA = HEADS_PER_GROUP * D
    t: dict = {}
    t["embed.weight"] = ("BF16", [128, hid], bf16_bits(rng.standard_normal((128, hid)) * 0.02))
    p = "layers.0."
    t[p + "attn_norm.weight"] = ("BF16", [hid], bf16_bits(1 + 0.1 * rng.standard_normal(hid)))
    t[p + "attn.wq_a.weight"] = ("BF16", [K, hid], bf16_bits(bf16_weight(rng, (K, hid))))
    t[p + "attn.wkv.weight"] = ("BF16", [D, hid], bf16_bits(bf16_weight(rng, (D, hid))))

    def bf16_rounded(shape):
        return bf16_to_f32(bf16_bits(bf16_weight(rng, shape))).copy()

    wq_b = bf16_rounded((H * D, K))
    # rows at both TP2 ranks (rank 1 starts at row 4096); wq_b has one block per row
    plant_special_blocks(wq_b, rng, [
        (0, 0, "pow2-13"), (1, 0, "pow2-12"), (2, 0, "460-13"), (3, 0, "zero"), (4, 0, "ties"),
        (5, 0, "negpow2-14"), (517, 0, "460-9"), (4096, 0, "pow2-9"), (4097, 0, "zero"),
        (4098, 0, "460-13"), (8191, 0, "ties"), (6000, 0, "pow2-18"),
    ])
    wo_a = bf16_rounded((G * OL, KA))
    plant_special_blocks(wo_a, rng, [
        (0, 0, "pow2-13"), (0, 1, "460-13"), (0, 16, "zero"), (1, 127, "ties"), (3, 7, "negpow2-12"),
        (33, 0, "460-9"), (33, 5, "zero"), (40, 64, "pow2-11"), (63, 127, "ties"),
    ])
    wo_b = bf16_rounded((hid, G * OL))
    plant_special_blocks(wo_b, rng, [
        (0, 1, "zero"), (1, 0, "460-13"), (2, 1, "pow2-13"), (63, 0, "ties"), (40, 1, "460-9"),
    ])
    t[p + "attn.wq_b.weight"] = ("BF16", [H * D, K], bf16_bits(wq_b))
    t[p + "attn.wo_a.weight"] = ("BF16", [G * OL, KA], bf16_bits(wo_a))
    t[p + "attn.wo_b.weight"] = ("BF16", [hid, G * OL], bf16_bits(wo_b))
    t[p + "attn.attn_sink"] = ("F32", [H], rng.standard_normal(H).astype("<f4"))
    write_checkpoint(root, g, {"model.safetensors": t}, fp8=False, write_index=True)


def self_test() -> None:
    check_permutation_examples()
    check_e4m3_against_ml_dtypes()
    check_scale_table()
    check_swizzle()
    # packing: int32 little-endian of 4 consecutive scale bytes, storage [g][k4][row]
    s = np.arange(2 * 32 * 128, dtype=np.int64).reshape(64, 128) % 251
    s = s.astype(np.uint8)
    packed = pack_wo_a_scale(s, 2, 32).view("<i4").reshape(2, 32, 32)  # [g][k4][row]
    for gg, k4, row in [(0, 0, 0), (1, 5, 7), (1, 31, 31), (0, 3, 30)]:
        want = int.from_bytes(bytes(s[gg * 32 + row, 4 * k4 : 4 * k4 + 4].tolist()), "little", signed=True)
        assert packed[gg, k4, row] == want
    # the Q permutation commutes with a GEMM bit for bit and MXFP8 of permuted rows == permuted MXFP8
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((8 * 512, 64)) * 0.02).astype(np.float32)
    perm = q_permutation(8)
    for rule in ("rceil", "floor"):
        q1, s1 = mxfp8_quantize(x, rule)
        q2, s2 = mxfp8_quantize(x[perm], rule)
        assert (q1[perm] == q2).all() and (s1[perm] == s2).all()
        y = (rng.standard_normal((4, 4096)) * 0.02).astype(np.float32)
        op = o_permutation()
        qa, sa = mxfp8_quantize(y, rule)
        qb, sb = mxfp8_quantize(y[:, op], rule)
        assert (qa[:, op] == qb).all() and (sa[:, o_chunk_permutation()] == sb).all()


def generate(fixtures: Path) -> dict[Path, dict]:
    roots = {fixtures / FP8_NAME: build_fp8, fixtures / BF16_NAME: build_bf16}
    docs = {}
    for root, build in roots.items():
        build(root)
        doc = expected_document(root)
        (root / "expected.json").write_text(dump_json(doc))
        docs[root] = doc
    return docs


def write_dump(out: Path, checkpoint: Path, tp: int, rank: int, rule: str, layout: str, as_rank: int | None) -> Path:
    """OUT/rank{rank}.safetensors with the kernel tensors of `as_rank` (default: `rank`)."""
    tensors: dict = {}
    expected_case(Checkpoint(checkpoint), tp, rank if as_rank is None else as_rank, rule, layout, tensors)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.safetensors"
    write_safetensors(path, {name: (dtype, shape, data) for name, (dtype, shape, data) in tensors.items()})
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", type=Path, default=FIXTURES, help="output folder (default tests/fixtures)")
    ap.add_argument("--check", action="store_true", help="regenerate in a temp dir and compare with --fixtures")
    ap.add_argument("--self-test", action="store_true", help="only run the spec asserts")
    ap.add_argument("--expected", type=Path, metavar="DIR", help="print expected.json for checkpoint DIR")
    ap.add_argument("--tp", type=int, nargs="+", help="with --expected: TP sizes (default: all valid)")
    ap.add_argument("--rules", nargs="+", choices=["rceil", "floor"], help="with --expected: scale rules")
    ap.add_argument("--dump", type=Path, metavar="OUT", help="write OUT/rank{R}.safetensors (see --checkpoint, --rank)")
    ap.add_argument("--checkpoint", type=Path, help="with --dump: the checkpoint directory")
    ap.add_argument("--rank", type=int, default=0, help="with --dump: the rank")
    ap.add_argument("--layout", choices=LAYOUTS, default="expected", help="with --dump: the kernel layout")
    ap.add_argument("--as-rank", type=int, help="with --dump: write this rank's tensors instead")
    args = ap.parse_args()
    if args.dump:
        tp = (args.tp or [1])[0]
        rule = (args.rules or ["rceil"])[0]
        print(write_dump(args.dump, args.checkpoint, tp, args.rank, rule, args.layout, args.as_rank))
        return 0

    self_test()
    if args.self_test:
        print("self-test passed")
        return 0
    if args.expected:
        sys.stdout.write(dump_json(expected_document(args.expected, args.tp, args.rules)))
        return 0
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            bad = 0
            for name in (FP8_NAME, BF16_NAME):
                new_dir, old_dir = Path(tmp) / name, args.fixtures / name
                new = sorted(p.name for p in new_dir.iterdir())
                old = sorted(p.name for p in old_dir.iterdir()) if old_dir.exists() else []
                if new != old:
                    print(f"{name}: file list differs: {old} vs regenerated {new}")
                    bad += 1
                for f in new:
                    if (old_dir / f).exists() and (old_dir / f).read_bytes() != (new_dir / f).read_bytes():
                        print(f"{name}/{f}: differs from the regenerated file")
                        bad += 1
            print("fixtures match the generator" if not bad else f"{bad} difference(s)")
            return 1 if bad else 0
    docs = generate(args.fixtures)
    for root, doc in docs.items():
        size = sum(p.stat().st_size for p in root.iterdir())
        print(f"{root.relative_to(REPO_ROOT) if root.is_relative_to(REPO_ROOT) else root}: "
              f"{len(doc['cases'])} cases, {size} bytes")
        for c in doc["cases"]:
            print(f"  tp={c['tp']} rank={c['rank']} rule={c['scale_rule']} "
                  f"kernel={c['kernel_rank_digest']} source={c['source_rank_digest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
