//! Writing synthetic checkpoints in the Hugging Face layout: `config.json`, the index, and
//! shard files of at most `max_shard_bytes`, with values from the counter-based generator.
//! Files are written into a sibling temporary directory and renamed into place, so a
//! checkpoint directory is either complete or absent.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::View;
use serde_json::json;

use crate::ModelError;
use crate::checkpoint::{CONFIG_FILE, INDEX_FILE};
use crate::config::ModelConfig;
use crate::generator::Generator;
use crate::names::{TensorSpec, checkpoint_tensors};

/// Shard files stay below this size (Hugging Face's usual limit).
pub const DEFAULT_MAX_SHARD_BYTES: usize = 2_000_000_000;

/// What to synthesize.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub config: ModelConfig,
    pub seed: u64,
    pub max_shard_bytes: usize,
    /// Recorded in `config.json` under `orchestrator.preset` (provenance only).
    pub preset_name: Option<String>,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct SynthSummary {
    pub dir: PathBuf,
    pub shards: Vec<(String, usize)>,
    pub tensors: usize,
    pub total_bytes: usize,
}

struct Generated<'a> {
    spec: &'a TensorSpec,
    generator: Generator,
}

impl View for Generated<'_> {
    fn dtype(&self) -> Dtype {
        self.spec.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.spec.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.generator.tensor(self.spec))
    }
    fn data_len(&self) -> usize {
        self.spec.bytes()
    }
}

/// Assigns tensors (in order) to shards of at most `max` bytes (a larger tensor gets its own).
fn plan_shards(specs: &[TensorSpec], max: usize) -> Vec<Vec<&TensorSpec>> {
    let mut shards: Vec<Vec<&TensorSpec>> = Vec::new();
    let mut size = 0usize;
    for s in specs {
        if shards.is_empty() || (size + s.bytes() > max && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("a shard was just pushed").push(s);
        size += s.bytes();
    }
    shards
}

/// Writes a synthetic checkpoint into `dir`, which must not exist yet (or be empty).
pub fn write_checkpoint(dir: &Path, opts: &SynthOptions) -> Result<SynthSummary, ModelError> {
    let werr = |path: &Path, why: String| ModelError::Write { path: path.to_path_buf(), why };
    let g = &opts.config.geometry;
    g.validate(opts.config.format.block())?;
    if dir.exists() && std::fs::read_dir(dir).map_err(|e| werr(dir, e.to_string()))?.next().is_some() {
        return Err(werr(dir, "directory exists and is not empty".into()));
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| werr(parent, e.to_string()))?;
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| werr(&tmp, e.to_string()))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| werr(&tmp, e.to_string()))?;
    let result = write_into(&tmp, opts);
    match result {
        Ok(mut summary) => {
            if dir.exists() {
                std::fs::remove_dir(dir).map_err(|e| werr(dir, e.to_string()))?;
            }
            std::fs::rename(&tmp, dir).map_err(|e| werr(dir, e.to_string()))?;
            summary.dir = dir.to_path_buf();
            Ok(summary)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

fn write_into(dir: &Path, opts: &SynthOptions) -> Result<SynthSummary, ModelError> {
    let werr = |path: &Path, why: String| ModelError::Write { path: path.to_path_buf(), why };
    let specs = checkpoint_tensors(&opts.config.geometry, opts.config.format);
    let generator = Generator::new(opts.seed);
    let plan = plan_shards(&specs, opts.max_shard_bytes.max(1));
    let count = plan.len();
    let mut weight_map = BTreeMap::new();
    let mut shards = Vec::new();
    let mut total = 0usize;
    for (i, members) in plan.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
        let path = dir.join(&file);
        let views = members.iter().map(|s| (s.name.clone(), Generated { spec: s, generator }));
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| werr(&path, e.to_string()))?;
        let bytes: usize = members.iter().map(|s| s.bytes()).sum();
        for s in members {
            weight_map.insert(s.name.clone(), file.clone());
        }
        total += bytes;
        shards.push((file, bytes));
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let index_path = dir.join(INDEX_FILE);
    std::fs::write(&index_path, serde_json::to_vec_pretty(&index).expect("JSON values serialize"))
        .map_err(|e| werr(&index_path, e.to_string()))?;
    let provenance = json!({ "synthesized": true, "seed": opts.seed, "preset": opts.preset_name });
    let config = opts.config.to_json(Some(provenance));
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config).expect("JSON values serialize"))
        .map_err(|e| werr(&config_path, e.to_string()))?;
    Ok(SynthSummary { dir: dir.to_path_buf(), shards, tensors: specs.len(), total_bytes: total })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Checkpoint;
    use crate::geometry::{Preset, WeightFormat};

    fn tiny_opts(format: WeightFormat, layers: usize, max_shard_bytes: usize) -> SynthOptions {
        let mut geometry = Preset::Tiny.geometry();
        geometry.layers = layers;
        SynthOptions {
            config: ModelConfig { family: Preset::Tiny.family(), geometry, format },
            seed: 5,
            max_shard_bytes,
            preset_name: Some("tiny".into()),
        }
    }

    #[test]
    fn writes_a_readable_multi_shard_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let opts = tiny_opts(WeightFormat::Fp8 { block: [32, 32] }, 3, 3_000_000);
        let summary = write_checkpoint(&dir, &opts).unwrap();
        assert!(summary.shards.len() >= 2, "{:?}", summary.shards);
        assert!(summary.shards.iter().all(|(_, b)| *b <= 3_000_000));
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.config, opts.config);
        let generator = Generator::new(5);
        for spec in checkpoint_tensors(&opts.config.geometry, opts.config.format) {
            let (shard, range) = ck.tensor_bytes(&spec).unwrap();
            let _ = shard;
            let mut out = Vec::new();
            ck.read_slice(&spec, 0..spec.rows(), 0..spec.cols(), &mut out).unwrap();
            assert_eq!(out.len(), range.len());
            assert_eq!(out, generator.tensor(&spec), "{}", spec.name);
        }
        // The directory must not be overwritten.
        assert!(matches!(write_checkpoint(&dir, &opts), Err(ModelError::Write { .. })));
    }
}
