//! Benchmarks that print ratios measured in the same run: the load pipeline against this
//! machine's memcpy and page-cache read rate (`load`: `orchestrator-worker bench`, `cargo bench
//! -p orchestrator-worker --bench load_pipeline`), the MXFP8 GEMMs against the read and arithmetic
//! roofs (`gemm`: `bench-gemm`, `--bench gemm`), and the yardsticks both divide by (`roofs`).

use std::path::Path;

use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{ModelConfig, Preset, WeightFormat};

mod gemm;
mod load;
mod roofs;

pub use gemm::{GemmReport, GemmResult, run_gemm};
pub use load::{BenchOptions, BenchReport, FRESH_RUNS, FreshLoad, PathResult, page_cache_read_rate, run};
pub use roofs::{Memcpy, ReadRoof, bf16_dot_peak, multiply_add_peak};

/// Synthesizes the benchmark checkpoint into `dir` unless one is there (kept for later runs).
fn synth(dir: &Path, preset: Preset, layers: usize, format: WeightFormat) -> anyhow::Result<()> {
    if dir.join("config.json").exists() {
        return Ok(());
    }
    let opts = SynthOptions {
        config: ModelConfig::from_preset(preset, Some(layers), format == WeightFormat::Bf16)?,
        seed: 1,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        preset_name: Some(preset.name().to_string()),
    };
    write_checkpoint(dir, &opts)?;
    Ok(())
}
