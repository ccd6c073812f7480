//! Damaged checkpoints: every kind of bad input is refused with the right error kind, and the
//! error names the file and the tensor (positions are absolute checkpoint positions).
//!
//! Each test writes a small synthetic checkpoint (tiny preset, 1-2 layers), damages it the way
//! a broken download or a buggy exporter would, and loads it as the worker does.

use std::path::{Path, PathBuf};

use orchestrator_kernels::{CpuBackend, KernelError, ScaleRule};
use orchestrator_model::checkpoint::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
use orchestrator_model::inspect::inspect;
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Checkpoint, ModelConfig, ModelError, Preset, WeightFormat};
use orchestrator_worker::{LoadError, LoadSource, RankLoader, RankWeights};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use tempfile::TempDir;

const FP8: WeightFormat = WeightFormat::Fp8 { block: [32, 32] };
const BF16: WeightFormat = WeightFormat::Bf16;

/// Shards of at most this size put every big weight of the tiny preset in its own file.
const SMALL_SHARDS: usize = 1_000_000;

fn tiny_config(format: WeightFormat, layers: usize) -> ModelConfig {
    let mut geometry = Preset::Tiny.geometry();
    geometry.layers = layers;
    ModelConfig { family: Preset::Tiny.family(), geometry, format }
}

/// Writes a valid tiny checkpoint into `tmp/ckpt` and returns its directory.
fn synth(tmp: &TempDir, format: WeightFormat, layers: usize, max_shard_bytes: usize) -> PathBuf {
    let dir = tmp.path().join("ckpt");
    let opts = SynthOptions { config: tiny_config(format, layers), seed: 11, max_shard_bytes, preset_name: Some("tiny".into()) };
    write_checkpoint(&dir, &opts).expect("synthesizing the tiny checkpoint");
    dir
}

fn load(dir: &Path, tp: usize, rank: usize) -> Result<RankWeights<CpuBackend>, LoadError> {
    let source = LoadSource::open_checkpoint(dir)?;
    let loader = RankLoader::new(&CpuBackend, source.config(), tp, rank, ScaleRule::Rceil)?;
    loader.load(&source)
}

/// Loads and expects a failure.
fn load_err(dir: &Path, tp: usize, rank: usize) -> LoadError {
    match load(dir, tp, rank) {
        Ok(_) => panic!("TP {tp} rank {rank} loaded {} although it is damaged", dir.display()),
        Err(e) => e,
    }
}

fn read_index(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

/// The shard file holding `tensor`, per the index.
fn shard_of(dir: &Path, tensor: &str) -> PathBuf {
    let index = read_index(dir);
    let file = index["weight_map"][tensor].as_str().unwrap_or_else(|| panic!("{tensor} is not in the index"));
    dir.join(file)
}

/// A shard's header: its declared length and its JSON.
fn read_header(path: &Path) -> (usize, Value) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (n, serde_json::from_slice(&bytes[8..8 + n]).unwrap())
}

/// Absolute byte range of a tensor's data in its shard file.
fn data_range(path: &Path, tensor: &str) -> std::ops::Range<usize> {
    let (n, header) = read_header(path);
    let offs = &header[tensor]["data_offsets"];
    let (a, b) = (offs[0].as_u64().unwrap() as usize, offs[1].as_u64().unwrap() as usize);
    8 + n + a..8 + n + b
}

/// The tensor of a shard whose data comes last in the file.
fn last_tensor(path: &Path) -> (String, usize, usize) {
    let (_, header) = read_header(path);
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["data_offsets"][0].as_u64().unwrap() as usize, v["data_offsets"][1].as_u64().unwrap() as usize))
        .max_by_key(|e| e.2)
        .unwrap()
}

