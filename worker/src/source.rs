//! Where a rank's checkpoint-order bytes come from: a safetensors checkpoint directory, or the
//! synthetic generator (`dummy` load format). Both hand the pipeline the same thing, a
//! row-major slice of one checkpoint tensor, so every load path runs the same pipeline.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use orchestrator_model::checkpoint::{ContentClaim, FileIdentity, Shard};
use orchestrator_proto::v1 as pb;

use orchestrator_model::{AllowedRoots, Checkpoint, Generator, ModelConfig, ModelError, TensorSpec};

/// A load format with its data.
pub enum LoadSource {
    /// A Hugging Face checkpoint directory, memory-mapped.
    Safetensors(Box<Checkpoint>),
    /// Values from the synthetic generator with this seed (what `checkpoint synth` writes).
    Dummy { config: ModelConfig, generator: Generator },
}

impl LoadSource {
    pub fn open_checkpoint(dir: &Path) -> Result<Self, ModelError> {
        Ok(Self::Safetensors(Box::new(Checkpoint::open(dir)?)))
    }

    /// A checkpoint directory every file of which lies under `roots`
    /// ([`Checkpoint::open_within`]).
    pub fn open_checkpoint_within(dir: &Path, roots: &AllowedRoots) -> Result<Self, ModelError> {
        Self::open_checkpoint_claimed(dir, roots, None)
    }

    /// [`LoadSource::open_checkpoint_within`], adopting the claimed content version when this
    /// process sees the very files it was computed from ([`Checkpoint::open_within_claimed`]).
    pub fn open_checkpoint_claimed(dir: &Path, roots: &AllowedRoots, claim: Option<&ContentClaim>) -> Result<Self, ModelError> {
        let ck = Checkpoint::open_within_claimed(dir, roots, claim)?;
        if claim.is_some() {
            tracing::info!(dir = %ck.dir().display(), from = ?ck.version_from(), version = ck.content_version(), "opened a claimed checkpoint");
        }
        Ok(Self::Safetensors(Box::new(ck)))
    }

