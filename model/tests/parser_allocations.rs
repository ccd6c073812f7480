//! The checkpoint parsers (a shard's safetensors header, the index, `config.json`) fed
//! arbitrary bytes and mutations of valid files: never a panic, always `Ok` or an error, and
//! never an allocation larger than the input plus a small constant. A counting global
//! allocator records the largest single allocation made by the current thread while a parse
//! is armed (other test threads are not counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use orchestrator_model::checkpoint::{Shard, parse_index};
use orchestrator_model::{ModelConfig, Preset, WeightFormat};
use proptest::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn record(size: usize) {
    // `try_with`: allocations during thread teardown are simply not counted.
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// What a parse may allocate beyond the input's size (error messages, small maps, paths).
const SLACK: usize = 64 * 1024;

/// Runs `f` with this thread's allocations counted; returns its result and the largest one.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, LARGEST.with(Cell::get))
}

fn assert_bounded(what: &str, input: usize, largest: usize) {
    assert!(largest <= input + SLACK, "{what}: a {largest}-byte allocation for a {input}-byte input");
}

// ---------------------------------------------------------------------------------------------
// Valid inputs to mutate.

fn valid_shard() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let w: Vec<u8> = (0..64 * 32).map(|i| (i % 251) as u8).collect();
        let s = vec![127u8; 2];
        let sink: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let tensors = [
            ("layers.0.attn.wq_b.weight", TensorView::new(Dtype::F8_E4M3, vec![64, 32], &w).unwrap()),
            ("layers.0.attn.wq_b.scale", TensorView::new(Dtype::F8_E8M0, vec![2, 1], &s).unwrap()),
            ("layers.0.attn.attn_sink", TensorView::new(Dtype::F32, vec![8], &sink).unwrap()),
        ];
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        safetensors::serialize(tensors, Some(meta)).unwrap()
    })
}

fn valid_index() -> String {
    let map: serde_json::Map<String, serde_json::Value> = (0..3)
        .flat_map(|l| ["wq_b.weight", "wq_b.scale", "wo_a.weight", "attn_sink"].map(move |t| (l, t)))
        .map(|(l, t)| (format!("layers.{l}.attn.{t}"), format!("model-0000{}-of-00003.safetensors", l + 1).into()))
        .collect();
    serde_json::json!({ "metadata": { "total_size": 12345 }, "weight_map": map }).to_string()
}

fn valid_config(preset: Preset) -> String {
    let cfg = ModelConfig { family: preset.family(), geometry: preset.geometry(), format: WeightFormat::Fp8 { block: preset.fp8_block() } };
    serde_json::to_string_pretty(&cfg.to_json(None)).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Mutations.

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Vec<(usize, u8)>),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    /// Replace the bytes at a position with a JSON-ish token (a huge number, a nesting, ...).
    Token(usize, usize, &'static str),
}

const TOKENS: &[&str] = &[
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "1e309",
    "-1",
    "[",
    "{",
    "]",
    "}",
    "\"",
    "\\u0000",
    "null",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    ",\"x\":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]",
    "0",
    "4294967296",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        prop::collection::vec((any::<usize>(), 1..=255u8), 1..8).prop_map(Mutation::Flip),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..32)).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 0..24usize, prop::sample::select(TOKENS)).prop_map(|(at, len, t)| Mutation::Token(at, len, t)),
    ]
}

