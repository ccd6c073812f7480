//! Reading a Hugging Face checkpoint directory (`config.json`, `model.safetensors.index.json`,
//! shard files): shard files are memory-mapped on first use and only the rank's rows or
//! columns are copied out, so a rank touches only the pages it holds.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{SafeTensorError, SafeTensors};
use serde_json::Value;

use crate::ModelError;
use crate::config::ModelConfig;
use crate::geometry::WeightFormat;
use crate::names::{TensorSpec, checkpoint_tensors};
use crate::roots::AllowedRoots;
use orchestrator_kernels::Digest;

mod claim;
pub use claim::{ContentClaim, FileIdentity, RACY_MARGIN, VersionFrom};

pub const CONFIG_FILE: &str = "config.json";
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    pub config: ModelConfig,
    index_file: PathBuf,
    weight_map: BTreeMap<String, String>,
    shards: Mutex<HashMap<String, Arc<Shard>>>,
    /// Set by [`Checkpoint::open_within`]: a shard opened later is checked again.
    roots: Option<AllowedRoots>,
    /// See [`Checkpoint::content_version`].
    content_version: String,
    /// The digest of the frame the version covers (see [`ContentClaim`]).
    frame: String,
    version_from: VersionFrom,
    /// Where the content version was hashed here: each in-scope tensor's first illegal value
    /// (element index and what it is), found in the same pass (see [`Checkpoint::checked_values`]).
    /// (Behind a pointer: most checkpoints are opened from a claim and never hold one.)
    checked: Option<Arc<HashMap<String, Option<Illegal>>>>,
}

/// A tensor's first illegal value: its element index, and what it is.
pub type Illegal = (usize, &'static str);

/// One memory-mapped shard file with its parsed header.
pub struct Shard {
    pub path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
    /// The mapped file's identity and when it was taken (see [`ContentClaim`]).
    identity: Option<FileIdentity>,
    opened: std::time::SystemTime,
}

impl Shard {
    /// Maps and parses a shard. `wanted` names the tensor the caller is after, for errors.
    pub fn open(path: &Path, wanted: &str) -> Result<Self, ModelError> {
        crate::regular_file(path)?;
        let file = File::open(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingShard { file: path.to_path_buf(), tensor: wanted.to_string() }
            } else {
                ModelError::Io { path: path.to_path_buf(), source }
            }
        })?;
        let (identity, opened) = (FileIdentity::of(&file), std::time::SystemTime::now());
        // SAFETY: the map is read-only; checkpoints are not modified while loaded (a writer
        // replaces files by rename, which leaves this mapping on the old inode).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io { path: path.to_path_buf(), source })?;
        check_header(path, &mmap, wanted)?;
        let (n, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| diagnose(path, &mmap, e, wanted))?;
        let tensors = tensor_infos(&metadata);
        Ok(Self { path: path.to_path_buf(), mmap, data_start: 8 + n, tensors, identity, opened })
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Bytes of the mapping (ranges come from [`Checkpoint::row_range`]).
    pub fn slice(&self, range: Range<usize>) -> &[u8] {
        &self.mmap[range]
    }

    /// The stored bytes of a tensor.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let info = self.tensors.get(name)?;
        let (a, b) = info.data_offsets;
        self.mmap.get(self.data_start + a..self.data_start + b)
    }
}