    /// The claim other processes on this host can open the same checkpoint with (`None` for a
    /// dummy source, or files changed a moment before they were opened).
    pub fn content_claim(&self) -> Option<ContentClaim> {
        match self {
            LoadSource::Safetensors(c) => c.content_claim(),
            LoadSource::Dummy { .. } => None,
        }
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

/// Why a request's `LoadSource` names nothing this worker may load. Its text is what the
/// caller sees (the gRPC status message, a recovery's error).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source: missing (checkpoint_dir or dummy)")]
    Missing,
    /// The content claim is malformed: the field that is wrong.
    #[error("{0}")]
    Claim(String),
    /// A file of the checkpoint lies outside the allowed roots.
    #[error("{0}")]
    Roots(orchestrator_model::RootsError),
    #[error("source: {0}")]
    Checkpoint(ModelError),
    #[error("source.dummy.preset: {0}")]
    Preset(ModelError),
    #[error("source.dummy: {0}")]
    Dummy(ModelError),
    /// A name or path longer than any real one (not echoed back).
    #[error(transparent)]
    TooLong(#[from] orchestrator_proto::limits::TooLong),
}

impl From<SourceError> for tonic::Status {
    fn from(e: SourceError) -> Self {
        match e {
            SourceError::Roots(_) => tonic::Status::permission_denied(e.to_string()),
            _ => tonic::Status::invalid_argument(e.to_string()),
        }
    }
}

impl LoadSource {
    /// The load source a request names; a checkpoint directory, and every file it is read from
    /// (config, index, each shard, symlinks resolved), must lie under `roots`.
    pub fn from_pb(source: Option<&pb::LoadSource>, roots: &AllowedRoots) -> Result<Self, SourceError> {
        use pb::load_source::Kind;
        if let Some(s) = source {
            Self::check_pb(s)?;
        }
        match source.and_then(|s| s.kind.as_ref()) {
            Some(Kind::CheckpointDir(dir)) => {
                let claim = source.and_then(|s| s.content.as_ref()).map(claim_from_pb).transpose().map_err(SourceError::Claim)?;
                Self::open_checkpoint_claimed(Path::new(dir), roots, claim.as_ref()).map_err(|e| match e {
                    ModelError::Roots(e) => SourceError::Roots(e),
                    e => SourceError::Checkpoint(e),
                })
            }
            Some(Kind::Dummy(d)) => {
                let preset = d.preset.parse().map_err(SourceError::Preset)?;
                let layers = (d.layers > 0).then_some(d.layers as usize);
                let config = ModelConfig::from_preset(preset, layers, d.bf16).map_err(SourceError::Dummy)?;
                Ok(Self::Dummy { config, generator: Generator::new(d.seed) })
            }
            None => Err(SourceError::Missing),
        }
    }
}

impl LoadSource {
    /// What [`LoadSource::from_pb`] refuses without opening anything: a path or preset name longer
    /// than any real one.
    pub fn check_pb(source: &pb::LoadSource) -> Result<(), SourceError> {
        use orchestrator_proto::limits::{MAX_NAME_BYTES, MAX_PATH_BYTES, check_len};
        use pb::load_source::Kind;
        match &source.kind {
            Some(Kind::CheckpointDir(dir)) => check_len("source.checkpoint_dir", dir, MAX_PATH_BYTES).map(drop)?,
            Some(Kind::Dummy(d)) => check_len("source.dummy.preset", &d.preset, MAX_NAME_BYTES).map(drop)?,
            None => {}
        }
        Ok(())
    }
}

/// A claim as a `LoadSource.content` message.
pub fn claim_to_pb(c: &ContentClaim) -> pb::ContentClaim {
    pb::ContentClaim {
        version: c.version.clone(),
        frame: c.frame.clone(),
        files: c
            .files
            .iter()
            .map(|(name, i)| pb::FileIdentity {
                name: name.clone(),
                dev: i.dev,
                ino: i.ino,
                size: i.size,
                mtime_ns: i.mtime_ns,
                ctime_ns: i.ctime_ns,
            })
            .collect(),
    }
}

/// The most shard files a claim may name (a real checkpoint has a few hundred).
pub const MAX_CLAIM_FILES: usize = 1 << 16;

/// A claim from a `LoadSource.content` message, checked: the field that is wrong when it is not.
pub fn claim_from_pb(c: &pb::ContentClaim) -> Result<ContentClaim, String> {
    let hex16 = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !hex16(&c.version) {
        return Err(format!("source.content.version {:?}: expected 16 lowercase hex digits", truncate(&c.version)));
    }
    if !hex16(&c.frame) {
        return Err(format!("source.content.frame {:?}: expected 16 lowercase hex digits", truncate(&c.frame)));
    }
    if c.files.len() > MAX_CLAIM_FILES {
        return Err(format!("source.content.files: {} files, over the limit of {MAX_CLAIM_FILES}", c.files.len()));
    }
    let mut files = std::collections::BTreeMap::new();
    for f in &c.files {
        if f.name.is_empty() || f.name.len() > orchestrator_proto::limits::MAX_PATH_BYTES {
            return Err(format!(
                "source.content.files: a name of {} bytes (1 to {} allowed)",
                f.name.len(),
                orchestrator_proto::limits::MAX_PATH_BYTES
            ));
        }
        let identity = FileIdentity { dev: f.dev, ino: f.ino, size: f.size, mtime_ns: f.mtime_ns, ctime_ns: f.ctime_ns };
        if files.insert(f.name.clone(), identity).is_some() {
            return Err(format!("source.content.files: {:?} named twice", truncate(&f.name)));
        }
    }
    Ok(ContentClaim { version: c.version.clone(), frame: c.frame.clone(), files })
}

/// At most 64 bytes of `s`, on a character boundary (for errors).
fn truncate(s: &str) -> &str {
    let mut n = s.len().min(64);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

#[cfg(test)]
mod tests {
    use super::*;
    use orchestrator_model::synth::{SynthOptions, write_checkpoint};
    use orchestrator_model::{Preset, RootsError};
    use pb::load_source::Kind;

    #[test]
    fn checkpoints_outside_the_allowed_roots_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, other) = (tmp.path().join("allowed"), tmp.path().join("other"));
        let config = ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        for dir in [root.join("ckpt"), other.join("ckpt")] {
            write_checkpoint(&dir, &SynthOptions { config: config.clone(), seed: 1, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        }
        let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
        let source_from = |p: Option<&pb::LoadSource>, roots: &AllowedRoots| LoadSource::from_pb(p, roots).map_err(tonic::Status::from);
        let src = |p: &std::path::Path| pb::LoadSource { kind: Some(Kind::CheckpointDir(p.display().to_string())), content: None };
        assert!(source_from(Some(&src(&root.join("ckpt"))), &roots).is_ok());
        for bad in [other.join("ckpt"), root.join("ckpt/../../other/ckpt")] {
            let e = source_from(Some(&src(&bad)), &roots).err().unwrap();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{bad:?}");
            assert!(e.message().contains(&bad.display().to_string()), "{}", e.message());
        }
        #[cfg(unix)]
        {
            let link = root.join("escape");
            std::os::unix::fs::symlink(other.join("ckpt"), &link).unwrap();
            assert_eq!(source_from(Some(&src(&link)), &roots).err().unwrap().code(), tonic::Code::PermissionDenied);
        }
        // No roots: no checkpoint directory at all; dummy sources need none.
        assert!(source_from(Some(&src(&root.join("ckpt"))), &AllowedRoots::default()).is_err());
        let dummy = pb::LoadSource {
            content: None,
            kind: Some(Kind::Dummy(pb::DummySource { preset: "tiny".into(), layers: 1, seed: 0, bf16: false })),
        };
        assert!(source_from(Some(&dummy), &AllowedRoots::default()).is_ok());
    }

    #[test]
    fn request_sources_that_name_nothing_loadable_fail_by_kind_with_their_field() {
        let roots = AllowedRoots::default();
        let dummy = |preset: &str, layers: u32| pb::LoadSource {
            kind: Some(pb::load_source::Kind::Dummy(pb::DummySource { preset: preset.into(), layers, seed: 3, bf16: false })),
            content: None,
        };
        let err = |s: Option<&pb::LoadSource>| LoadSource::from_pb(s, &roots).err().expect("refused");
        let e = err(None);
        assert!(matches!(e, SourceError::Missing), "{e:?}");
        assert_eq!(tonic::Status::from(e).message(), "source: missing (checkpoint_dir or dummy)");
        let e = err(Some(&pb::LoadSource { kind: None, content: None }));
        assert!(matches!(e, SourceError::Missing), "{e:?}");
        let e = err(Some(&dummy("no-such-preset", 1)));
        assert!(matches!(e, SourceError::Preset(ModelError::UnknownPreset { .. })), "{e:?}");
        assert!(e.to_string().starts_with("source.dummy.preset: "), "{e}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        let ok = LoadSource::from_pb(Some(&dummy("tiny", 1)), &roots).expect("a dummy source");
        assert_eq!((ok.format_name(), ok.describe()), ("dummy", "dummy(seed=3)".to_string()));
        let claimed = pb::LoadSource {
            kind: Some(pb::load_source::Kind::CheckpointDir("/nonexistent".into())),
            content: Some(pb::ContentClaim { version: "x".into(), ..Default::default() }),
        };
        let e = err(Some(&claimed));
        assert!(matches!(&e, SourceError::Claim(m) if m.starts_with("source.content.version")), "{e:?}");
        // Outside the (empty) roots: refused before anything is read, as a permission.
        let e = err(Some(&pb::LoadSource { kind: Some(pb::load_source::Kind::CheckpointDir("/".into())), content: None }));
        assert!(matches!(e, SourceError::Roots(_)), "{e:?}");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn claims_round_trip_and_bad_ones_name_their_field() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        let config = ModelConfig::from_preset(Preset::Tiny, Some(1), false).unwrap();
        write_checkpoint(&dir, &SynthOptions { config, seed: 5, max_shard_bytes: 100_000, preset_name: None }).unwrap();
        let roots = AllowedRoots::new(&[tmp.path().to_path_buf()]).unwrap();
        let ck = Checkpoint::open_within(&dir, &roots).unwrap();
        let claim = ck.claim_with_margin(std::time::Duration::ZERO).unwrap();
        let wire = claim_to_pb(&claim);
        assert_eq!(claim_from_pb(&wire).unwrap(), claim);
        let opened = LoadSource::open_checkpoint_claimed(&dir, &roots, Some(&claim)).unwrap();
        assert_eq!(opened.version(), ck.content_version());
        let bad = |f: &dyn Fn(&mut pb::ContentClaim)| {
            let mut w = wire.clone();
            f(&mut w);
            claim_from_pb(&w).unwrap_err()
        };
        assert!(bad(&|w| w.version = "ABCDEF0123456789".into()).starts_with("source.content.version"));
        assert!(bad(&|w| w.version = "é".repeat(40)).starts_with("source.content.version"));
        assert!(bad(&|w| w.frame.clear()).starts_with("source.content.frame"));
        assert!(bad(&|w| w.files.push(w.files[0].clone())).contains("named twice"));
        assert!(bad(&|w| w.files[0].name.clear()).starts_with("source.content.files"));
        let many = bad(&|w| w.files = vec![w.files[0].clone(); MAX_CLAIM_FILES + 1]);
        assert!(many.contains("over the limit"), "{many}");
    }

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