/// Overwrites bytes of a file at an absolute position.
fn poke(path: &Path, at: usize, bytes: &[u8]) {
    let mut data = std::fs::read(path).unwrap();
    data[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(path, data).unwrap();
}

/// Rewrites a shard's header JSON in place, keeping the header length field: the new JSON is
/// padded with spaces (the `__metadata__` entry is dropped if the new JSON would not fit).
fn rewrite_header(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut data = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_string(&header).unwrap();
    if text.len() > n {
        header.as_object_mut().unwrap().remove("__metadata__");
        text = serde_json::to_string(&header).unwrap();
    }
    assert!(text.len() <= n, "the edited header ({} bytes) does not fit in {n}", text.len());
    let mut padded = text.into_bytes();
    padded.resize(n, b' ');
    data[8..8 + n].copy_from_slice(&padded);
    std::fs::write(path, data).unwrap();
}

/// Rewrites a shard with the `safetensors` crate, letting `change` replace one tensor's dtype,
/// shape and bytes.
fn rewrite_shard(path: &Path, tensor: &str, change: impl FnOnce(Dtype, &[usize], &[u8]) -> (Dtype, Vec<usize>, Vec<u8>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut change = Some(change);
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (dtype, shape, data) = if name == tensor {
            (change.take().unwrap())(view.dtype(), view.shape(), view.data())
        } else {
            (view.dtype(), view.shape().to_vec(), view.data().to_vec())
        };
        owned.push((name, dtype, shape, data));
    }
    assert!(change.is_none(), "{tensor} is not in {}", path.display());
    let views: Vec<(String, TensorView<'_>)> =
        owned.iter().map(|(name, dtype, shape, data)| (name.clone(), TensorView::new(*dtype, shape.clone(), data).unwrap())).collect();
    drop(st);
    safetensors::serialize_to_file(views, Some([("format".to_string(), "pt".to_string())].into()), path).unwrap();
}

/// Asserts that a message names the tensor and the file.
fn assert_names(msg: &str, tensor: &str, file: &Path) {
    assert!(msg.contains(tensor), "`{msg}` does not name tensor {tensor}");
    assert!(msg.contains(&file.display().to_string()), "`{msg}` does not name file {}", file.display());
}

// 1. A tensor missing from the index.
#[test]
fn missing_tensor_in_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_a.weight";
    let mut index = read_index(&dir);
    assert!(index["weight_map"].as_object_mut().unwrap().remove(name).is_some());
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_vec_pretty(&index).unwrap()).unwrap();

    let err = load_err(&dir, 1, 0);
    let msg = err.to_string();
    match &err {
        LoadError::Model(ModelError::MissingTensor { tensor, index }) => {
            assert_eq!(tensor, name);
            assert_eq!(index, &dir.join(INDEX_FILE));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert_names(&msg, name, &dir.join(INDEX_FILE));
    assert_eq!(err.tensor(), Some(name));
}

// 1b. The index points at a shard that does not hold the tensor.
#[test]
fn tensor_missing_from_its_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, SMALL_SHARDS);
    let name = "layers.0.attn.wo_a.weight";
    let other = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let mut index = read_index(&dir);
    index["weight_map"][name] = Value::String(other.file_name().unwrap().to_string_lossy().into_owned());
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_vec_pretty(&index).unwrap()).unwrap();

    let err = load_err(&dir, 1, 0);
    assert!(matches!(&err, LoadError::Model(ModelError::MissingTensor { tensor, index }) if tensor == name && index == &other), "{err:?}");
    assert_names(&err.to_string(), name, &other);
}

// 2. A shard file deleted.
#[test]
fn missing_shard_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 2, SMALL_SHARDS);
    let name = "layers.1.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    // The weight has a shard of its own, so the error can only be about it.
    let index = read_index(&dir);
    let holders: Vec<&String> =
        index["weight_map"].as_object().unwrap().iter().filter(|(_, f)| dir.join(f.as_str().unwrap()) == path).map(|(k, _)| k).collect();
    assert_eq!(holders, vec![name]);
    std::fs::remove_file(&path).unwrap();

    let err = load_err(&dir, 2, 1);
    match &err {
        LoadError::Model(ModelError::MissingShard { file, tensor }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, name);
        }
        other => panic!("expected MissingShard, got {other:?}"),
    }
    assert_names(&err.to_string(), name, &path);
}

// 3. A tensor stored with another dtype.
#[test]
fn wrong_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    rewrite_shard(&path, name, |_, shape, data| (Dtype::U8, shape.to_vec(), data.to_vec()));

    let err = load_err(&dir, 2, 0);
    match &err {
        LoadError::Model(ModelError::WrongDtype { file, tensor, expected, found }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, name);
            assert_eq!(expected, "F8_E4M3");
            assert_eq!(found, "U8");
        }
        other => panic!("expected WrongDtype, got {other:?}"),
    }
    assert_names(&err.to_string(), name, &path);
}