/// Refuses a safetensors file whose JSON header declares more than
/// [`crate::limits::MAX_HEADER_BYTES`] or holds what would make the `safetensors` crate's parse
/// of it many times its size ([`header_scan`]), before that crate parses it: what every
/// safetensors file read here (a shard, an engine's dump) goes through first. `wanted` names
/// the tensor the caller is after, for errors.
pub fn check_header(path: &Path, mmap: &[u8], wanted: &str) -> Result<(), ModelError> {
    if let Some(n) = mmap.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        && n > crate::limits::MAX_HEADER_BYTES as u64
    {
        return Err(ModelError::MalformedHeader {
            file: path.to_path_buf(),
            tensor: wanted.to_string(),
            why: format!("the header declares {n} bytes, over the limit of {} (limits::MAX_HEADER_BYTES)", crate::limits::MAX_HEADER_BYTES),
        });
    }
    if let Some(json) = mmap.get(..8).and_then(|b| {
        let n = usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok()?;
        mmap.get(8..8usize.checked_add(n)?)
    }) && let Ok(json) = std::str::from_utf8(json)
        && let Err(e) = header_scan::scan(json)
    {
        return Err(ModelError::MalformedHeader { file: path.to_path_buf(), tensor: wanted.to_string(), why: e.to_string() });
    }
    Ok(())
}

/// A pass over a safetensors JSON header before the `safetensors` crate parses it, allocating
/// nothing but key names. The crate buffers every header entry into an in-memory tree first (its
/// header type has a flattened map), where a JSON array costs 16 to 32 times its text; this pass
/// refuses what would make that tree, or the parsed tensor infos, larger than a small multiple
/// of the header: a tensor entry that is not an object of `dtype` (a string), `shape` (at most
/// [`crate::limits::MAX_TENSOR_DIMS`] integers) and `data_offsets` (two integers), and a
/// `__metadata__` that is not a map of at most [`crate::limits::MAX_HEADER_METADATA_ENTRIES`]
/// strings. Whatever passes is still checked by the crate (offsets, sizes, dtypes).
mod header_scan {
    use std::fmt;

    use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    use crate::limits::{MAX_HEADER_METADATA_ENTRIES, MAX_TENSOR_DIMS};

    pub fn scan(json: &str) -> Result<(), serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(json);
        de.deserialize_map(Header)?;
        de.end()
    }

    struct Header;
    impl<'de> Visitor<'de> for Header {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a header object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                if key == "__metadata__" {
                    map.next_value_seed(Metadata)?;
                } else {
                    map.next_value_seed(Tensor(&key))?;
                }
            }
            Ok(())
        }
    }

    /// A string, not kept.
    struct Str;
    impl<'de> de::Deserialize<'de> for Str {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Str;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a string")
                }
                fn visit_str<E: de::Error>(self, _: &str) -> Result<Str, E> {
                    Ok(Str)
                }
            }
            d.deserialize_str(V)
        }
    }

    struct Metadata;
    impl<'de> DeserializeSeed<'de> for Metadata {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Metadata {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("`__metadata__`: a map of strings")
        }
        fn visit_unit<E: de::Error>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut n = 0usize;
            while map.next_key::<IgnoredAny>()?.is_some() {
                map.next_value::<Str>()?;
                n += 1;
                if n > MAX_HEADER_METADATA_ENTRIES {
                    return Err(de::Error::custom(format_args!(
                        "`__metadata__` has more than {MAX_HEADER_METADATA_ENTRIES} entries (limits::MAX_HEADER_METADATA_ENTRIES)"
                    )));
                }
            }
            Ok(())
        }
    }

    struct Tensor<'k>(&'k str);
    impl<'de> DeserializeSeed<'de> for Tensor<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Tensor<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "tensor `{}`: an object of dtype, shape and data_offsets", self.0)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                match key.as_str() {
                    "dtype" => {
                        map.next_value::<Str>()?;
                    }
                    "shape" => map.next_value_seed(Ints { tensor: self.0, field: "shape", max: MAX_TENSOR_DIMS })?,
                    "data_offsets" => map.next_value_seed(Ints { tensor: self.0, field: "data_offsets", max: 2 })?,
                    other => {
                        return Err(de::Error::custom(format_args!(
                            "tensor `{}` has an unknown field `{}`",
                            self.0,
                            crate::config::excerpt(other)
                        )));
                    }
                }
            }
            Ok(())
        }
    }

    /// An array of at most `max` non-negative integers.
    struct Ints<'k> {
        tensor: &'k str,
        field: &'static str,
        max: usize,
    }
    impl<'de> DeserializeSeed<'de> for Ints<'_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_seq(self)
        }
    }
    impl<'de> Visitor<'de> for Ints<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "tensor `{}`: `{}`, an array of at most {} integers", self.tensor, self.field, self.max)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let mut n = 0usize;
            while seq.next_element::<u64>()?.is_some() {
                n += 1;
                if n > self.max {
                    return Err(de::Error::custom(format_args!(
                        "tensor `{}`: `{}` has more than {} entries",
                        self.tensor, self.field, self.max
                    )));
                }
            }
            Ok(())
        }
    }
}

