//! Expected-digest manifests, and checking any engine's dumped ranks against one.
//!
//! `orchestrator checkpoint manifest DIR --tp T` computes, with the independent golden path
//! ([`crate::golden`]: the spec's formulas written out, none of the fast pipeline), every TP
//! rank's expected kernel tensors (dtype, shape, XXH3-64), kernel and source rank digests and
//! layout identity (spec section 9), plus the digests each tensor has in the wrong layouts that
//! known loader bugs produce. `orchestrator verify-dump DUMP --manifest FILE` then checks
//! `rank{R}.safetensors` dumps (kernel tensors under their parameter names, as `--dump` writes
//! them, or as an engine's own few lines of Python do) against it, and names the most likely
//! cause of every tensor that differs.
//!
//! The manifest's JSON keys are those of `scripts/make_python_fixture.py`'s `expected.json`
//! (`kernel` with `dtype` / `shape` / `xxh3`, `source`, `kernel_rank_digest`), so the two can be
//! compared directly.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use orchestrator_kernels::{Digest, ScaleRule};
use orchestrator_model::{RankShard, WeightFormat};
use serde::{Deserialize, Serialize};

use crate::golden::{GoldenDigest, Layout, golden_kernel_tensors_as, golden_source_digests, rank_digest_of};
use crate::identity::LayoutIdentity;
use crate::loader::LoadError;
use crate::source::LoadSource;

/// Bumped when the manifest's meaning changes.
pub const MANIFEST_VERSION: u32 = 1;

/// The largest manifest file read (a manifest of the real geometry at TP 8 is a few MB).
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// The largest dump file `verify-dump` maps (1 TiB; a rank's attention tensors are far
/// smaller): a bound on what a corrupt or hostile path can make it map.
pub const MAX_DUMP_BYTES: u64 = 1 << 40;

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("reading {path}: {why}")]
    Read { path: PathBuf, why: String },
    #[error("{path}: not a manifest: {why}")]
    Parse { path: PathBuf, why: String },
    #[error("{path}: manifest version {found}, this build reads version {MANIFEST_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: not a dump of one rank (expected a file named rank{{R}}.safetensors)")]
    DumpName { path: PathBuf },
    #[error("{path}: rank {rank} is not a rank of the manifest (TP {tp_size})")]
    DumpRank { path: PathBuf, rank: usize, tp_size: usize },
    #[error("{path}: not a safetensors file: {why}")]
    DumpFormat { path: PathBuf, why: String },
    #[error("{path}: no rank{{R}}.safetensors dumps in this directory")]
    NoDumps { path: PathBuf },
}

/// One expected kernel tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExpectedTensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub xxh3: String,
    /// The digest this tensor has in each wrong layout that changes it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub wrong: BTreeMap<String, String>,
}

/// One TP rank's expectations, keyed as engines key their ranks (by TP rank).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RankManifest {
    pub tp_rank: usize,
    pub layout_identity: LayoutIdentity,
    pub kernel_rank_digest: String,
    pub source_rank_digest: String,
    pub kernel: BTreeMap<String, ExpectedTensor>,
    pub source: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Manifest {
    pub manifest_version: u32,
    pub generator: String,
    pub checkpoint: String,
    pub checkpoint_version: String,
    pub tp_size: usize,
    pub scale_rule: String,
    pub ranks: Vec<RankManifest>,
}

/// The other scale rule (a BF16 checkpoint quantized with the wrong one).
fn other_rule(rule: ScaleRule) -> ScaleRule {
    match rule {
        ScaleRule::Rceil => ScaleRule::Floor,
        ScaleRule::Floor => ScaleRule::Rceil,
    }
}

