//! The attention core of the probe forward pass (spec section 8): RoPE on the last 64 dims of
//! each head (interleaved pairs, theta 10000), MQA attention of every head over one shared
//! latent (the same vector is K and V), softmax with a per-head sink, and the inverse RoPE on
//! the output. Plain f32, in a fixed order, so every rank and every layout agrees bit for bit.

/// RoPE base.
pub const ROPE_THETA: f32 = 10_000.0;

/// Rotates the interleaved pairs `(2i, 2i+1)` of `x` (the rope dims of one head) by position
/// `pos`; `inverse` applies the conjugate rotation.
pub fn rope(x: &mut [f32], pos: usize, inverse: bool) {
    let dims = x.len();
    for i in 0..dims / 2 {
        let freq = ROPE_THETA.powf(-((2 * i) as f32) / dims as f32);
        let angle = pos as f32 * freq;
        let (sin, cos) = angle.sin_cos();
        let sin = if inverse { -sin } else { sin };
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * cos - b * sin;
        x[2 * i + 1] = a * sin + b * cos;
    }
}

/// The latents `kv [s, d]` also stored by column (`[d, s]`), built once per probe layer and
/// shared by every (token, head): with a query's dot products with all `s` latents summed side
/// by side over `d`, each sum still adds its products in increasing `d` (the same bits as one
/// sum at a time), but the sums are independent and vectorize, where one sum at a time waits
/// on the previous add for each of its `d` products.
pub struct Latents<'a> {
    kv: &'a [f32],
    d: usize,
    s: usize,
    columns: Vec<f32>,
}

impl<'a> Latents<'a> {
    /// `kv [s, d]` row-major (a trailing partial row is ignored, as `chunks_exact` would; no
    /// latents at all when `d` is 0).
    pub fn new(kv: &'a [f32], d: usize) -> Self {
        let s = kv.len().checked_div(d).unwrap_or(0);
        let mut columns = vec![0f32; s * d];
        for (j, row) in kv.chunks_exact(d.max(1)).take(s).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                columns[i * s + j] = x;
            }
        }
        Self { kv, d, s, columns }
    }
}

/// Attention of one query head over `s` latents `kv [s, d]` with softmax scale `scale` and
/// sink logit `sink`: the softmax denominator gets an extra `exp(sink - max)`. Returns `[d]`.
pub fn attend(q: &[f32], kv: &[f32], d: usize, scale: f32, sink: f32) -> Vec<f32> {
    attend_latents(q, &Latents::new(kv, d), scale, sink)
}

/// [`attend`] over latents already laid out by [`Latents::new`]. Each logit is
/// `(((0 + q0 k0) + q1 k1) + ...) * scale`, every product and sum rounded, in increasing `d`.
pub fn attend_latents(q: &[f32], latents: &Latents<'_>, scale: f32, sink: f32) -> Vec<f32> {
    let Latents { kv, d, s, ref columns } = *latents;
    let mut logits = vec![0f32; s];
    if s > 0 {
        for (&qi, column) in q.iter().take(d).zip(columns.chunks_exact(s)) {
            for (l, &k) in logits.iter_mut().zip(column) {
                *l += qi * k;
            }
        }
    }
    for l in &mut logits {
        *l *= scale;
    }
    let max = logits.iter().copied().fold(sink, f32::max);
    let weights: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let denom = weights.iter().fold((sink - max).exp(), |acc, w| acc + w);
    let mut out = vec![0f32; d];
    for (w, v) in weights.iter().zip(kv.chunks_exact(d.max(1))) {
        let p = w / denom;
        for (o, x) in out.iter_mut().zip(v) {
            *o += p * x;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_then_inverse_is_identity_up_to_rounding_and_rotates() {
        let orig: Vec<f32> = (0..64).map(|i| i as f32 * 0.1 - 3.0).collect();
        let mut x = orig.clone();
        rope(&mut x, 7, false);
        assert_ne!(x, orig);
        // Pair 0 turns by 7 radians.
        let (s, c) = 7f32.sin_cos();
        assert!((x[0] - (orig[0] * c - orig[1] * s)).abs() < 1e-6);
        rope(&mut x, 7, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
        let mut y = orig.clone();
        rope(&mut y, 0, false);
        assert_eq!(y, orig, "position 0 does not rotate");
    }

    /// The attention as it was written first: one dot product at a time.
    fn attend_one_sum_at_a_time(q: &[f32], kv: &[f32], d: usize, scale: f32, sink: f32) -> Vec<f32> {
        let logits: Vec<f32> = kv.chunks_exact(d).map(|k| q.iter().zip(k).fold(0f32, |acc, (a, b)| acc + a * b) * scale).collect();
        let max = logits.iter().copied().fold(sink, f32::max);
        let weights: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
        let denom = weights.iter().fold((sink - max).exp(), |acc, w| acc + w);
        let mut out = vec![0f32; d];
        for (w, v) in weights.iter().zip(kv.chunks_exact(d)) {
            let p = w / denom;
            for (o, x) in out.iter_mut().zip(v) {
                *o += p * x;
            }
        }
        out
    }

    proptest::proptest! {
        /// Summing the logits side by side gives the bits of summing them one at a time, for
        /// any latent count and width (the probe's are 512 wide), with values of mixed
        /// magnitude below 2 (logits of a few units, so that no softmax weight saturates and
        /// every logit's bits reach the output).
        #[test]
        fn latents_side_by_side_are_the_one_at_a_time_bits(
            s in 0usize..40,
            d in 1usize..70,
            seed in 0u64..u64::MAX,
            sink in -4f32..4.0,
        ) {
            let bytes = crate::testdata::splitmix_bytes(4 * (s * d + d), seed);
            let vals: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| (i16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0) * 2f32.powi(i32::from(b[2] % 6) - 4))
                .collect();
            let (q, kv) = vals.split_at(d);
            let scale = (d as f32).powf(-0.5);
            let want = attend_one_sum_at_a_time(q, kv, d, scale, sink);
            let got = attend(q, kv, d, scale, sink);
            proptest::prop_assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn zero_width_heads_attend_to_nothing() {
        assert_eq!(attend(&[], &[1.0, 2.0], 0, 1.0, 0.0), Vec::<f32>::new());
    }

    #[test]
    fn sink_takes_probability_mass() {
        let kv = vec![1.0f32, 0.0, 0.0, 1.0]; // two latents of dim 2
        let q = [0.0f32, 0.0];
        let no_sink = attend(&q, &kv, 2, 1.0, f32::NEG_INFINITY);
        assert_eq!(no_sink, vec![0.5, 0.5]);
        // A sink of logit 0 equals a third latent of zeros.
        let with_sink = attend(&q, &kv, 2, 1.0, 0.0);
        assert!((with_sink[0] - 1.0 / 3.0).abs() < 1e-6);
    }
}