// 3b. The F32 attention sink exported as BF16 (a different byte size too).
#[test]
fn wrong_dtype_of_attn_sink() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, BF16, 1, usize::MAX);
    let name = "layers.0.attn.attn_sink";
    let path = shard_of(&dir, name);
    rewrite_shard(&path, name, |_, shape, data| (Dtype::BF16, shape.to_vec(), data[..data.len() / 2].to_vec()));

    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::WrongDtype { file, tensor, expected, found })
            if file == &path && tensor == name && expected == "F32" && found == "BF16"),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
}

// 4. A tensor stored with another shape (same number of elements).
#[test]
fn wrong_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    rewrite_shard(&path, name, |dtype, shape, data| {
        assert_eq!(shape, &[512, 4096]);
        (dtype, vec![1024, 2048], data.to_vec())
    });

    let err = load_err(&dir, 2, 1);
    match &err {
        LoadError::Model(ModelError::WrongShape { file, tensor, expected, found }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, name);
            assert_eq!(expected, &vec![512, 4096]);
            assert_eq!(found, &vec![1024, 2048]);
        }
        other => panic!("expected WrongShape, got {other:?}"),
    }
    assert_names(&err.to_string(), name, &path);
}

// 4b. A scale with the wrong shape (and size).
#[test]
fn wrong_shape_of_scale() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wq_b.scale";
    let path = shard_of(&dir, name);
    rewrite_shard(&path, name, |dtype, shape, data| {
        assert_eq!(shape, &[1024, 2]);
        (dtype, vec![1024], data[..1024].to_vec())
    });

    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::WrongShape { file, tensor, expected, found })
            if file == &path && tensor == name && expected == &vec![1024, 2] && found == &vec![1024]),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
}

// 5. A shard cut short: the error names the tensor whose data is cut.
#[test]
fn truncated_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let path = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let (last, start, end) = last_tensor(&path);
    let cut = 16.min(end - start);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - cut as u64).unwrap();

    let err = load_err(&dir, 2, 0);
    match &err {
        LoadError::Model(ModelError::Truncated { file, tensor, needed, available }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, &last);
            assert_eq!(*needed, end);
            assert_eq!(*available, end - cut);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    assert_names(&err.to_string(), &last, &path);
}

// 5b. A shard cut in the middle of a tensor that is not the last one.
#[test]
fn truncated_shard_names_the_first_cut_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, BF16, 1, usize::MAX);
    let name = "layers.0.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    let range = data_range(&path, name);
    assert!(range.end < std::fs::metadata(&path).unwrap().len() as usize, "{name} should not be last");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len((range.start + 1000) as u64).unwrap();

    let err = load_err(&dir, 1, 0);
    assert!(matches!(&err, LoadError::Model(ModelError::Truncated { file, tensor, .. }) if file == &path && tensor == name), "{err:?}");
    assert_names(&err.to_string(), name, &path);
}

// 5c. A shard cut inside its header.
#[test]
fn truncated_inside_the_header() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let path = shard_of(&dir, "layers.0.attn.wq_b.weight");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();

    let err = load_err(&dir, 1, 0);
    assert!(matches!(&err, LoadError::Model(ModelError::Truncated { file, .. }) if file == &path), "{err:?}");
    // The first tensor the loader asks for.
    assert_names(&err.to_string(), "layers.0.attn.wq_b.weight", &path);
}

// 6. Header offsets that point past the end of the file (header length unchanged).
#[test]
fn header_offsets_past_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let path = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let (last, _, end) = last_tensor(&path);
    let file_len = std::fs::metadata(&path).unwrap().len();
    rewrite_header(&path, |h| h[&last]["data_offsets"][1] = Value::from(end + 4096));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), file_len);

    let err = load_err(&dir, 2, 1);
    match &err {
        LoadError::Model(ModelError::BadOffsets { file, tensor, why }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, &last);
            assert!(why.contains(&(end + 4096).to_string()), "{why}");
        }
        other => panic!("expected BadOffsets, got {other:?}"),
    }
    assert_names(&err.to_string(), &last, &path);
}