/// Computes the manifest of `source` at TP `tp_size` with the golden path.
pub fn build(source: &LoadSource, checkpoint: &str, tp_size: usize, rule: ScaleRule) -> Result<Manifest, ManifestError> {
    let config = source.config();
    // The TP size first: nothing is sized by it before it is known to split this model.
    orchestrator_model::plan::validate_tp(&config.geometry, tp_size).map_err(LoadError::from)?;
    let mut ranks = Vec::new();
    for rank in 0..tp_size {
        let shard = RankShard::new(&config.geometry, tp_size, rank).map_err(LoadError::from)?;
        let expected = golden_kernel_tensors_as(source, tp_size, rank, rule, Layout::Expected)?;
        let mut variants: Vec<(String, Vec<GoldenDigest>)> = Vec::new();
        for layout in Layout::WRONG {
            variants.push((layout.name().to_string(), golden_kernel_tensors_as(source, tp_size, rank, rule, layout)?));
        }
        if config.format == WeightFormat::Bf16 {
            let other = golden_kernel_tensors_as(source, tp_size, rank, other_rule(rule), Layout::Expected)?;
            variants.push(("other_scale_rule".to_string(), other));
        }
        let mut kernel = BTreeMap::new();
        for (i, t) in expected.iter().enumerate() {
            let wrong = variants
                .iter()
                .filter_map(|(what, tensors)| {
                    let other = &tensors[i];
                    debug_assert_eq!(other.name, t.name);
                    (other.digest != t.digest).then(|| (what.clone(), other.digest.hex()))
                })
                .collect();
            kernel
                .insert(t.name.clone(), ExpectedTensor { dtype: t.dtype.to_string(), shape: t.shape.clone(), xxh3: t.digest.hex(), wrong });
        }
        let digests: Vec<(String, Digest)> = expected.iter().map(|t| (t.name.clone(), t.digest)).collect();
        let sources = golden_source_digests(source, tp_size, rank)?;
        ranks.push(RankManifest {
            tp_rank: rank,
            layout_identity: LayoutIdentity::new(&config.geometry, &shard, config.format, rule),
            kernel_rank_digest: rank_digest_of(&digests).hex(),
            source_rank_digest: rank_digest_of(&sources).hex(),
            kernel,
            source: sources.into_iter().map(|(n, d)| (n, d.hex())).collect(),
        });
    }
    Ok(Manifest {
        manifest_version: MANIFEST_VERSION,
        generator: format!("orchestrator {}", env!("CARGO_PKG_VERSION")),
        checkpoint: checkpoint.to_string(),
        checkpoint_version: source.version(),
        tp_size,
        scale_rule: rule.name().to_string(),
        ranks,
    })
}

impl Manifest {
    /// Reads and checks a manifest file.
    pub fn read(path: &Path) -> Result<Self, ManifestError> {
        let read_err = |why: String| ManifestError::Read { path: path.to_path_buf(), why };
        let bytes = orchestrator_proto::limits::read_bounded(path, MAX_MANIFEST_BYTES).map_err(|e| read_err(e.to_string()))?;
        let parse_err = |e: serde_json::Error| ManifestError::Parse { path: path.to_path_buf(), why: e.to_string() };
        // The version first, every other field skipped unbuilt (a tree of the whole document,
        // as a `serde_json::Value` was, costs many times its text).
        #[derive(Deserialize)]
        struct Version {
            manifest_version: Option<u64>,
        }
        match serde_json::from_slice::<Version>(&bytes).map_err(parse_err)?.manifest_version {
            Some(v) if v == MANIFEST_VERSION as u64 => {}
            Some(v) => return Err(ManifestError::Version { path: path.to_path_buf(), found: v as u32 }),
            None => return Err(ManifestError::Parse { path: path.to_path_buf(), why: "no manifest_version".into() }),
        }
        let m: Manifest = serde_json::from_slice(&bytes).map_err(parse_err)?;
        if m.ranks.len() != m.tp_size || m.ranks.iter().enumerate().any(|(i, r)| r.tp_rank != i) {
            return Err(ManifestError::Parse { path: path.to_path_buf(), why: format!("ranks are not 0..{} in order", m.tp_size) });
        }
        Ok(m)
    }

    /// Renders the manifest as text (one block per rank).
    pub fn render(&self) -> String {
        let mut s = format!(
            "manifest of {} (version {}), TP {}, scale rule {}\n",
            self.checkpoint, self.checkpoint_version, self.tp_size, self.scale_rule
        );
        for r in &self.ranks {
            s.push_str(&format!(
                "rank {}: layout identity {}, kernel rank digest {}, source rank digest {}, {} kernel tensors\n",
                r.tp_rank,
                r.layout_identity.digest,
                r.kernel_rank_digest,
                r.source_rank_digest,
                r.kernel.len()
            ));
        }
        s
    }
}

