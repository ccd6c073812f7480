//! `--dump`: every kernel-visible tensor of a rank, in storage order, under its parameter name,
//! as `OUT/rank{R}.safetensors`.
//!
//! A worker writes the dumps an assignment asks for beneath its `--dump-root` only, and not by
//! name: the root is held open from the worker's start, and each write creates and opens its
//! directory beneath that descriptor (`cap-std`: symlinks and `..` resolved without leaving the
//! root), then writes the file through the opened directory. So a symlink planted under the
//! root after the assignment's check, or the root renamed, cannot send a write elsewhere.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// A directory dumps may be written beneath, held open (a worker's `--dump-root`).
#[derive(Debug)]
pub struct DumpRoot {
    dir: cap_std::fs::Dir,
    /// Its canonical path, for messages and for checking where a directory resolves.
    path: PathBuf,
}

impl DumpRoot {
    /// Opens the directory `path` and holds it.
    pub fn open(path: &Path) -> std::io::Result<Arc<Self>> {
        let path = path.canonicalize()?;
        let dir = cap_std::fs::Dir::open_ambient_dir(&path, cap_std::ambient_authority())?;
        Ok(Arc::new(Self { dir, path }))
    }

    /// The existing directory `dir`, which must resolve (symlinks and all) beneath this root, and
    /// within it `sub`: where a rank of an assignment writes. The error says why not.
    pub fn beneath(self: &Arc<Self>, dir: &Path, sub: &str) -> Result<DumpDir, String> {
        let resolved = dir.canonicalize().map_err(|e| e.to_string())?;
        let rel = resolved
            .strip_prefix(&self.path)
            .map_err(|_| format!("resolves to {}, outside --dump-root {}", resolved.display(), self.path.display()))?;
        Ok(DumpDir { root: self.clone(), rel: rel.join(sub) })
    }
}

/// Where a rank's dump goes: `rel` beneath a held [`DumpRoot`], created at the write if missing.
#[derive(Clone, Debug)]
pub struct DumpDir {
    root: Arc<DumpRoot>,
    rel: PathBuf,
}

impl DumpDir {
    /// `path` itself (created if missing) as its own root: the local `load --dump DIR`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(path)?;
        Ok(Self { root: DumpRoot::open(path)?, rel: PathBuf::new() })
    }

    /// The directory's path, for messages (the write itself does not go by it).
    pub fn path(&self) -> PathBuf {
        self.root.path.join(&self.rel)
    }

    /// Creates the directory beneath the root (if missing) and opens it there.
    fn open(&self) -> std::io::Result<cap_std::fs::Dir> {
        if self.rel.as_os_str().is_empty() {
            return self.root.dir.try_clone();
        }
        self.root.dir.create_dir_all(&self.rel)?;
        self.root.dir.open_dir(&self.rel)
    }
}

/// A name inside the opened directory `dir` that a path-taking writer can use without any name
/// above it being resolved again: the directory's descriptor in `/proc/self/fd`. (The writer's
/// temporary file and its rename then stay inside `dir`, and a symlink planted at `name` is
/// replaced, not followed.)
fn path_inside(dir: &cap_std::fs::Dir, name: &str) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
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
pub fn dump_rank<B: Backend>(backend: &B, weights: &RankWeights<B>, dir: &DumpDir) -> Result<PathBuf, DumpError> {
    let name = format!("rank{}.safetensors", weights.shard.rank);
    let path = dir.path().join(&name);
    let werr = |why: String| DumpError::Write { path: path.clone(), why };
    let opened =
        dir.open().map_err(|e| werr(format!("opening {} beneath the dump root {}: {e}", dir.rel.display(), dir.root.path.display())))?;
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
    safetensors::serialize_to_file(views, Some(meta), &path_inside(&opened, &name)).map_err(|e| werr(e.to_string()))?;
    Ok(path)
}