fn tensor_infos(metadata: &Metadata) -> HashMap<String, TensorInfo> {
    metadata.tensors().into_iter().map(|(k, v)| (k, v.clone())).collect()
}

/// Turns a safetensors parse failure into an error that names the file and a tensor.
fn diagnose(path: &Path, bytes: &[u8], err: SafeTensorError, wanted: &str) -> ModelError {
    let file = path.to_path_buf();
    let malformed = |why: String| ModelError::MalformedHeader { file: file.clone(), tensor: wanted.to_string(), why };
    match err {
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => {
            let declared = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
            ModelError::Truncated {
                file,
                tensor: format!("(header, wanted `{wanted}`)"),
                needed: declared.map_or(8, |n| 8usize.saturating_add(n as usize)),
                available: bytes.len(),
            }
        }
        SafeTensorError::MetadataIncompleteBuffer
        | SafeTensorError::InvalidOffset(_)
        | SafeTensorError::TensorInvalidInfo
        | SafeTensorError::ValidationOverflow => diagnose_offsets(path, bytes, wanted).unwrap_or_else(|| malformed(err.to_string())),
        other => malformed(other.to_string()),
    }
}

/// Finds which tensor's offsets break the file. In order: a tensor whose byte range does not
/// match its dtype and shape (or overflows); a tensor reaching past the data section (a
/// truncation when the header is otherwise contiguous from 0, a bad offset otherwise); a gap or
/// overlap between consecutive tensors.
fn diagnose_offsets(path: &Path, bytes: &[u8], wanted: &str) -> Option<ModelError> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header: Value = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let data_len = bytes.len() - 8 - n;
    let bad = |tensor: &str, why: String| ModelError::BadOffsets { file: path.to_path_buf(), tensor: tensor.to_string(), why };
    let mut entries: Vec<(String, usize, usize)> = Vec::new();
    for (name, v) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let offs = v.get("data_offsets")?.as_array()?;
        let a = usize::try_from(offs.first()?.as_u64()?).ok()?;
        let b = usize::try_from(offs.get(1)?.as_u64()?).ok()?;
        let dtype: Option<safetensors::Dtype> = serde_json::from_value(v.get("dtype")?.clone()).ok();
        let numel = v
            .get("shape")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, d| d.as_u64().and_then(|x| usize::try_from(x).ok()).and_then(|x| acc.checked_mul(x)));
        let size = match (dtype, numel) {
            (Some(d), Some(e)) => e.checked_mul(d.bitsize()).map(|bits| bits / 8),
            (Some(_), None) => return Some(bad(name, "its shape's element count overflows".to_string())),
            (None, _) => None,
        };
        if b < a {
            return Some(bad(name, format!("data_offsets [{a}, {b}) end before they start")));
        }
        match size {
            Some(sz) if sz != b - a => {
                return Some(bad(name, format!("data_offsets [{a}, {b}) hold {} bytes, its dtype and shape need {sz}", b - a)));
            }
            None if dtype.is_some() => return Some(bad(name, "its byte size overflows".to_string())),
            _ => {}
        }
        entries.push((name.clone(), a, b));
    }
    entries.sort_by_key(|e| (e.1, e.2));
    let contiguous = entries.iter().scan(0usize, |end, e| {
        let ok = e.1 == *end;
        *end = e.2;
        Some(ok)
    });
    let header_consistent = contiguous.clone().all(|ok| ok);
    if let Some(past) = entries.iter().filter(|e| e.2 > data_len).min_by_key(|e| e.1) {
        // Past the end: a truncation if everything before it is contiguous, otherwise the
        // tensor's offsets themselves are wrong.
        let before_contiguous = entries.iter().zip(contiguous.clone()).take_while(|(e, _)| e.1 <= past.1).all(|(_, ok)| ok);
        return Some(if header_consistent || (before_contiguous && past.2 == entries.iter().map(|e| e.2).max().unwrap_or(0)) {
            ModelError::Truncated { file: path.to_path_buf(), tensor: past.0.clone(), needed: past.2, available: data_len }
        } else {
            bad(
                &past.0,
                format!(
                    "data_offsets [{}, {}) lie outside the file's data section of {data_len} bytes (looking for `{wanted}`)",
                    past.1, past.2
                ),
            )
        });
    }
    let (broken, _) = entries.iter().zip(contiguous).find(|(_, ok)| !ok)?;
    Some(bad(&broken.0, format!("data_offsets [{}, {}) leave a gap or overlap with the previous tensor", broken.1, broken.2)))
}