// 6b. Offsets of a tensor in the middle of the file moved past the end (size kept). The error
// must name the tensor whose offsets are wrong, not its innocent neighbour.
#[test]
fn header_offsets_of_a_middle_tensor_past_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let path = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let (_, header) = read_header(&path);
    // The tensor at offset 0 (not the last one).
    let (first, a, b) = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["data_offsets"][0].as_u64().unwrap() as usize, v["data_offsets"][1].as_u64().unwrap() as usize))
        .find(|e| e.1 == 0)
        .unwrap();
    let shift = 10_000_000;
    rewrite_header(&path, |h| h[&first]["data_offsets"] = serde_json::json!([a + shift, b + shift]));

    let err = load_err(&dir, 1, 0);
    assert!(matches!(&err, LoadError::Model(ModelError::BadOffsets { file, tensor, .. }) if file == &path && tensor == &first), "{err:?}");
}

// 6c. A shape so large its byte size overflows: an error, not a panic.
#[test]
fn header_shape_overflow_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_b.weight";
    let path = shard_of(&dir, name);
    rewrite_header(&path, |h| h[name]["shape"] = serde_json::json!([1u64 << 40, 1u64 << 40]));

    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::BadOffsets { file, .. } | ModelError::MalformedHeader { file, .. }) if file == &path),
        "{err:?}"
    );
}

// 7. A corrupted byte inside the header JSON.
#[test]
fn malformed_header_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 2, SMALL_SHARDS);
    let name = "layers.1.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = &bytes[8..8 + n];
    let colon = header.windows(8).position(|w| w == b"\"dtype\":").unwrap() + 7;
    poke(&path, 8 + colon, b"=");

    let err = load_err(&dir, 1, 0);
    match &err {
        LoadError::Model(ModelError::MalformedHeader { file, tensor, why }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, name);
            assert!(!why.is_empty());
        }
        other => panic!("expected MalformedHeader, got {other:?}"),
    }
    assert_names(&err.to_string(), name, &path);
}

// 7b. A header that is not UTF-8.
#[test]
fn header_not_utf8() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, BF16, 1, SMALL_SHARDS);
    let name = "layers.0.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    poke(&path, 8 + 3, &[0xC3]);

    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::MalformedHeader { file, tensor, .. }) if file == &path && tensor == name),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
}

/// Plants a NaN scale byte at `[row, col]` of a scale tensor.
fn plant_nan_scale(dir: &Path, name: &str, row: usize, col: usize, cols: usize) -> PathBuf {
    let path = shard_of(dir, name);
    let range = data_range(&path, name);
    let at = range.start + row * cols + col;
    assert!(at < range.end);
    poke(&path, at, &[0xFF]);
    path
}

// 8. A NaN (0xFF) scale byte in rank 1's rows of `wq_b` at TP 2.
#[test]
fn nan_scale_in_rank_1_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wq_b.scale";
    // wq_b.scale is [1024, 2]; rank 1 of 2 holds scale rows 512..1024.
    let (row, col) = (700, 1);
    let path = plant_nan_scale(&dir, name, row, col, 2);

    let err = load_err(&dir, 2, 1);
    match &err {
        LoadError::Tensor { tensor, file, source: KernelError::NanScale { row: r, col: c } } => {
            assert_eq!(tensor, name);
            assert_eq!(file.as_deref(), Some(path.as_path()));
            assert_eq!((*r, *c), (row, col), "the position must be absolute");
        }
        other => panic!("expected a NanScale tensor error, got {other:?}"),
    }
    let msg = err.to_string();
    assert_names(&msg, name, &path);
    assert!(msg.contains(&format!("row {row}, column {col}")), "{msg}");
    assert_eq!(err.tensor(), Some(name));

    // Rank 0's rows do not include the byte.
    let weights = load(&dir, 2, 0).expect("rank 0 does not hold the NaN scale");
    assert_eq!(weights.layers.len(), 1);
    // Nor does a TP 4 rank 0 or 1 (scale rows 0..256, 256..512); rank 2 does.
    load(&dir, 4, 1).expect("TP 4 rank 1 does not hold the NaN scale");
    assert!(matches!(load_err(&dir, 4, 2), LoadError::Tensor { source: KernelError::NanScale { row: 700, col: 1 }, .. }));
}

// 8b. A NaN scale byte in rank 1's columns of the column-split `wo_b` scale.
#[test]
fn nan_scale_in_rank_1_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_b.scale";
    // wo_b.scale is [8, 16]; rank 1 of 2 holds scale columns 8..16.
    let (row, col) = (3, 12);
    let path = plant_nan_scale(&dir, name, row, col, 16);

    let err = load_err(&dir, 2, 1);
    assert!(
        matches!(&err, LoadError::Tensor { tensor, file: Some(f), source: KernelError::NanScale { row: 3, col: 12 } } if tensor == name && f == &path),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
    load(&dir, 2, 0).expect("rank 0 does not hold the NaN scale");
}

