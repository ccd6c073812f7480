//! Whole-checkpoint validation for `orchestrator checkpoint inspect`: every in-scope tensor is
//! present with the spec's dtype and shape, and its values are legal (no NaN scale bytes, no
//! NaN E4M3 bytes, no NaN or infinite BF16 / F32 values).

use serde::Serialize;

use orchestrator_kernels::{bf16, e4m3, e8m0};
use safetensors::Dtype;

use crate::ModelError;
use crate::checkpoint::Checkpoint;
use crate::names::{TensorSpec, checkpoint_tensors};
use crate::plan::valid_tp_sizes;

#[derive(Clone, Debug, Serialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: usize,
    pub file: Option<String>,
    /// `ok`, or the problem.
    pub status: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Inspection {
    pub dir: String,
    pub family: String,
    pub geometry: crate::Geometry,
    pub format: String,
    pub valid_tp_sizes: Vec<usize>,
    pub tensors: Vec<TensorEntry>,
    /// Tensors in the checkpoint this project does not load (`wq_a`, norms, MoE, ...).
    pub other_tensors: usize,
    pub in_scope_bytes: usize,
    pub problems: Vec<String>,
    pub valid: bool,
}

/// The element index of the first value `dtype` calls illegal in `bytes`, and what it is.
fn first_illegal_at(dtype: Dtype, bytes: &[u8]) -> Option<(usize, &'static str)> {
    match dtype {
        Dtype::F8_E8M0 => e8m0::find_nan(bytes).map(|i| (i, "NaN scale byte 0xFF")),
        Dtype::F8_E4M3 => e4m3::find_nan(bytes).map(|i| (i, "NaN E4M3 byte")),
        Dtype::BF16 => bf16::find_non_finite(bytes).map(|i| (i, "NaN or infinite BF16 value")),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .position(|p| !f32::from_le_bytes([p[0], p[1], p[2], p[3]]).is_finite())
            .map(|i| (i, "NaN or infinite F32 value")),
        _ => None,
    }
}

