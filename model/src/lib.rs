//! What both binaries need to agree on: DeepSeek-V4/V4.1 attention geometry, `config.json`,
//! Hugging Face checkpoint reading (memory-mapped, per-rank slices) and writing (synthetic
//! checkpoints), the counter-based generator and the tensor-parallel shard plan.

pub mod checkpoint;
pub mod config;
pub mod generator;
pub mod geometry;
pub mod inspect;
pub mod limits;
pub mod names;
pub mod plan;
pub mod roots;
pub mod synth;

use std::path::PathBuf;

pub use checkpoint::Checkpoint;
pub use config::ModelConfig;
pub use generator::Generator;
pub use geometry::{Family, Geometry, Preset, WeightFormat};
pub use names::{Param, Part, TensorSpec};
pub use plan::RankShard;
pub use roots::{AllowedRoots, RootsError};

/// Errors of geometry, configuration and checkpoint I/O. Every variant about a checkpoint
/// names the file and, where one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{file}: {why}")]
    Config { file: PathBuf, why: String },
    #[error("{file}: {why}")]
    Index { file: PathBuf, why: String },
    /// A checkpoint file that is a pipe, a device or a directory (opening a pipe would wait for
    /// a writer forever).
    #[error("{file} is not a regular file ({kind})")]
    NotAFile { file: PathBuf, kind: &'static str },
    #[error("{file} is {bytes} bytes, over the limit of {limit} bytes read into memory")]
    FileTooLarge { file: PathBuf, bytes: u64, limit: u64 },
    #[error("unknown preset `{name}` (known: {known})")]
    UnknownPreset { name: String, known: String },
    #[error("geometry field `{field}` {why}")]
    Geometry { field: &'static str, why: String },
    #[error("quantization: {0}")]
    Quantization(String),
    #[error("TP size {tp} is not allowed: {why}")]
    TpSize { tp: usize, why: String },
    #[error("tensor `{tensor}` is missing from {index}")]
    MissingTensor { tensor: String, index: PathBuf },
    #[error("shard file {file} (holding tensor `{tensor}`) does not exist")]
    MissingShard { file: PathBuf, tensor: String },
    #[error("{file}: malformed safetensors header (while looking for tensor `{tensor}`): {why}")]
    MalformedHeader { file: PathBuf, tensor: String, why: String },
    #[error("{file} is truncated: tensor `{tensor}` needs bytes up to {needed} of the data section, which has {available}")]
    Truncated { file: PathBuf, tensor: String, needed: usize, available: usize },
    #[error("{file}: header offsets of tensor `{tensor}` are invalid: {why}")]
    BadOffsets { file: PathBuf, tensor: String, why: String },
    #[error("{file}: tensor `{tensor}` has dtype {found}, expected {expected}")]
    WrongDtype { file: PathBuf, tensor: String, expected: String, found: String },
    #[error("{file}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    WrongShape { file: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{file}: tensor `{tensor}` has a NaN scale byte (0xFF) at [{row}, {col}]")]
    NanScale { file: PathBuf, tensor: String, row: usize, col: usize },
    #[error("{file}: tensor `{tensor}` has a non-finite value at [{row}, {col}]")]
    NonFinite { file: PathBuf, tensor: String, row: usize, col: usize },
    /// A checkpoint file (or the directory) outside the allowed roots; names the file and
    /// where it resolves to.
    #[error(transparent)]
    Roots(#[from] RootsError),
    #[error("writing {path}: {why}")]
    Write { path: PathBuf, why: String },
}

/// `path` when it is a regular file (symlinks followed), before it is opened: a pipe would
/// block its opener until something writes to it, and a device or a directory is no
/// checkpoint file. A path that does not exist passes (its opener says so).
pub(crate) fn regular_file(path: &std::path::Path) -> Result<(), ModelError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::metadata(path) else { return Ok(()) };
    let t = meta.file_type();
    let kind = if t.is_file() {
        return Ok(());
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a pipe"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    };
    Err(ModelError::NotAFile { file: path.to_path_buf(), kind })
}
