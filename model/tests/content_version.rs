//! The content-addressed checkpoint version: a digest of the in-scope tensors (bytes, dtypes,
//! shapes) plus geometry and format, computed when the checkpoint is opened.

use std::path::Path;

use orchestrator_kernels::Digest;
use orchestrator_model::checkpoint::{CONFIG_FILE, INDEX_FILE};
use orchestrator_model::names::checkpoint_tensors;
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Checkpoint, ModelConfig, Preset};

fn synth(dir: &Path, seed: u64, max_shard_bytes: usize) {
    let config = ModelConfig::from_preset(Preset::Tiny, Some(2), false).unwrap();
    write_checkpoint(dir, &SynthOptions { config, seed, max_shard_bytes, preset_name: Some("tiny".into()) }).unwrap();
}

fn version(dir: &Path) -> String {
    Checkpoint::open(dir).unwrap().content_version().to_string()
}

#[test]
fn different_weights_with_identical_json_differ() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    synth(&a, 1, 1 << 30);
    synth(&b, 2, 1 << 30);
    // Give b byte-identical config.json and index (the seed is recorded in config.json).
    for f in [CONFIG_FILE, INDEX_FILE] {
        std::fs::copy(a.join(f), b.join(f)).unwrap();
        assert_eq!(std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap());
    }
    let (va, vb) = (version(&a), version(&b));
    assert_ne!(va, vb);
    for v in [&va, &vb] {
        assert_eq!(v.len(), 16);
        assert!(v.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{v}");
    }
}

#[test]
fn the_same_content_anywhere_has_the_same_version() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("elsewhere/b"), tmp.path().join("c"));
    synth(&a, 7, 1 << 30);
    synth(&b, 7, 1 << 30);
    // A different shard split of the same tensors: same content, same version.
    synth(&c, 7, 1_000_000);
    let va = version(&a);
    assert_eq!(version(&b), va);
    assert_eq!(version(&c), va);
    // Reformatting config.json (compact, keys reordered, provenance dropped) changes nothing.
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join(CONFIG_FILE)).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("orchestrator");
    std::fs::write(b.join(CONFIG_FILE), v.to_string()).unwrap();
    assert_eq!(version(&b), va);
}

#[test]
fn editing_config_json_after_opening_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 3, 1 << 30);
    let ck = Checkpoint::open(&a).unwrap();
    let before = ck.content_version().to_string();
    let mut text = std::fs::read(a.join(CONFIG_FILE)).unwrap();
    text.push(b' ');
    std::fs::write(a.join(CONFIG_FILE), text).unwrap();
    assert_eq!(ck.content_version(), before);
    assert_eq!(version(&a), before, "a space is not content either");
}

#[test]
fn the_definition_is_the_documented_text() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 9, 1_000_000);
    let ck = Checkpoint::open(&a).unwrap();
    let g = &ck.config.geometry;
    let mut text = format!(
        "orchestrator checkpoint content v1\ngeometry hidden={} layers={} heads={} kv_heads={} head_dim={} rope_dim={} q_lora_rank={} o_lora_rank={} o_groups={}\nformat fp8 block=32x32\n",
        g.hidden, g.layers, g.heads, g.kv_heads, g.head_dim, g.rope_dim, g.q_lora_rank, g.o_lora_rank, g.o_groups
    );
    let mut specs = checkpoint_tensors(g, ck.config.format);
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    for spec in &specs {
        let (shard, _) = ck.tensor_bytes(spec).unwrap();
        let bytes = shard.bytes(&spec.name).unwrap();
        let shape: Vec<String> = spec.shape.iter().map(|d| d.to_string()).collect();
        text.push_str(&format!("{} {:?} [{}] {}\n", spec.name, spec.dtype, shape.join(","), Digest::of(bytes).hex()));
    }
    assert!(text.contains("layers.0.attn.wq_b.weight F8_E4M3 [32768,64] "), "{text}");
    assert_eq!(ck.content_version(), Digest::of(text.as_bytes()).hex());
}
