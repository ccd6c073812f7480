//! Where a rank's checkpoint-order bytes come from: a safetensors checkpoint directory, or the
//! synthetic generator (`dummy` load format). Both hand the pipeline the same thing, a
//! row-major slice of one checkpoint tensor, so every load path runs the same pipeline.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use orchestrator_model::checkpoint::Shard;

use orchestrator_model::{AllowedRoots, Checkpoint, Generator, ModelConfig, ModelError, TensorSpec};

/// A load format with its data.
pub enum LoadSource {
    /// A Hugging Face checkpoint directory, memory-mapped.
    Safetensors(Checkpoint),
    /// Values from the synthetic generator with this seed (what `checkpoint synth` writes).
    Dummy { config: ModelConfig, generator: Generator },
}

impl LoadSource {
    pub fn open_checkpoint(dir: &Path) -> Result<Self, ModelError> {
        Ok(Self::Safetensors(Checkpoint::open(dir)?))
    }

    /// A checkpoint directory every file of which lies under `roots`
    /// ([`Checkpoint::open_within`]).
    pub fn open_checkpoint_within(dir: &Path, roots: &AllowedRoots) -> Result<Self, ModelError> {
        Ok(Self::Safetensors(Checkpoint::open_within(dir, roots)?))
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            LoadSource::Safetensors(c) => &c.config,
            LoadSource::Dummy { config, .. } => config,
        }
    }

    /// `safetensors` or `dummy`.
    pub fn format_name(&self) -> &'static str {
        match self {
            LoadSource::Safetensors(_) => "safetensors",
            LoadSource::Dummy { .. } => "dummy",
        }
    }

    /// A short description: the checkpoint directory, or the generator's seed.
    pub fn describe(&self) -> String {
        match self {
            LoadSource::Safetensors(c) => c.dir().display().to_string(),
            LoadSource::Dummy { generator, .. } => format!("dummy(seed={})", generator.seed),
        }
    }

    /// The checkpoint version, 16 hex digits: for a checkpoint, its content digest over the
    /// in-scope tensors' bytes, dtypes and shapes plus geometry and format, computed once when it
    /// was opened ([`Checkpoint::content_version`]; editing `config.json` afterwards changes
    /// nothing); for a dummy source, XXH3-64 of its configuration and seed.
    pub fn version(&self) -> String {
        match self {
            LoadSource::Safetensors(c) => c.content_version().to_string(),
            LoadSource::Dummy { config, generator } => {
                let text = format!("dummy\n{:?}\n{:?}\nseed={}\n", config.geometry, config.format, generator.seed);
                orchestrator_kernels::Digest::of(text.as_bytes()).hex()
            }
        }
    }

    /// Rows x columns of a tensor: mapped in place when the rows are whole (no copy), otherwise
    /// copied (or generated) into `staging`.
    pub fn fetch(&self, spec: &TensorSpec, rows: Range<usize>, cols: Range<usize>, staging: &mut Vec<u8>) -> Result<Fetched, ModelError> {
        match self {
            LoadSource::Safetensors(c) if cols.start == 0 && cols.end == spec.cols() => {
                let (shard, range) = c.row_range(spec, rows)?;
                Ok(Fetched::Mapped { shard, range })
            }
            _ => self.read(spec, rows, cols, staging).map(|file| Fetched::Staged { file }),
        }
    }

    /// Copies rows x columns of a tensor into `out` (row-major); returns the file it came from.
    pub fn read(
        &self,
        spec: &TensorSpec,
        rows: Range<usize>,
        cols: Range<usize>,
        out: &mut Vec<u8>,
    ) -> Result<Option<PathBuf>, ModelError> {
        match self {
            LoadSource::Safetensors(c) => c.read_slice(spec, rows, cols, out).map(Some),
            LoadSource::Dummy { generator, .. } => {
                generator.slice(spec, rows, cols, out);
                Ok(None)
            }
        }
    }
}

/// A fetched slice: in place in a shard's mapping, or in the caller's staging buffer.
pub enum Fetched {
    Mapped { shard: Arc<Shard>, range: Range<usize> },
    Staged { file: Option<PathBuf> },
}

impl Fetched {
    /// The slice's bytes (`staging` is the buffer passed to [`LoadSource::fetch`]).
    pub fn bytes<'a>(&'a self, staging: &'a [u8]) -> &'a [u8] {
        match self {
            Fetched::Mapped { shard, range } => shard.slice(range.clone()),
            Fetched::Staged { .. } => staging,
        }
    }

    /// The file the bytes came from, if any.
    pub fn file(&self) -> Option<PathBuf> {
        match self {
            Fetched::Mapped { shard, .. } => Some(shard.path.clone()),
            Fetched::Staged { file } => file.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator_model::synth::{SynthOptions, write_checkpoint};
    use orchestrator_model::{Preset, RootsError};

    #[test]
    fn versions_are_content_digests_and_roots_cover_every_file() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let dir = root.join("ckpt");
        let config = ModelConfig::from_preset(Preset::Tiny, Some(1), false).unwrap();
        write_checkpoint(&dir, &SynthOptions { config: config.clone(), seed: 4, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        let source = LoadSource::open_checkpoint_within(&dir, &roots).unwrap();
        let LoadSource::Safetensors(ck) = &source else { unreachable!() };
        assert_eq!(source.version(), ck.content_version());
        assert_eq!(source.version(), LoadSource::open_checkpoint(&dir).unwrap().version());
        // The dummy source keeps its parameter hash.
        let dummy = LoadSource::Dummy { config, generator: Generator::new(4) };
        assert_eq!(dummy.version().len(), 16);
        assert_ne!(dummy.version(), source.version());
        let err = LoadSource::open_checkpoint_within(&dir, &AllowedRoots::default()).err().unwrap();
        assert!(matches!(err, ModelError::Roots(RootsError::NoRoots { .. })), "{err:?}");
    }
}
