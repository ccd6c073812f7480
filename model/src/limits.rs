//! Every size limit in one place. An input (a `config.json`, an index, a safetensors header,
//! a cluster or probe request) over one of these is refused with an error naming the field and
//! the limit before anything is allocated for it, so a hostile or corrupt input cannot make the
//! process spin, overflow an index or abort on an impossible allocation.
//!
//! The limits are far above every real model (DeepSeek-V4-Pro: 61 layers, 128 heads in 16
//! `o_groups`, hidden 7168, TP up to 16), and chosen so that every product the code forms from
//! values that pass them (`heads * head_dim`, `o_groups * o_lora_rank`, a tensor's byte size,
//! the whole checkpoint's in-scope bytes) fits a 64-bit `usize` with room to spare; those
//! products are still formed with checked arithmetic.

use crate::geometry::{Geometry, HEADS_PER_GROUP};

/// Decoder layers (`num_hidden_layers`). Real models: 40 to 61 (+ draft layers).
pub const MAX_LAYERS: usize = 1024;
/// Attention heads (`num_attention_heads`). Real models: 64 or 128.
pub const MAX_HEADS: usize = 1024;
/// `o_groups`: at most one group per 8 heads.
pub const MAX_O_GROUPS: usize = MAX_HEADS / HEADS_PER_GROUP;
/// `hidden_size`. Real models: 4096 to 7168.
pub const MAX_HIDDEN: usize = 65536;
/// `q_lora_rank` and `o_lora_rank`. Real models: 1024 to 1536.
pub const MAX_LORA_RANK: usize = 65536;
/// One side of an FP8 `weight_block_size`. Real models: 32 or 128.
pub const MAX_BLOCK: usize = 4096;
/// Tensor-parallel size. Real deployments: 1 to 16.
pub const MAX_TP: usize = 128;
/// Ranks in a cluster (`tp * dp`).
pub const MAX_WORLD_SIZE: usize = 4096;
/// Workers one `launch` may start on one host.
pub const MAX_LOCAL_WORKERS: usize = 64;
/// Bytes of a `config.json` read into memory (real ones: a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Bytes of a `model.safetensors.index.json` read into memory (real ones: a few MiB).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// Bytes of a safetensors JSON header (the `safetensors` crate's own limit: 100 MB).
pub const MAX_HEADER_BYTES: usize = 100_000_000;
/// Dimensions of one tensor in a safetensors header (real tensors: at most 5).
pub const MAX_TENSOR_DIMS: usize = 8;
/// Entries of a safetensors header's `__metadata__` map (real ones: one, `format`).
pub const MAX_HEADER_METADATA_ENTRIES: usize = 1024;
/// Probe tokens `T`.
pub const MAX_PROBE_TOKENS: usize = 4096;
/// Probe latents `S`.
pub const MAX_PROBE_LATENTS: usize = 65536;
/// `T * S`: the score matrix of one head, the largest probe buffer per head.
pub const MAX_PROBE_ELEMENTS: usize = 1 << 28;

/// Bytes of f32 values one probe holds on one rank ([`probe_bytes`]): the sizes above bound each
/// dimension, this bounds what a probe keeps across the layers (real probes: T = 2 to 16 keep
/// about 50 to 400 MiB on DeepSeek-V4-Pro at TP 1; T = 4096 would keep 39.5 GB on dsv41-flash at
/// TP 1).
pub const MAX_PROBE_BYTES: usize = 4 << 30;