/// An in-scope tensor as the headers describe it.
enum Scoped {
    /// Not in the index, or not in its shard's header.
    Missing,
    /// Its shard does not open.
    Unreadable,
    Found {
        shard: Arc<Shard>,
        described: String,
        /// As the shard's header stores it (its values are checked as that).
        dtype: safetensors::Dtype,
    },
}

/// What [`Checkpoint::content_version`] covers, before any tensor byte is read.
struct Content {
    head: String,
    /// The head, then per tensor its name, dtype, shape, file and offsets (or why it is not
    /// there): everything but the bytes ([`ContentClaim::frame`] is its digest).
    frame: String,
    tensors: Vec<(String, Scoped)>,
}

impl Content {
    /// The text [`Checkpoint::content_version`] hashes (tensors hashed in parallel), and each
    /// found tensor's first illegal value, checked in the same pass.
    fn text(&self) -> (String, HashMap<String, Option<Illegal>>) {
        use rayon::prelude::*;
        let lines: Vec<(String, Option<Option<Illegal>>)> = self
            .tensors
            .par_iter()
            .map(|(name, t)| match t {
                Scoped::Missing => (format!("{name} missing\n"), None),
                Scoped::Unreadable => (format!("{name} unreadable\n"), None),
                Scoped::Found { shard, described, dtype } => {
                    let (digest, illegal) = crate::inspect::digest_checked(*dtype, shard.bytes(name).unwrap_or_default());
                    (format!("{name} {described} {}\n", digest.hex()), Some(illegal))
                }
            })
            .collect();
        let mut text = self.head.clone();
        let mut checked = HashMap::new();
        for ((name, _), (line, illegal)) in self.tensors.iter().zip(lines) {
            text.push_str(&line);
            if let Some(illegal) = illegal {
                checked.insert(name.clone(), illegal);
            }
        }
        (text, checked)
    }
}