/// Plants a BF16 value at `[row, col]` of a BF16 matrix with `cols` columns.
fn plant_bf16(path: &Path, name: &str, row: usize, col: usize, cols: usize, bits: u16) {
    let range = data_range(path, name);
    let at = range.start + (row * cols + col) * 2;
    assert!(at + 2 <= range.end);
    poke(path, at, &bits.to_le_bytes());
}

// 9. NaN and +Inf in a BF16 `wo_b` weight (column-split), in rank 1's columns.
#[test]
fn non_finite_bf16_in_rank_1_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, BF16, 1, usize::MAX);
    let name = "layers.0.attn.wo_b.weight";
    let path = shard_of(&dir, name);
    let pristine = std::fs::read(&path).unwrap();
    // wo_b.weight is [256, 512]; rank 1 of 2 holds columns 256..512.
    for (what, bits, row, col) in [("NaN", 0x7FC0u16, 100, 300), ("+Inf", 0x7F80, 5, 511), ("-Inf", 0xFF80, 255, 256)] {
        std::fs::write(&path, &pristine).unwrap();
        plant_bf16(&path, name, row, col, 512, bits);

        let err = load_err(&dir, 2, 1);
        match &err {
            LoadError::Tensor { tensor, file, source: KernelError::NonFinite { row: r, col: c } } => {
                assert_eq!(tensor, name, "{what}");
                assert_eq!(file.as_deref(), Some(path.as_path()), "{what}");
                assert_eq!((*r, *c), (row, col), "{what}: the position must be absolute");
            }
            other => panic!("{what}: expected a NonFinite tensor error, got {other:?}"),
        }
        let msg = err.to_string();
        assert_names(&msg, name, &path);
        assert!(msg.contains(&format!("row {row}, column {col}")), "{msg}");

        load(&dir, 2, 0).unwrap_or_else(|e| panic!("{what}: rank 0 does not hold the bad value: {e}"));
    }
}

// 9b. A NaN in a row-split BF16 weight (`wq_b`) in rank 1's rows.
#[test]
fn non_finite_bf16_in_rank_1_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, BF16, 1, usize::MAX);
    let name = "layers.0.attn.wq_b.weight";
    let path = shard_of(&dir, name);
    // wq_b.weight is [32768, 64]; rank 1 of 2 holds rows 16384..32768.
    plant_bf16(&path, name, 20000, 33, 64, 0x7FC1);

    let err = load_err(&dir, 2, 1);
    assert!(
        matches!(&err, LoadError::Tensor { tensor, file: Some(f), source: KernelError::NonFinite { row: 20000, col: 33 } } if tensor == name && f == &path),
        "{err:?}"
    );
    load(&dir, 2, 0).expect("rank 0 does not hold the NaN");
}

// 9c. A NaN E4M3 byte (0x7F) in an FP8 weight, in rank 1's columns of `wo_b`.
#[test]
fn nan_e4m3_in_rank_1_columns() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wo_b.weight";
    let path = shard_of(&dir, name);
    let range = data_range(&path, name);
    let (row, col) = (17, 400);
    poke(&path, range.start + row * 512 + col, &[0x7F]);

    let err = load_err(&dir, 2, 1);
    assert!(
        matches!(&err, LoadError::Tensor { tensor, file: Some(f), source: KernelError::NonFinite { row: 17, col: 400 } } if tensor == name && f == &path),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
    load(&dir, 2, 0).expect("rank 0 does not hold the NaN");
}

// 9d. A NaN attention sink value in rank 1's heads.
#[test]
fn nan_attn_sink_in_rank_1_heads() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.attn_sink";
    let path = shard_of(&dir, name);
    let range = data_range(&path, name);
    poke(&path, range.start + 40 * 4, &f32::NAN.to_le_bytes());

    let err = load_err(&dir, 2, 1);
    assert!(
        matches!(&err, LoadError::Tensor { tensor, file: Some(f), source: KernelError::NonFinite { row: 0, col: 40 } } if tensor == name && f == &path),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);
    load(&dir, 2, 0).expect("rank 0 does not hold head 40");
}

