//! Where a rank's checkpoint-order bytes come from: a safetensors checkpoint directory, or the
//! synthetic generator (`dummy` load format). Both hand the pipeline the same thing, a
//! row-major slice of one checkpoint tensor, so every load path runs the same pipeline.

use std::ops::Range;
use std::path::{Path, PathBuf};

use orchestrator_model::{Checkpoint, Generator, ModelConfig, ModelError, TensorSpec};

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