impl Checkpoint {
    /// Opens a checkpoint directory: reads `config.json` and the index (or, for a single-file
    /// export without an index, the header of `model.safetensors`).
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        Self::open_inner(dir.to_path_buf(), None, None)
    }

    /// [`Checkpoint::open`] of a directory that must lie under `roots`, and so must every file
    /// it is read from: the directory, `config.json`, the index and every shard file the index
    /// names are resolved (symlinks followed) and any that resolves outside the roots is
    /// refused with [`ModelError::Roots`] ([`crate::RootsError::Outside`] naming the file and where it
    /// resolves to). A file that does not exist is left to the usual error when it is read. The
    /// checkpoint's directory is the canonical one.
    pub fn open_within(dir: &Path, roots: &AllowedRoots) -> Result<Self, ModelError> {
        Self::open_within_claimed(dir, roots, None)
    }

    /// [`Checkpoint::open_within`], adopting the content version of `claim` when this process
    /// sees the very files it was computed from ([`ContentClaim`]), else hashing as usual.
    pub fn open_within_claimed(dir: &Path, roots: &AllowedRoots, claim: Option<&ContentClaim>) -> Result<Self, ModelError> {
        let canonical = roots.check(dir)?;
        Self::open_inner(canonical, Some(roots.clone()), claim)
    }

    fn open_inner(dir: PathBuf, roots: Option<AllowedRoots>, claim: Option<&ContentClaim>) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::Io {
                path: dir.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "checkpoint directory does not exist"),
            });
        }
        let admit = |path: &Path| -> Result<(), ModelError> {
            if let Some(r) = &roots {
                r.check_file(path)?;
            }
            Ok(())
        };
        let config_file = dir.join(CONFIG_FILE);
        admit(&config_file)?;
        let config = ModelConfig::read(&config_file)?;
        let index_file = dir.join(INDEX_FILE);
        let shards = Mutex::new(HashMap::new());
        let weight_map = if index_file.exists() {
            admit(&index_file)?;
            let map = read_index(&index_file)?;
            let files: std::collections::BTreeSet<&String> = map.values().collect();
            for f in files {
                admit(&dir.join(f))?;
            }
            map
        } else {
            let single = dir.join(SINGLE_FILE);
            admit(&single)?;
            let shard = Shard::open(&single, "(any)")?;
            let map = shard.names().map(|n| (n.to_string(), SINGLE_FILE.to_string())).collect();
            shards.lock().unwrap_or_else(|p| p.into_inner()).insert(SINGLE_FILE.to_string(), Arc::new(shard));
            map
        };
        let mut ck = Self {
            dir,
            config,
            index_file,
            weight_map,
            shards,
            roots,
            content_version: String::new(),
            frame: String::new(),
            version_from: VersionFrom::Hashed,
            checked: None,
        };
        let content = ck.content();
        ck.frame = Digest::of(content.frame.as_bytes()).hex();
        match claim {
            Some(c) if c.frame == ck.frame && ck.files().is_some_and(|f| f == c.files) => {
                ck.content_version = c.version.clone();
                ck.version_from = VersionFrom::Claim;
            }
            _ => {
                let (text, checked) = content.text();
                ck.content_version = Digest::of(text.as_bytes()).hex();
                ck.checked = Some(Arc::new(checked));
            }
        }
        Ok(ck)
    }

    /// The first illegal value of in-scope tensor `name` (element index, and what it is) as the
    /// pass that hashed the content version found it, checking each value as the tensor's stored
    /// dtype (see [`crate::inspect`]); `None` where no such pass read the tensor (the version was
    /// adopted from a claim, or the tensor is not in scope or was not found).
    pub fn checked_values(&self, name: &str) -> Option<Option<Illegal>> {
        self.checked.as_ref()?.get(name).copied()
    }

    /// How the content version was had: hashed here, or adopted from a claim.
    pub fn version_from(&self) -> VersionFrom {
        self.version_from
    }

    /// The claim other processes on this host can open this checkpoint with, adopting its
    /// version instead of hashing again; `None` when a shard file changed less than
    /// [`RACY_MARGIN`] before it was opened (or its identity is unknown).
    pub fn content_claim(&self) -> Option<ContentClaim> {
        self.claim_with_margin(RACY_MARGIN)
    }

    /// [`Checkpoint::content_claim`] with another margin (tests of freshly written files).
    #[doc(hidden)]
    pub fn claim_with_margin(&self, margin: std::time::Duration) -> Option<ContentClaim> {
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        if self.in_scope_files().iter().any(|f| shards.get(*f).is_none_or(|s| s.identity.is_none_or(|i| i.racy(s.opened, margin)))) {
            return None;
        }
        drop(shards);
        Some(ContentClaim { version: self.content_version.clone(), frame: self.frame.clone(), files: self.files()? })
    }

    /// The shard files the in-scope tensors lie in, sorted.
    fn in_scope_files(&self) -> Vec<&str> {
        let mut files: Vec<&str> = checkpoint_tensors(&self.config.geometry, self.config.format)
            .iter()
            .filter_map(|s| self.weight_map.get(&s.name).map(String::as_str))
            .collect();
        files.sort_unstable();
        files.dedup();
        files
    }

    /// The identity of every opened in-scope shard file (`None` when one is unknown).
    fn files(&self) -> Option<BTreeMap<String, FileIdentity>> {
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        self.in_scope_files().into_iter().filter_map(|f| shards.get(f).map(|s| Some((f.to_string(), s.identity?)))).collect()
    }

    /// The checkpoint's version: a digest of its content, computed once when it is opened
    /// (from the bytes mapped then, which are the bytes a load reads), 16 lowercase hex digits.
    ///
    /// Definition: XXH3-64 (seed 0) of the UTF-8 text
    ///
    /// ```text
    /// orchestrator checkpoint content v1
    /// geometry hidden={hidden} layers={layers} heads={heads} kv_heads={kv_heads} head_dim={head_dim} rope_dim={rope_dim} q_lora_rank={q} o_lora_rank={o} o_groups={g}
    /// format fp8 block={rows}x{cols}        (or: format bf16)
    /// {name} {dtype} [{d0},{d1},...] {xxh3}  one line per in-scope tensor, sorted by name (bytes)
    /// ```
    ///
    /// where the in-scope tensors are those the geometry and format define (spec section 3:
    /// `wq_b`, `wo_a`, `wo_b` weights and scales, `attn_sink`, every layer), `{dtype}` and the
    /// shape are as the shard's header stores them (`F8_E4M3`, `F8_E8M0`, `BF16`, `F32`), and
    /// `{xxh3}` is XXH3-64 of the tensor's stored bytes as 16 lowercase hex digits (spec section
    /// 9). A tensor that cannot be read has the line `{name} missing` (not in the index or not in
    /// its shard's header) or `{name} unreadable` (its shard does not open); loading it reports
    /// why. Every line ends with `\n`. The JSON text of `config.json` and of the index does not
    /// enter: two checkpoints with the same tensors have the same version wherever they lie
    /// and however their JSON is formatted; different weights give different versions.
    /// Tensors are hashed in parallel.
    pub fn content_version(&self) -> &str {
        &self.content_version
    }

    /// The in-scope tensors as the headers describe them: the frame of the version, and what
    /// its text needs (each shard is opened once, in order).
    fn content(&self) -> Content {
        let g = &self.config.geometry;
        let mut head = format!(
            "orchestrator checkpoint content v1\ngeometry hidden={} layers={} heads={} kv_heads={} head_dim={} rope_dim={} \
             q_lora_rank={} o_lora_rank={} o_groups={}\n",
            g.hidden, g.layers, g.heads, g.kv_heads, g.head_dim, g.rope_dim, g.q_lora_rank, g.o_lora_rank, g.o_groups
        );
        match self.config.format {
            WeightFormat::Fp8 { block: [a, b] } => head.push_str(&format!("format fp8 block={a}x{b}\n")),
            WeightFormat::Bf16 => head.push_str("format bf16\n"),
        }
        let mut specs = checkpoint_tensors(g, self.config.format);
        specs.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        // Each file's first tensor (in name order), found in one pass over the index (a search of
        // the index per file was quadratic: 10^10 steps for a large hostile one).
        let mut first: HashMap<&str, &str> = HashMap::new();
        for (tensor, file) in &self.weight_map {
            first.entry(file.as_str()).or_insert(tensor.as_str());
        }
        let opened: HashMap<&str, Option<Arc<Shard>>> =
            self.in_scope_files().into_iter().map(|f| (f, self.shard_of(first.get(f).copied().unwrap_or("(any)")).ok())).collect();
        let mut frame = head.clone();
        let tensors = specs
            .into_iter()
            .map(|spec| {
                let name = spec.name;
                let Some(file) = self.weight_map.get(&name) else { return (name, Scoped::Missing) };
                let Some(shard) = opened.get(file.as_str()).and_then(Option::as_ref) else { return (name, Scoped::Unreadable) };
                let Some(info) = shard.info(&name).filter(|_| shard.bytes(&name).is_some()) else { return (name, Scoped::Missing) };
                let shape = info.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
                let described = format!("{:?} [{shape}]", info.dtype);
                let (a, b) = info.data_offsets;
                frame.push_str(&format!("{name} {described} {file} {a} {b}\n"));
                (name, Scoped::Found { shard: shard.clone(), described, dtype: info.dtype })
            })
            .collect();
        Content { head, frame, tensors }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name in the index with its shard file.
    pub fn weight_map(&self) -> &BTreeMap<String, String> {
        &self.weight_map
    }

    /// The shard file that holds `tensor`, per the index.
    pub fn file_of(&self, tensor: &str) -> Result<PathBuf, ModelError> {
        self.weight_map
            .get(tensor)
            .map(|f| self.dir.join(f))
            .ok_or_else(|| ModelError::MissingTensor { tensor: tensor.to_string(), index: self.index_file.clone() })
    }

    /// The mapped shard holding `tensor` (opened on first use).
    pub fn shard_of(&self, tensor: &str) -> Result<Arc<Shard>, ModelError> {
        let file = self
            .weight_map
            .get(tensor)
            .ok_or_else(|| ModelError::MissingTensor { tensor: tensor.to_string(), index: self.index_file.clone() })?;
        if let Some(s) = self.shards.lock().unwrap_or_else(|p| p.into_inner()).get(file) {
            return Ok(s.clone());
        }
        let path = self.dir.join(file);
        if let Some(roots) = &self.roots {
            roots.check_file(&path)?;
        }
        let shard = Arc::new(Shard::open(&path, tensor)?);
        let mut map = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        Ok(map.entry(file.clone()).or_insert(shard).clone())
    }

    /// The stored bytes of a whole tensor after checking its dtype and shape against `spec`.
    pub fn tensor_bytes(&self, spec: &TensorSpec) -> Result<(Arc<Shard>, Range<usize>), ModelError> {
        let shard = self.shard_of(&spec.name)?;
        let info =
            shard.info(&spec.name).ok_or_else(|| ModelError::MissingTensor { tensor: spec.name.clone(), index: shard.path.clone() })?;
        if info.dtype != spec.dtype {
            return Err(ModelError::WrongDtype {
                file: shard.path.clone(),
                tensor: spec.name.clone(),
                expected: format!("{:?}", spec.dtype),
                found: format!("{:?}", info.dtype),
            });
        }
        if info.shape != spec.shape {
            return Err(ModelError::WrongShape {
                file: shard.path.clone(),
                tensor: spec.name.clone(),
                expected: spec.shape.clone(),
                found: info.shape.clone(),
            });
        }
        let (a, b) = info.data_offsets;
        let range = shard.data_start + a..shard.data_start + b;
        Ok((shard, range))
    }

    /// Where rows `rows` of a checked tensor lie in its shard's mapping (rows are contiguous,
    /// so the caller can read them in place, without a copy).
    pub fn row_range(&self, spec: &TensorSpec, rows: Range<usize>) -> Result<(Arc<Shard>, Range<usize>), ModelError> {
        let (shard, range) = self.tensor_bytes(spec)?;
        if rows.end > spec.rows() || rows.start > rows.end {
            return Err(ModelError::WrongShape {
                file: shard.path.clone(),
                tensor: format!("{} (rows {rows:?} requested)", spec.name),
                expected: vec![rows.end, spec.cols()],
                found: spec.shape.clone(),
            });
        }
        let row_bytes = spec.cols() * spec.element_bytes();
        let start = range.start + rows.start * row_bytes;
        Ok((shard, start..start + rows.len() * row_bytes))
    }

    /// Copies rows `rows` and columns `cols` of a checked 2-D (or 1-D: one row) tensor into
    /// `out`, row-major, touching only those bytes of the mapping.
    pub fn read_slice(&self, spec: &TensorSpec, rows: Range<usize>, cols: Range<usize>, out: &mut Vec<u8>) -> Result<PathBuf, ModelError> {
        let (shard, range) = self.tensor_bytes(spec)?;
        if rows.end > spec.rows() || cols.end > spec.cols() || rows.start > rows.end || cols.start > cols.end {
            return Err(ModelError::WrongShape {
                file: shard.path.clone(),
                tensor: format!("{} (rows {rows:?}, columns {cols:?} requested)", spec.name),
                expected: vec![rows.end, cols.end],
                found: spec.shape.clone(),
            });
        }
        let data = &shard.mmap[range];
        let width = spec.cols();
        let es = spec.element_bytes();
        out.clear();
        if cols.start == 0 && cols.end == width {
            out.extend_from_slice(&data[rows.start * width * es..rows.end * width * es]);
        } else {
            out.reserve(rows.len() * cols.len() * es);
            for r in rows {
                out.extend_from_slice(&data[(r * width + cols.start) * es..(r * width + cols.end) * es]);
            }
        }
        Ok(shard.path.clone())
    }
}

