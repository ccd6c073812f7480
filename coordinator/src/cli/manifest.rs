//! `orchestrator checkpoint manifest` and `orchestrator verify-dump`: expected kernel digests of
//! every rank, computed with the independent golden path, and checking any engine's dumped
//! ranks against them (see `orchestrator_worker::manifest`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use orchestrator_ops::output::emit;
use orchestrator_worker::LoadSource;
use orchestrator_worker::manifest::{Manifest, build, verify_dump};

#[derive(Args)]
pub struct ManifestArgs {
    /// Hugging Face checkpoint directory.
    dir: PathBuf,
    /// Tensor-parallel size of the engine whose ranks the manifest describes.
    #[arg(long)]
    tp: usize,
    /// MXFP8 scale rule for BF16 checkpoints (FP8 checkpoints carry their scales).
    #[arg(long, default_value = "rceil")]
    scale_rule: orchestrator_kernels::ScaleRule,
    /// Print the manifest as JSON (what `verify-dump --manifest` reads).
    #[arg(long)]
    json: bool,
    /// Also write the JSON manifest to FILE.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

#[derive(Args)]
pub struct VerifyDumpArgs {
    /// `rank{R}.safetensors`, or a directory of them (kernel tensors under their parameter names).
    dump: PathBuf,
    /// The manifest (`orchestrator checkpoint manifest DIR --tp T --json`).
    #[arg(long, value_name = "FILE")]
    manifest: PathBuf,
    #[arg(long)]
    json: bool,
}

pub fn manifest_cmd(a: ManifestArgs) -> anyhow::Result<bool> {
    let source = LoadSource::open_checkpoint(&a.dir).with_context(|| format!("opening {}", a.dir.display()))?;
    let manifest = build(&source, &a.dir.display().to_string(), a.tp, a.scale_rule)?;
    let json = serde_json::to_string_pretty(&manifest)? + "\n";
    if let Some(out) = &a.out {
        std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
    }
    emit(&if a.json { json } else { manifest.render() });
    Ok(true)
}

pub fn verify_dump_cmd(a: VerifyDumpArgs) -> anyhow::Result<bool> {
    let manifest = Manifest::read(&a.manifest)?;
    let verdict = verify_dump(&manifest, &a.dump)?;
    if a.json {
        emit(&(serde_json::to_string_pretty(&verdict)? + "\n"));
    } else {
        emit(&verdict.render());
    }
    Ok(verdict.ok)
}