fn loader_err(config: &ModelConfig, tp: usize, rank: usize) -> LoadError {
    match RankLoader::new(&CpuBackend, config, tp, rank, ScaleRule::Rceil) {
        Ok(_) => panic!("TP {tp} rank {rank} was accepted"),
        Err(e) => e,
    }
}

// 10. TP sizes mega attention does not allow, and ranks outside the group.
#[test]
fn refused_tp_sizes_and_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let source = LoadSource::open_checkpoint(&dir).unwrap();
    let config = source.config();
    assert_eq!(config.geometry.heads, 64);

    let err = loader_err(config, 16, 0);
    assert!(matches!(err, LoadError::Model(ModelError::TpSize { tp: 16, .. })), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("leaves 4 heads per rank; mega attention needs 8 per group"), "{msg}");
    assert!(msg.contains("1, 2, 4, 8"), "the message should list the valid sizes: {msg}");

    for tp in [0, 3, 5, 6, 7, 32, 64, 128] {
        let err = loader_err(config, tp, 0);
        assert!(matches!(err, LoadError::Model(ModelError::TpSize { tp: t, .. }) if t == tp), "TP {tp}: {err:?}");
    }
    for (tp, rank) in [(1, 1), (2, 2), (8, 8), (8, 100)] {
        let err = loader_err(config, tp, rank);
        assert!(matches!(err, LoadError::Model(ModelError::TpSize { tp: t, .. }) if t == tp), "TP {tp} rank {rank}: {err:?}");
        assert!(err.to_string().contains(&format!("rank {rank}")), "{err}");
    }
    // The valid sizes load (the checkpoint itself is fine).
    for (tp, rank) in [(1, 0), (8, 7)] {
        load(&dir, tp, rank).unwrap_or_else(|e| panic!("TP {tp} rank {rank}: {e}"));
    }
}

fn open_err(dir: &Path) -> ModelError {
    match LoadSource::open_checkpoint(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e,
    }
}

// 11. A checkpoint directory that does not exist.
#[test]
fn checkpoint_directory_does_not_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("no-such-checkpoint");
    let err = open_err(&dir);
    assert!(matches!(&err, ModelError::Io { path, .. } if path == &dir), "{err:?}");
    assert!(err.to_string().contains(&dir.display().to_string()), "{err}");
    // A file where the directory should be.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"not a checkpoint").unwrap();
    assert!(matches!(open_err(&file), ModelError::Io { path, .. } if path == file));
}

// 11b. `config.json` missing, malformed, or missing a field.
#[test]
fn bad_config_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let config = dir.join(CONFIG_FILE);
    let good = std::fs::read_to_string(&config).unwrap();

    std::fs::write(&config, "{\"text_config\": {\"hidden_size\": 256,").unwrap();
    let err = open_err(&dir);
    assert!(matches!(&err, ModelError::Config { file, why } if file == &config && why.contains("malformed JSON")), "{err:?}");
    assert!(err.to_string().contains(&config.display().to_string()), "{err}");

    let mut v: Value = serde_json::from_str(&good).unwrap();
    v["text_config"].as_object_mut().unwrap().remove("num_attention_heads");
    std::fs::write(&config, v.to_string()).unwrap();
    let err = open_err(&dir);
    assert!(matches!(&err, ModelError::Config { file, why } if file == &config && why.contains("num_attention_heads")), "{err:?}");

    let mut v: Value = serde_json::from_str(&good).unwrap();
    v["text_config"]["o_lora_rank"] = Value::from(-64);
    std::fs::write(&config, v.to_string()).unwrap();
    assert!(matches!(open_err(&dir), ModelError::Config { file, .. } if file == config));

    std::fs::remove_file(&config).unwrap();
    let err = open_err(&dir);
    assert!(matches!(&err, ModelError::Io { path, .. } if path == &config), "{err:?}");
}

// 11c. A malformed index.
#[test]
fn bad_index_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let index = dir.join(INDEX_FILE);
    for (text, why) in [
        ("{\"weight_map\": {", "malformed JSON"),
        ("{\"metadata\": {}}", "weight_map"),
        ("{\"weight_map\": {\"layers.0.attn.wq_b.weight\": 3}}", "layers.0.attn.wq_b.weight"),
        ("{\"weight_map\": {\"layers.0.attn.wq_b.weight\": \"../x.safetensors\"}}", "outside"),
    ] {
        std::fs::write(&index, text).unwrap();
        let err = open_err(&dir);
        assert!(matches!(&err, ModelError::Index { file, why: w } if file == &index && w.contains(why)), "{text}: {err:?}");
    }
}