/// The raw `weight_map` of an index; `metadata` and every other field are skipped unread.
#[derive(serde::Deserialize)]
struct IndexFields<'a> {
    #[serde(borrow, default)]
    weight_map: Option<&'a serde_json::value::RawValue>,
}

fn read_index(file: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    let bytes = crate::config::read_bounded(file, crate::limits::MAX_INDEX_BYTES)?;
    parse_index(&bytes, file)
}

/// Parses a `model.safetensors.index.json` (`file` names it in errors): its `weight_map`,
/// tensor name to shard file name. A file name with `/` or `..`, or an empty one, is refused
/// (shards lie in the checkpoint directory itself). Nothing is copied into a JSON tree: the
/// only allocations are the map's names.
pub fn parse_index(bytes: &[u8], file: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    use serde_json::value::RawValue;
    let err = |why: String| ModelError::Index { file: file.to_path_buf(), why };
    let text = std::str::from_utf8(bytes).map_err(|e| err(format!("not UTF-8: {e}")))?;
    if !text.trim_start().starts_with('{') {
        return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
            Err(e) => err(format!("malformed JSON: {e}")),
            Ok(_) => err("top level is not an object".into()),
        });
    }
    let fields: IndexFields = serde_json::from_str(text).map_err(|e| err(format!("malformed JSON: {e}")))?;
    let raw = fields.weight_map.filter(|m| m.get().starts_with('{')).ok_or_else(|| err("no `weight_map` object".into()))?;
    let map: BTreeMap<String, &RawValue> = serde_json::from_str(raw.get()).map_err(|e| err(format!("malformed weight_map: {e}")))?;
    map.into_iter()
        .map(|(k, f)| {
            let f = serde_json::from_str::<String>(f.get())
                .map_err(|_| err(format!("weight_map[`{k}`] is {}, expected a file name", crate::config::excerpt(f.get()))))?;
            if f.is_empty() || f.contains('/') || f.contains('\\') || f.contains("..") {
                return Err(err(format!("weight_map[`{k}`] = `{f}` points outside the checkpoint directory")));
            }
            Ok((k, f))
        })
        .collect()
}
