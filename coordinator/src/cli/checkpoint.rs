//! `checkpoint synth` and `checkpoint inspect` (`checkpoint manifest` is in [`super::manifest`]).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use orchestrator_model::inspect::inspect;
use orchestrator_model::synth::{DEFAULT_MAX_SHARD_BYTES, SynthOptions, write_checkpoint};
use orchestrator_model::{Checkpoint, ModelConfig, Preset};
use orchestrator_ops::output::emit;

#[derive(Clone, Copy, ValueEnum)]
pub enum Dtype {
    Fp8,
    Bf16,
}

#[derive(Args)]
pub struct SynthArgs {
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value = "dsv41-flash")]
    preset: String,
    /// Number of layers (default: the preset's).
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long, value_enum, default_value = "fp8")]
    dtype: Dtype,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Largest shard file in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_SHARD_BYTES)]
    max_shard_bytes: usize,
}

#[derive(Args)]
pub struct InspectArgs {
    dir: PathBuf,
    #[arg(long)]
    json: bool,
}

/// Appends a formatted line to a String.
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Writes a synthetic checkpoint and says what it wrote.
pub fn synth(a: SynthArgs) -> anyhow::Result<bool> {
    let preset: Preset = a.preset.parse()?;
    let config = ModelConfig::from_preset(preset, a.layers, matches!(a.dtype, Dtype::Bf16))?;
    let (layers, format) = (config.geometry.layers, config.format);
    let opts = SynthOptions { config, seed: a.seed, max_shard_bytes: a.max_shard_bytes, preset_name: Some(preset.name().to_string()) };
    let t = std::time::Instant::now();
    let s = write_checkpoint(&a.out, &opts).with_context(|| format!("synthesizing into {}", a.out.display()))?;
    emit(&format!(
        "wrote {} ({} {} layers, {}, seed {}): {} tensors, {:.1} MB in {} shard file(s), {:.2} s\n",
        s.dir.display(),
        preset.name(),
        layers,
        format.name(),
        a.seed,
        s.tensors,
        s.total_bytes as f64 / 1e6,
        s.shards.len(),
        t.elapsed().as_secs_f64()
    ));
    Ok(true)
}

/// Prints a checkpoint's geometry and tensors: true when every in-scope tensor is valid.
pub fn inspect_cmd(a: InspectArgs) -> anyhow::Result<bool> {
    let ck = Checkpoint::open(&a.dir)?;
    let r = inspect(&ck);
    if a.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
        return Ok(r.valid);
    }
    let mut out = String::new();
    let g = &r.geometry;
    outln!(out, "checkpoint {}", r.dir);
    outln!(
        out,
        "  family {}  hidden {}  layers {}  heads {} (kv {})  head_dim {}  rope {}  q_lora {}  o_lora {}  o_groups {}",
        r.family,
        g.hidden,
        g.layers,
        g.heads,
        g.kv_heads,
        g.head_dim,
        g.rope_dim,
        g.q_lora_rank,
        g.o_lora_rank,
        g.o_groups
    );
    outln!(out, "  weights: {}  valid TP sizes: {:?}", r.format, r.valid_tp_sizes);
    outln!(
        out,
        "  {} in-scope tensors, {:.1} MB; {} other tensors ignored",
        r.tensors.len(),
        r.in_scope_bytes as f64 / 1e6,
        r.other_tensors
    );
    for t in &r.tensors {
        outln!(
            out,
            "  {:<34} {:<8} {:<14} {:>12}  {:<36} {}",
            t.name,
            t.dtype,
            format!("{:?}", t.shape),
            t.bytes,
            t.file.as_deref().unwrap_or("-"),
            t.status
        );
    }
    if r.valid {
        outln!(out, "valid");
    } else {
        outln!(out, "INVALID: {} problem(s)", r.problems.len());
        for p in &r.problems {
            outln!(out, "  {p}");
        }
    }
    emit(&out);
    Ok(r.valid)
}