/// What a differing tensor most likely is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// One of the wrong layouts of this rank (`permutation_skipped`, `permuted_twice`,
    /// `scales_not_swizzled`, `scales_not_packed`, `other_scale_rule`).
    WrongLayout { layout: String },
    /// Exactly what another rank must hold (a shard mix-up), in that rank's `layout`.
    OtherRank { rank: usize, layout: String },
    /// None of the known wrong layouts.
    Unknown,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::WrongLayout { layout } => match layout.as_str() {
                "permutation_skipped" => write!(f, "checkpoint order: the permutation was skipped"),
                "permuted_twice" => write!(f, "permuted twice"),
                "scales_not_swizzled" => write!(f, "scales not swizzled (plain per-row, not F8_128x4)"),
                "scales_not_packed" => write!(f, "scales not packed (plain per-row, not DeepGEMM UE8M0)"),
                "other_scale_rule" => write!(f, "quantized with the other scale rule"),
                other => write!(f, "{other}"),
            },
            Cause::OtherRank { rank, layout } if layout == "expected" => write!(f, "rank {rank}'s shard"),
            Cause::OtherRank { rank, layout } => write!(f, "rank {rank}'s shard, {layout}"),
            Cause::Unknown => write!(f, "none of the known wrong layouts"),
        }
    }
}

/// One tensor of a dump that is not what the manifest expects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct TensorFinding {
    pub tensor: String,
    /// `missing` or `differs`.
    pub verdict: String,
    pub expected: String,
    pub found: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<Cause>,
    /// The cause as a sentence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explanation: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct RankVerdict {
    pub tp_rank: usize,
    pub file: String,
    pub ok: bool,
    pub checked: usize,
    pub matching: usize,
    pub findings: Vec<TensorFinding>,
    /// Tensors whose bytes match but whose dtype or shape in the dump differs from the
    /// manifest's (an engine's own parameter shapes): noted, not failed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct DumpVerdict {
    pub ok: bool,
    pub manifest_checkpoint_version: String,
    pub tp_size: usize,
    pub ranks: Vec<RankVerdict>,
}

impl DumpVerdict {
    pub fn render(&self) -> String {
        let mut s = String::new();
        for r in &self.ranks {
            s.push_str(&format!(
                "rank {} ({}): {} of {} kernel tensors as expected{}\n",
                r.tp_rank,
                r.file,
                r.matching,
                r.checked,
                if r.ok { "" } else { ": FAILED" }
            ));
            for n in &r.notes {
                s.push_str(&format!("  note {n}\n"));
            }
            for f in &r.findings {
                let why = f.explanation.as_deref().map(|e| format!(": most likely {e}")).unwrap_or_default();
                s.push_str(&format!("  {} {}: expected {}, found {}{why}\n", f.verdict, f.tensor, f.expected, f.found));
            }
        }
        s.push_str(if self.ok { "OK: every dumped rank holds what its kernels expect\n" } else { "FAILED: see the tensors above\n" });
        s
    }
}

/// The rank of a dump file named `rank{R}.safetensors`.
fn dump_rank(path: &Path) -> Option<usize> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("rank")?.strip_suffix(".safetensors")?.parse().ok()
}

/// The dump files of `dump` (a `rank{R}.safetensors` file, or a directory of them), by rank.
pub fn dump_files(dump: &Path) -> Result<BTreeMap<usize, PathBuf>, ManifestError> {
    let mut out = BTreeMap::new();
    if dump.is_dir() {
        let entries = std::fs::read_dir(dump).map_err(|e| ManifestError::Read { path: dump.to_path_buf(), why: e.to_string() })?;
        for entry in entries.flatten() {
            let p = entry.path();
            if let Some(r) = dump_rank(&p) {
                out.insert(r, p);
            }
        }
        if out.is_empty() {
            return Err(ManifestError::NoDumps { path: dump.to_path_buf() });
        }
    } else {
        let r = dump_rank(dump).ok_or_else(|| ManifestError::DumpName { path: dump.to_path_buf() })?;
        out.insert(r, dump.to_path_buf());
    }
    Ok(out)
}

