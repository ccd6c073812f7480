//! Whole-checkpoint validation for `orchestrator checkpoint inspect`: every in-scope tensor is
//! present with the spec's dtype and shape, and its values are legal (no NaN scale bytes, no
//! NaN E4M3 bytes, no NaN or infinite BF16 / F32 values).

use serde::Serialize;

use orchestrator_kernels::{e4m3, e8m0};
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

/// The first illegal value of a tensor's bytes, as `[row, col]` of its row-major view.
fn first_illegal(spec: &TensorSpec, bytes: &[u8]) -> Option<(usize, usize, &'static str)> {
    let cols = spec.cols().max(1);
    let at = |i: usize| (i / cols, i % cols);
    match spec.dtype {
        Dtype::F8_E8M0 => e8m0::find_nan(bytes).map(|i| (at(i).0, at(i).1, "NaN scale byte 0xFF")),
        Dtype::F8_E4M3 => e4m3::find_nan(bytes).map(|i| (at(i).0, at(i).1, "NaN E4M3 byte")),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .position(|p| u16::from_le_bytes([p[0], p[1]]) & 0x7F80 == 0x7F80)
            .map(|i| (at(i).0, at(i).1, "NaN or infinite BF16 value")),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .position(|p| !f32::from_le_bytes([p[0], p[1], p[2], p[3]]).is_finite())
            .map(|i| (at(i).0, at(i).1, "NaN or infinite F32 value")),
        _ => None,
    }
}

/// Checks one tensor fully (dtype, shape, values).
pub fn check_tensor(ck: &Checkpoint, spec: &TensorSpec) -> Result<(), ModelError> {
    let (shard, range) = ck.tensor_bytes(spec)?;
    let bytes = shard.bytes(&spec.name).unwrap_or(&[]);
    debug_assert_eq!(bytes.len(), range.len());
    if let Some((row, col, _)) = first_illegal(spec, bytes) {
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