/// XXH3-64 of a tensor's stored bytes ([`orchestrator_kernels::Digest::of`]) and its first
/// illegal value as [`first_illegal_at`] finds it, in one pass: each 256 KiB is checked, then
/// hashed, while it is in cache (what a checkpoint's content version and its inspection both
/// read, read once).
pub(crate) fn digest_checked(dtype: Dtype, bytes: &[u8]) -> (orchestrator_kernels::Digest, Option<(usize, &'static str)>) {
    const CHUNK: usize = 256 * 1024;
    let element = match dtype {
        Dtype::BF16 => 2,
        Dtype::F32 => 4,
        _ => 1,
    };
    let mut hasher = orchestrator_kernels::digest::DigestStream::new();
    let mut found = None;
    for (i, chunk) in bytes.chunks(CHUNK).enumerate() {
        if found.is_none() {
            found = first_illegal_at(dtype, chunk).map(|(at, what)| (i * CHUNK / element + at, what));
        }
        hasher.update(chunk);
    }
    (hasher.finish(), found)
}

/// Checks one tensor fully (dtype, shape, values); its values as the pass that hashed the
/// checkpoint found them where one did ([`Checkpoint::checked_values`]).
pub fn check_tensor(ck: &Checkpoint, spec: &TensorSpec) -> Result<(), ModelError> {
    let (shard, range) = ck.tensor_bytes(spec)?;
    // The pass that hashed the checkpoint's content checked the values already, where one did.
    let illegal = match ck.checked_values(&spec.name) {
        Some(found) => found,
        None => {
            let bytes = shard.bytes(&spec.name).unwrap_or(&[]);
            debug_assert_eq!(bytes.len(), range.len());
            first_illegal_at(spec.dtype, bytes)
        }
    };
    let cols = spec.cols().max(1);
    if let Some((row, col)) = illegal.map(|(at, _)| (at / cols, at % cols)) {
        let file = shard.path.clone();
        let tensor = spec.name.clone();
        return Err(if spec.dtype == Dtype::F8_E8M0 {
            ModelError::NanScale { file, tensor, row, col }
        } else {
            ModelError::NonFinite { file, tensor, row, col }
        });
    }
    Ok(())
}

/// Inspects a checkpoint.
pub fn inspect(ck: &Checkpoint) -> Inspection {
    let cfg = &ck.config;
    let specs = checkpoint_tensors(&cfg.geometry, cfg.format);
    // Every tensor's values are read: on all cores, the problems then listed in tensor order.
    let checked: Vec<Result<(), String>> = {
        use rayon::prelude::*;
        specs.par_iter().map(|spec| check_tensor(ck, spec).map_err(|e| e.to_string())).collect()
    };
    let mut problems = Vec::new();
    let mut tensors = Vec::with_capacity(specs.len());
    for (spec, checked) in specs.iter().zip(checked) {
        let file = ck.weight_map().get(&spec.name).cloned();
        let status = match checked {
            Ok(()) => "ok".to_string(),
            Err(e) => {
                problems.push(e.clone());
                e
            }
        };
        tensors.push(TensorEntry {
            name: spec.name.clone(),
            dtype: format!("{:?}", spec.dtype),
            shape: spec.shape.clone(),
            bytes: spec.bytes(),
            file,
            status,
        });
    }
    let in_scope: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    let other_tensors = ck.weight_map().keys().filter(|k| !in_scope.contains(k.as_str())).count();
    Inspection {
        dir: ck.dir().display().to_string(),
        family: format!("{:?}", cfg.family),
        geometry: cfg.geometry.clone(),
        format: match cfg.format {
            crate::WeightFormat::Fp8 { block: [a, b] } => format!("fp8 e4m3, ue8m0 {a}x{b} block scales"),
            crate::WeightFormat::Bf16 => "bf16".to_string(),
        },
        valid_tp_sizes: valid_tp_sizes(&cfg.geometry),
        in_scope_bytes: specs.iter().map(|s| s.bytes()).sum(),
        tensors,
        other_tensors,
        valid: problems.is_empty(),
        problems,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One pass gives the digest of the whole tensor and the first illegal value's index, for
    /// every checked dtype, wherever the value lies against the 256 KiB steps (both sides of a
    /// step, the first and the last element) and wherever there are two.
    #[test]
    fn the_one_pass_digest_and_check_are_the_whole_tensors() {
        const STEP: usize = 256 * 1024;
        let illegal: [(Dtype, usize, &[u8]); 4] = [
            (Dtype::F8_E4M3, 1, &[0x7F]),
            (Dtype::F8_E8M0, 1, &[0xFF]),
            (Dtype::BF16, 2, &[0x80, 0x7F]),
            (Dtype::F32, 4, &[0x00, 0x00, 0xC0, 0x7F]),
        ];
        for (dtype, size, bad) in illegal {
            let len = 3 * STEP + 5 * size;
            // Legal values: small numbers in every dtype (byte 0x11 keeps each exponent low).
            let clean = vec![0x11u8; len];
            let (digest, found) = digest_checked(dtype, &clean);
            assert_eq!((digest, found), (orchestrator_kernels::Digest::of(&clean), None), "{dtype:?}");
            let n = len / size;
            let spots = [0, STEP / size - 1, STEP / size, STEP / size + 1, 2 * STEP / size + 3, n - 1];
            for &at in &spots {
                for second in [None, Some(n - 1)] {
                    let mut bytes = clean.clone();
                    for i in [Some(at), second].into_iter().flatten().filter(|&i| i >= at) {
                        bytes[i * size..(i + 1) * size].copy_from_slice(bad);
                    }
                    let (digest, found) = digest_checked(dtype, &bytes);
                    assert_eq!(digest, orchestrator_kernels::Digest::of(&bytes), "{dtype:?} at {at}");
                    assert_eq!(found.map(|(i, _)| i), Some(at), "{dtype:?} at {at}, then {second:?}");
                    assert_eq!(found, first_illegal_at(dtype, &bytes), "{dtype:?} at {at}");
                }
            }
        }
    }
}
