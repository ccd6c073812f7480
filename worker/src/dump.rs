//! `--dump`: every kernel-visible tensor of a rank, in storage order, under its parameter name,
//! as `OUT/rank{R}.safetensors`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use orchestrator_kernels::{Backend, KernelError};
use orchestrator_model::names::kernel_name;
use orchestrator_model::{Param, Part};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use crate::loader::RankWeights;

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("reading tensor `{tensor}` back from the device: {source}")]
    Download { tensor: String, source: KernelError },
    #[error("writing {path}: {why}")]
    Write { path: PathBuf, why: String },
}

fn parse_dtype(name: &str) -> Dtype {
    match name {
        "F8_E4M3" => Dtype::F8_E4M3,
        "F8_E8M0" => Dtype::F8_E8M0,
        "I32" => Dtype::I32,
        _ => Dtype::F32,
    }
}

/// Writes `dir/rank{R}.safetensors`; returns its path.
pub fn dump_rank<B: Backend>(backend: &B, weights: &RankWeights<B>, dir: &Path) -> Result<PathBuf, DumpError> {
    let path = dir.join(format!("rank{}.safetensors", weights.shard.rank));
    let werr = |why: String| DumpError::Write { path: path.clone(), why };
    std::fs::create_dir_all(dir).map_err(|e| werr(e.to_string()))?;
    let mut host: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in &weights.layers {
        let by_name: HashMap<&str, _> = layer.kernel.iter().map(|d| (d.name.as_str(), d)).collect();
        let mut push = |name: String, buf: &B::Buffer| -> Result<(), DumpError> {
            let mut bytes = Vec::new();
            backend.download(buf, &mut bytes).map_err(|source| DumpError::Download { tensor: name.clone(), source })?;
            let d = by_name[name.as_str()];
            host.push((name, parse_dtype(&d.dtype), d.shape.clone(), bytes));
            Ok(())
        };
        for (param, kt) in [(Param::WqB, &layer.wq_b), (Param::WoA, &layer.wo_a), (Param::WoB, &layer.wo_b)] {
            push(kernel_name(layer.layer, param, Part::Weight), &kt.weight)?;
            push(kernel_name(layer.layer, param, Part::Scale), &kt.scale)?;
        }
        push(kernel_name(layer.layer, Param::AttnSink, Part::Weight), &layer.attn_sink)?;
    }
    let views = host
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes).map(|v| (name.clone(), v)).map_err(|e| werr(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta: HashMap<String, String> = [
        ("format".to_string(), "orchestrator-kernel-layout".to_string()),
        ("layout_identity".to_string(), weights.identity.digest.clone()),
        ("tp_size".to_string(), weights.shard.tp_size.to_string()),
        ("rank".to_string(), weights.shard.rank.to_string()),
    ]
    .into();
    safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| werr(e.to_string()))?;
    Ok(path)
}