/// Diagnoses a digest that differs from rank `rank`'s expectation for `tensor`.
fn diagnose(manifest: &Manifest, rank: usize, tensor: &str, found: &str) -> Cause {
    if let Some(t) = manifest.ranks[rank].kernel.get(tensor) {
        for layout in Layout::WRONG.iter().map(|l| l.name()).chain(["other_scale_rule"]) {
            if t.wrong.get(layout).is_some_and(|d| d == found) {
                return Cause::WrongLayout { layout: layout.to_string() };
            }
        }
    }
    for other in manifest.ranks.iter().filter(|r| r.tp_rank != rank) {
        if let Some(t) = other.kernel.get(tensor) {
            if t.xxh3 == found {
                return Cause::OtherRank { rank: other.tp_rank, layout: "expected".into() };
            }
            if let Some((layout, _)) = t.wrong.iter().find(|(_, d)| *d == found) {
                return Cause::OtherRank { rank: other.tp_rank, layout: layout.clone() };
            }
        }
    }
    Cause::Unknown
}

/// Checks one dump file against rank `rank` of the manifest.
pub fn verify_file(manifest: &Manifest, rank: usize, path: &Path) -> Result<RankVerdict, ManifestError> {
    if rank >= manifest.tp_size {
        return Err(ManifestError::DumpRank { path: path.to_path_buf(), rank, tp_size: manifest.tp_size });
    }
    let read_err = |why: String| ManifestError::Read { path: path.to_path_buf(), why };
    let len = std::fs::metadata(path).map_err(|e| read_err(e.to_string()))?.len();
    if len > MAX_DUMP_BYTES {
        return Err(ManifestError::DumpFormat { path: path.to_path_buf(), why: format!("{len} bytes, more than {MAX_DUMP_BYTES}") });
    }
    let file = std::fs::File::open(path).map_err(|e| read_err(e.to_string()))?;
    // SAFETY: read-only map of a file that is only read here.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| read_err(e.to_string()))?;
    orchestrator_model::checkpoint::check_header(path, &map, "").map_err(|e| ManifestError::DumpFormat {
        path: path.to_path_buf(),
        why: match e {
            orchestrator_model::ModelError::MalformedHeader { why, .. } => format!("malformed safetensors header: {why}"),
            e => e.to_string(),
        },
    })?;
    let st = safetensors::SafeTensors::deserialize(&map)
        .map_err(|e| ManifestError::DumpFormat { path: path.to_path_buf(), why: e.to_string() })?;
    let expected = &manifest.ranks[rank];
    let (mut findings, mut notes) = (Vec::new(), Vec::new());
    let mut matching = 0;
    for (name, want) in &expected.kernel {
        let Ok(view) = st.tensor(name) else {
            findings.push(TensorFinding {
                tensor: name.clone(),
                verdict: "missing".into(),
                expected: want.xxh3.clone(),
                found: "nothing".into(),
                cause: None,
                explanation: None,
            });
            continue;
        };
        let found = Digest::of(view.data()).hex();
        let dtype = format!("{:?}", view.dtype());
        if found == want.xxh3 {
            matching += 1;
            if dtype != want.dtype || view.shape() != want.shape.as_slice() {
                notes.push(format!(
                    "{name}: bytes as expected, stored as {dtype} {:?} (the manifest says {} {:?})",
                    view.shape(),
                    want.dtype,
                    want.shape
                ));
            }
            continue;
        }
        let cause = Some(diagnose(manifest, rank, name, &found));
        findings.push(TensorFinding {
            tensor: name.clone(),
            verdict: "differs".into(),
            expected: format!("{} {:?} {}", want.dtype, want.shape, want.xxh3),
            found: format!("{dtype} {:?} {found}", view.shape()),
            explanation: cause.as_ref().map(ToString::to_string),
            cause,
        });
    }
    Ok(RankVerdict {
        tp_rank: rank,
        file: path.display().to_string(),
        ok: findings.is_empty(),
        checked: expected.kernel.len(),
        matching,
        findings,
        notes,
    })
}

