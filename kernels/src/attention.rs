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

/// Attention of one query head over `s` latents `kv [s, d]` with softmax scale `scale` and
/// sink logit `sink`: the softmax denominator gets an extra `exp(sink - max)`. Returns `[d]`.
pub fn attend(q: &[f32], kv: &[f32], d: usize, scale: f32, sink: f32) -> Vec<f32> {
    let s = kv.len() / d.max(1);
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
    debug_assert_eq!(weights.len(), s);
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