// 12. A single-file checkpoint (no index) cut short fails when it is opened, naming the tensor.
#[test]
fn truncated_single_file_checkpoint_fails_on_open() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let shard = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let single = dir.join(SINGLE_FILE);
    std::fs::rename(&shard, &single).unwrap();
    std::fs::remove_file(dir.join(INDEX_FILE)).unwrap();
    load(&dir, 2, 1).expect("the single-file checkpoint is valid");

    let (last, _, _) = last_tensor(&single);
    let len = std::fs::metadata(&single).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&single).unwrap().set_len(len - 1).unwrap();
    let err = match Checkpoint::open(&dir) {
        Ok(_) => panic!("a truncated single-file checkpoint opened"),
        Err(e) => e,
    };
    assert!(matches!(&err, ModelError::Truncated { file, tensor, .. } if file == &single && tensor == &last), "{err:?}");
    assert_names(&err.to_string(), &last, &single);
}

// Inspection reports the damage of cases 5 and 8 with the tensor's name.
#[test]
fn inspect_reports_truncation_and_nan_scale() {
    // Case 5: truncated shard.
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let path = shard_of(&dir, "layers.0.attn.wq_b.weight");
    let ck = Checkpoint::open(&dir).unwrap();
    let report = inspect(&ck);
    assert!(report.valid && report.problems.is_empty(), "{:?}", report.problems);
    drop(ck);
    let (last, _, _) = last_tensor(&path);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 8).unwrap();
    match Checkpoint::open(&dir) {
        Ok(ck) => {
            let report = inspect(&ck);
            assert!(!report.valid);
            assert!(report.problems.iter().any(|p| p.contains(&last) && p.contains("truncated")), "{:?}", report.problems);
            let entry = report.tensors.iter().find(|t| t.name == last).unwrap();
            assert_ne!(entry.status, "ok");
        }
        Err(e) => assert!(matches!(&e, ModelError::Truncated { tensor, .. } if tensor == &last), "{e:?}"),
    }

    // Case 8: NaN scale byte.
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, usize::MAX);
    let name = "layers.0.attn.wq_b.scale";
    plant_nan_scale(&dir, name, 700, 1, 2);
    let ck = Checkpoint::open(&dir).unwrap();
    let report = inspect(&ck);
    assert!(!report.valid);
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    let p = &report.problems[0];
    assert!(p.contains(name) && p.contains("[700, 1]"), "{p}");
    let entry = report.tensors.iter().find(|t| t.name == name).unwrap();
    assert_eq!(&entry.status, p);
    assert!(report.tensors.iter().filter(|t| t.name != name).all(|t| t.status == "ok"));
}

// 7c. An empty shard file, and a shard with stray bytes after its data.
#[test]
fn empty_shard_and_trailing_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(&tmp, FP8, 1, SMALL_SHARDS);
    let name = "layers.0.attn.wo_a.weight";
    let path = shard_of(&dir, name);
    let pristine = std::fs::read(&path).unwrap();

    std::fs::write(&path, b"").unwrap();
    let err = load_err(&dir, 1, 0);
    assert!(matches!(&err, LoadError::Model(ModelError::Truncated { file, .. }) if file == &path), "{err:?}");
    assert_names(&err.to_string(), name, &path);

    let mut longer = pristine.clone();
    longer.extend_from_slice(&[0u8; 64]);
    std::fs::write(&path, longer).unwrap();
    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::MalformedHeader { file, tensor, .. } | ModelError::BadOffsets { file, tensor, .. }) if file == &path && tensor == name),
        "{err:?}"
    );
    assert_names(&err.to_string(), name, &path);

    // An unknown dtype in the header.
    std::fs::write(&path, &pristine).unwrap();
    rewrite_header(&path, |h| h[name]["dtype"] = Value::from("Q7"));
    let err = load_err(&dir, 1, 0);
    assert!(
        matches!(&err, LoadError::Model(ModelError::MalformedHeader { file, tensor, .. }) if file == &path && tensor == name),
        "{err:?}"
    );
}