/// A value over a limit, or a product that overflows.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("{what} is {value}, over the limit of {limit}")]
    TooLarge { what: &'static str, value: usize, limit: usize },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("{what} overflows: {detail}")]
    Overflow { what: &'static str, detail: String },
}

/// `value <= limit`, or [`LimitError::TooLarge`] naming `what`.
pub fn check(what: &'static str, value: usize, limit: usize) -> Result<usize, LimitError> {
    if value > limit { Err(LimitError::TooLarge { what, value, limit }) } else { Ok(value) }
}

/// `a * b` or [`LimitError::Overflow`] naming `what`.
pub fn mul(what: &'static str, a: usize, b: usize) -> Result<usize, LimitError> {
    a.checked_mul(b).ok_or_else(|| LimitError::Overflow { what, detail: format!("{a} * {b}") })
}

/// Checks a probe size: `1 <= tokens <= MAX_PROBE_TOKENS`, `1 <= latents <= MAX_PROBE_LATENTS`
/// and `tokens * latents <= MAX_PROBE_ELEMENTS` (checked). Returns `tokens * latents`.
pub fn check_probe(tokens: usize, latents: usize) -> Result<usize, LimitError> {
    if tokens == 0 {
        return Err(LimitError::Zero { what: "probe tokens" });
    }
    if latents == 0 {
        return Err(LimitError::Zero { what: "probe latents" });
    }
    check("probe tokens", tokens, MAX_PROBE_TOKENS)?;
    check("probe latents", latents, MAX_PROBE_LATENTS)?;
    check("probe tokens * latents", mul("probe tokens * latents", tokens, latents)?, MAX_PROBE_ELEMENTS)
}

/// The bytes of f32 values a probe of `tokens x latents` holds on one rank of TP size `tp` over
/// `layers` layers of `g`, at most: per token, every layer's reference output kept (`q`, `z`
/// and the partial `y`: the reference a version keeps), one layer's kernel and reference passes
/// at a time (`q`, the attention output `o` of `q`'s size, `z`, `y` each), and the partial `y`
/// of every layer once more for the all-reduce, once per rank of the ring; and the latents.
/// Checked arithmetic; `tp` is at least 1.
pub fn probe_bytes(g: &Geometry, layers: usize, tp: usize, tokens: usize, latents: usize) -> Result<usize, LimitError> {
    let what = "probe working set (bytes)";
    let tp = tp.max(1);
    let q = mul(what, g.heads.div_ceil(tp), g.head_dim)?;
    let z = mul(what, g.o_groups.div_ceil(tp), g.o_lora_rank)?;
    let y = g.hidden;
    let output = q.checked_add(z).and_then(|v| v.checked_add(y));
    let pass = output.and_then(|v| v.checked_add(q));
    let per_token = output
        .and_then(|o| o.checked_mul(layers))
        .and_then(|kept| pass.and_then(|p| p.checked_mul(2)).and_then(|p| p.checked_add(kept)))
        .and_then(|v| y.checked_mul(layers)?.checked_mul(tp.checked_add(1)?)?.checked_add(v))
        .ok_or_else(|| LimitError::Overflow { what, detail: format!("{layers} layers of {g:?} at TP {tp}") })?;
    let values = mul(what, per_token, tokens)?
        .checked_add(mul(what, latents, g.head_dim)?)
        .ok_or_else(|| LimitError::Overflow { what, detail: format!("{tokens} tokens, {latents} latents") })?;
    mul(what, values, 4)
}

/// [`check_probe`], and the probe's [`probe_bytes`] on a rank of TP size `tp` over `layers`
/// layers of `g` at most [`MAX_PROBE_BYTES`]. Returns the bytes.
pub fn check_probe_on(g: &Geometry, layers: usize, tp: usize, tokens: usize, latents: usize) -> Result<usize, LimitError> {
    check_probe(tokens, latents)?;
    check("probe working set (bytes)", probe_bytes(g, layers, tp, tokens, latents)?, MAX_PROBE_BYTES)
}

/// Checks a cluster shape: `1 <= tp <= MAX_TP`, `dp >= 1`, `tp * dp <= MAX_WORLD_SIZE`
/// (checked), and, for a cluster started on this host (`local`), `tp * dp <=
/// MAX_LOCAL_WORKERS`. Returns the world size `tp * dp`.
pub fn check_cluster(tp: usize, dp: usize, local: bool) -> Result<usize, LimitError> {
    if tp == 0 {
        return Err(LimitError::Zero { what: "TP size" });
    }
    if dp == 0 {
        return Err(LimitError::Zero { what: "DP size" });
    }
    check("TP size", tp, MAX_TP)?;
    let world = check("world size (tp * dp)", mul("world size (tp * dp)", tp, dp)?, MAX_WORLD_SIZE)?;
    if local {
        check("local workers (tp * dp)", world, MAX_LOCAL_WORKERS)?;
    }
    Ok(world)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_limits() {
        assert_eq!(check_probe(2, 16), Ok(32));
        assert_eq!(check_probe(MAX_PROBE_TOKENS, MAX_PROBE_LATENTS), Ok(MAX_PROBE_ELEMENTS));
        assert!(matches!(check_probe(0, 1), Err(LimitError::Zero { .. })));
        assert!(matches!(check_probe(1, 0), Err(LimitError::Zero { .. })));
        assert!(matches!(check_probe(MAX_PROBE_TOKENS + 1, 1), Err(LimitError::TooLarge { what: "probe tokens", .. })));
        assert!(matches!(check_probe(1, usize::MAX), Err(LimitError::TooLarge { what: "probe latents", .. })));
    }

    /// The working set counted by hand for one shape, and the limit where real probes and
    /// impossible ones part.
    #[test]
    fn probe_working_set() {
        use crate::Preset;
        let flash = Preset::Dsv41Flash.geometry();
        // dsv41-flash at TP 4: q 16 x 512 = 8192, z 2 x 1024 = 2048, y 5120; per token
        // 40 x 15360 kept + 2 x 23552 passes + 40 x 5120 x 5 all-reduce = 1_685_504 values.
        assert_eq!(probe_bytes(&flash, 40, 4, 1, 1), Ok(4 * (1_685_504 + 512)));
        assert_eq!(probe_bytes(&flash, 40, 4, 16, 128), Ok(4 * (16 * 1_685_504 + 128 * 512)));
        for (p, tp) in [(Preset::Dsv41Flash, 1), (Preset::Dsv41Flash, 8), (Preset::Dsv4Pro, 1), (Preset::Tiny, 1)] {
            let g = p.geometry();
            for (t, s) in [(2, 16), (16, 128), (32, 1024)] {
                assert!(check_probe_on(&g, g.layers, tp, t, s).is_ok(), "{p:?} TP {tp}: T = {t}, S = {s}");
            }
            assert!(
                matches!(
                    check_probe_on(&g, g.layers, tp, MAX_PROBE_TOKENS, 1),
                    Err(LimitError::TooLarge { what: "probe working set (bytes)", .. })
                ) || p == Preset::Tiny,
                "{p:?} TP {tp}"
            );
        }
        assert!(matches!(check_probe_on(&flash, 40, 1, 0, 1), Err(LimitError::Zero { .. })));
        assert!(matches!(probe_bytes(&flash, usize::MAX, 1, 1, 1), Err(LimitError::Overflow { .. })));
    }

    #[test]
    fn cluster_limits() {
        assert_eq!(check_cluster(16, 4, true), Ok(64));
        assert_eq!(check_cluster(8, 512, false), Ok(4096));
        assert!(matches!(check_cluster(16, 5, true), Err(LimitError::TooLarge { what: "local workers (tp * dp)", .. })));
        assert!(matches!(check_cluster(8, 513, false), Err(LimitError::TooLarge { .. })));
        assert!(matches!(check_cluster(2, usize::MAX, false), Err(LimitError::Overflow { .. })));
        assert!(matches!(check_cluster(MAX_TP + 1, 1, false), Err(LimitError::TooLarge { what: "TP size", .. })));
        assert!(matches!(check_cluster(0, 1, false), Err(LimitError::Zero { .. })));
        assert!(matches!(check_cluster(1, 0, false), Err(LimitError::Zero { .. })));
    }
}