/// Checks every dump file of `dump` against the manifest.
pub fn verify_dump(manifest: &Manifest, dump: &Path) -> Result<DumpVerdict, ManifestError> {
    let mut ranks = Vec::new();
    for (rank, path) in dump_files(dump)? {
        ranks.push(verify_file(manifest, rank, &path)?);
    }
    Ok(DumpVerdict {
        ok: ranks.iter().all(|r| r.ok),
        manifest_checkpoint_version: manifest.checkpoint_version.clone(),
        tp_size: manifest.tp_size,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(xxh3: &str, wrong: &[(&str, &str)]) -> ExpectedTensor {
        ExpectedTensor {
            dtype: "F8_E4M3".into(),
            shape: vec![1],
            xxh3: xxh3.into(),
            wrong: wrong.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    fn manifest() -> Manifest {
        let g = orchestrator_model::Preset::Tiny.geometry();
        let rank = |r: usize, kernel: ExpectedTensor| RankManifest {
            tp_rank: r,
            layout_identity: LayoutIdentity::new(&g, &RankShard::new(&g, 2, r).unwrap(), WeightFormat::Bf16, ScaleRule::Rceil),
            kernel_rank_digest: String::new(),
            source_rank_digest: String::new(),
            kernel: [("w".to_string(), kernel)].into(),
            source: BTreeMap::new(),
        };
        Manifest {
            manifest_version: MANIFEST_VERSION,
            generator: String::new(),
            checkpoint: String::new(),
            checkpoint_version: String::new(),
            tp_size: 2,
            scale_rule: "rceil".into(),
            ranks: vec![rank(0, tensor("a0", &[("permutation_skipped", "s0")])), rank(1, tensor("a1", &[("permuted_twice", "t1")]))],
        }
    }

    #[test]
    fn a_differing_digest_is_named_by_this_ranks_wrong_layouts_then_other_ranks() {
        let m = manifest();
        assert_eq!(diagnose(&m, 0, "w", "s0"), Cause::WrongLayout { layout: "permutation_skipped".into() });
        assert_eq!(diagnose(&m, 0, "w", "a1"), Cause::OtherRank { rank: 1, layout: "expected".into() });
        assert_eq!(diagnose(&m, 0, "w", "t1"), Cause::OtherRank { rank: 1, layout: "permuted_twice".into() });
        assert_eq!(diagnose(&m, 0, "w", "zz"), Cause::Unknown);
        assert_eq!(diagnose(&m, 0, "missing", "a1"), Cause::Unknown);
        assert_eq!(Cause::OtherRank { rank: 1, layout: "expected".into() }.to_string(), "rank 1's shard");
    }

    /// A TP size the model cannot take is refused before anything is sized by it (the largest
    /// `usize` once made a `Vec` of that capacity, and aborted).
    #[test]
    fn an_impossible_tp_size_is_refused_before_anything_is_sized_by_it() {
        let config = orchestrator_model::ModelConfig::from_preset(orchestrator_model::Preset::Tiny, Some(1), false).unwrap();
        let source = LoadSource::Dummy { config, generator: orchestrator_model::Generator::new(1) };
        for tp in [0, 3, 1 << 30, usize::MAX] {
            let e = build(&source, "dummy", tp, ScaleRule::Rceil).unwrap_err();
            assert!(e.to_string().contains(&format!("TP size {tp} is not allowed")), "{tp}: {e}");
        }
    }

    /// A dump's header goes through the same scan as a checkpoint shard's before the
    /// `safetensors` crate parses it: a shape of more dimensions than any tensor has is refused
    /// by name, a well-formed dump is checked.
    #[test]
    fn a_dump_with_a_malformed_header_is_refused_before_it_is_parsed() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |header: &str, data: &[u8]| {
            let path = tmp.path().join("rank0.safetensors");
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend_from_slice(data);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        let dims = vec!["1"; 20].join(",");
        let path = write(&format!(r#"{{"w":{{"dtype":"F8_E4M3","shape":[{dims}],"data_offsets":[0,1]}}}}"#), &[0]);
        let e = verify_file(&manifest(), 0, &path).unwrap_err();
        assert!(
            matches!(&e, ManifestError::DumpFormat { why, .. } if why.starts_with("malformed safetensors header: tensor `w`: `shape` has more than 8 entries")),
            "{e}"
        );
        let path = write(r#"{"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}"#, &[0]);
        let verdict = verify_file(&manifest(), 0, &path).unwrap();
        assert_eq!((verdict.checked, verdict.matching), (1, 0), "checked, and differs from the manifest's digest");
    }

    #[test]
    fn dump_files_are_named_by_rank() {
        assert_eq!(dump_rank(Path::new("/d/rank12.safetensors")), Some(12));
        for bad in ["/d/rank.safetensors", "/d/rankx.safetensors", "/d/rank1.bin", "/d/model.safetensors", "/d/rank-1.safetensors"] {
            assert_eq!(dump_rank(Path::new(bad)), None, "{bad}");
        }
    }
}