fn apply(base: &[u8], m: &Mutation) -> Vec<u8> {
    let mut out = base.to_vec();
    let n = out.len().max(1);
    match m {
        Mutation::Flip(flips) => {
            for &(at, x) in flips {
                if !out.is_empty() {
                    out[at % n] ^= x;
                }
            }
        }
        Mutation::Truncate(at) => out.truncate(at % (n + 1)),
        Mutation::Insert(at, bytes) => {
            let at = at % (out.len() + 1);
            out.splice(at..at, bytes.iter().copied());
        }
        Mutation::Token(at, len, t) => {
            let at = at % (out.len() + 1);
            let end = (at + len).min(out.len());
            out.splice(at..end, t.bytes());
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The parsers under test.

fn open_shard(dir: &Path, bytes: &[u8]) -> usize {
    let path = dir.join("shard.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let (result, largest) = largest_allocation(|| Shard::open(&path, "layers.0.attn.wq_b.weight"));
    if let Ok(shard) = &result {
        let names: Vec<String> = shard.names().map(str::to_string).collect();
        for name in names {
            let info = shard.info(&name).unwrap();
            let _ = shard.bytes(&name);
            let _ = (&info.shape, info.dtype);
        }
    }
    assert_bounded("Shard::open", bytes.len(), largest);
    largest
}

fn parse_config(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let (_, largest) = largest_allocation(|| ModelConfig::parse(&text, Path::new("config.json")).is_ok());
    assert_bounded("ModelConfig::parse", text.len(), largest);
}

fn parse_idx(bytes: &[u8]) {
    let (_, largest) = largest_allocation(|| parse_index(bytes, Path::new("model.safetensors.index.json")).is_ok());
    assert_bounded("parse_index", bytes.len(), largest);
}

/// A shard with a hand-written JSON header and `data` bytes after it.
fn shard_with_header(header: &str, data: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + data, 0);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn shard_headers_never_panic_or_overallocate(m in mutation(), junk in prop::collection::vec(any::<u8>(), 0..2048), raw in any::<bool>()) {
        let tmp = tempfile::tempdir().unwrap();
        let bytes = if raw { junk } else { apply(valid_shard(), &m) };
        open_shard(tmp.path(), &bytes);
    }

    #[test]
    fn shard_header_lengths_and_sizes_never_overallocate(
        declared in prop_oneof![any::<u64>(), Just(u64::MAX), Just(1u64 << 63), Just(100_000_001u64), 0..4096u64],
        dims in prop::collection::vec(prop_oneof![any::<u64>(), Just(u64::MAX), Just(1u64 << 32), 0..64u64], 0..4),
        offsets in (any::<u64>(), any::<u64>()),
        data in 0..256usize,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        // The valid file with its 8-byte header length replaced.
        let mut bytes = valid_shard().to_vec();
        bytes[..8].copy_from_slice(&declared.to_le_bytes());
        open_shard(tmp.path(), &bytes);
        // A header with huge shapes and offsets.
        let shape: Vec<String> = dims.iter().map(u64::to_string).collect();
        let header = format!(
            r#"{{"t":{{"dtype":"F8_E4M3","shape":[{}],"data_offsets":[{},{}]}}}}"#,
            shape.join(","), offsets.0, offsets.1
        );
        open_shard(tmp.path(), &shard_with_header(&header, data));
        let header = format!(r#"{{"t":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{data}]}}}}"#, shape.join(","));
        open_shard(tmp.path(), &shard_with_header(&header, data));
    }

    #[test]
    fn indexes_never_panic_or_overallocate(m in mutation(), junk in prop::collection::vec(any::<u8>(), 0..2048), raw in any::<bool>()) {
        let bytes = if raw { junk } else { apply(valid_index().as_bytes(), &m) };
        parse_idx(&bytes);
    }

    #[test]
    fn configs_never_panic_or_overallocate(
        m in mutation(),
        junk in prop::collection::vec(any::<u8>(), 0..2048),
        raw in any::<bool>(),
        preset in prop::sample::select(&Preset::ALL[..]),
    ) {
        let bytes = if raw { junk } else { apply(valid_config(preset).as_bytes(), &m) };
        parse_config(&bytes);
    }

    #[test]
    fn config_fields_with_any_value_are_refused_or_valid(
        field in prop::sample::select(&["hidden_size", "num_hidden_layers", "num_attention_heads", "o_groups", "q_lora_rank", "o_lora_rank", "head_dim"][..]),
        value in prop_oneof![any::<u64>().prop_map(|v| v.to_string()), prop::sample::select(TOKENS).prop_map(str::to_string)],
    ) {
        let text = valid_config(Preset::Dsv4Pro);
        let needle = format!("\"{field}\": ");
        let at = text.find(&needle).unwrap() + needle.len();
        let end = at + text[at..].find([',', '\n']).unwrap();
        let edited = format!("{}{}{}", &text[..at], value, &text[end..]);
        parse_config(edited.as_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs built to amplify: megabytes of text that a naive parser would turn into much larger
// trees. Each must be refused (or parsed) within the input's size plus the slack.

fn zeros_array(n: usize) -> String {
    let mut s = String::with_capacity(2 * n + 2);
    s.push('[');
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        s.push('0');
    }
    s.push(']');
    s
}

#[test]
fn amplifying_configs_and_indexes_stay_bounded() {
    let big = zeros_array(500_000);
    let text = valid_config(Preset::Dsv41Flash);
    for edited in [
        text.replacen("\"hidden_size\": 5120", &format!("\"hidden_size\": {big}"), 1),
        text.replacen('{', &format!("{{\"junk\": {big},"), 1),
        text.replacen('{', &format!("{{\"junk\": {{\"deeper\": {big}}},"), 1),
        format!("{{\"text_config\": {big}}}"),
        big.clone(),
    ] {
        assert!(edited.len() > 900_000);
        parse_config(edited.as_bytes());
    }
    let index = valid_index();
    for edited in [
        index.replacen("{\"total_size\":12345}", &big, 1),
        index.replacen("\"weight_map\":{", &format!("\"weight_map\":{{\"x\":{big},"), 1),
        format!("{{\"weight_map\":{big}}}"),
    ] {
        assert!(edited.len() > 900_000);
        parse_idx(edited.as_bytes());
    }
}

#[test]
fn amplifying_shard_headers_stay_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let big = zeros_array(500_000);
    let many_metadata: String = (0..200_000).map(|i| format!("\"{i}\":\"\"")).collect::<Vec<_>>().join(",");
    for header in [
        format!(r#"{{"t":{{"dtype":"U8","shape":{big},"data_offsets":[0,0]}}}}"#),
        format!(r#"{{"t":{{"dtype":"U8","shape":[1],"data_offsets":[0,1],"junk":{big}}}}}"#),
        format!(r#"{{"t":{{"dtype":{big},"shape":[1],"data_offsets":[0,1]}}}}"#),
        format!(r#"{{"__metadata__":{{"junk":{big}}},"t":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#),
        format!(r#"{{"__metadata__":{{{many_metadata}}},"t":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#),
        format!(r#"{{"t":{{"dtype":"U8","shape":[1],"data_offsets":{big}}}}}"#),
        r#"{"t":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,18446744073709551615]}}"#.to_string(),
    ] {
        let bytes = shard_with_header(&header, 1);
        let largest = open_shard(tmp.path(), &bytes);
        assert!(largest < bytes.len().max(1 << 20), "{largest}");
    }
}
