//! `Checkpoint::open_within`: every file of a checkpoint must resolve under an allowed root,
//! and the Hugging Face hub cache layout (snapshot files symlinked to `../../blobs/HASH`)
//! keeps working.
#![cfg(unix)]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use orchestrator_model::checkpoint::{CONFIG_FILE, INDEX_FILE};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{AllowedRoots, Checkpoint, ModelConfig, ModelError, Preset, RootsError};

fn synth(dir: &Path, seed: u64) {
    let config = ModelConfig::from_preset(Preset::Tiny, Some(1), false).unwrap();
    write_checkpoint(dir, &SynthOptions { config, seed, max_shard_bytes: 1_000_000, preset_name: None }).unwrap();
}

/// Moves a checkpoint into a hub cache: `cache/models--org--tiny/blobs/<n>` and
/// `snapshots/rev1/<name> -> ../../blobs/<n>`. Returns the snapshot directory.
fn hub_cache(src: &Path, cache: &Path) -> PathBuf {
    let repo = cache.join("models--org--tiny");
    let blobs = repo.join("blobs");
    let snapshot = repo.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    let mut entries: Vec<_> = std::fs::read_dir(src).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for (i, path) in entries.iter().enumerate() {
        let blob = format!("{i:040x}");
        std::fs::rename(path, blobs.join(&blob)).unwrap();
        symlink(format!("../../blobs/{blob}"), snapshot.join(path.file_name().unwrap())).unwrap();
    }
    snapshot
}

#[test]
fn hub_cache_layout_opens() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    synth(&src, 1);
    let reference = Checkpoint::open(&src).unwrap();
    let version = reference.content_version().to_string();
    drop(reference);
    let cache = tmp.path().join("hub");
    let snapshot = hub_cache(&src, &cache);
    assert!(std::fs::symlink_metadata(snapshot.join(CONFIG_FILE)).unwrap().file_type().is_symlink());

    let roots = AllowedRoots::for_checkpoint(&snapshot).unwrap();
    assert_eq!(roots.roots(), &[cache.join("models--org--tiny").canonicalize().unwrap()]);
    let ck = Checkpoint::open_within(&snapshot, &roots).unwrap();
    assert_eq!(ck.weight_map().len(), 7);
    assert_eq!(ck.content_version(), version, "the same tensors, wherever they lie");

    let roots = AllowedRoots::new(std::slice::from_ref(&tmp.path().to_path_buf())).unwrap();
    Checkpoint::open_within(&snapshot, &roots).unwrap();

    // Allowing only the snapshot folder does not allow the blobs its files resolve to.
    let roots = AllowedRoots::new(std::slice::from_ref(&snapshot)).unwrap();
    let err = Checkpoint::open_within(&snapshot, &roots).err().unwrap();
    assert!(
        matches!(&err, ModelError::Roots(RootsError::Outside { path, resolved, .. })
            if path.ends_with(CONFIG_FILE) && resolved.starts_with(cache.join("models--org--tiny/blobs").canonicalize().unwrap())),
        "{err:?}"
    );
}

#[test]
fn a_shard_symlinked_outside_the_roots_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("allowed");
    let ckpt = root.join("ckpt");
    synth(&ckpt, 2);
    let roots = AllowedRoots::new(std::slice::from_ref(&root)).unwrap();
    Checkpoint::open_within(&ckpt, &roots).unwrap();

    // One shard becomes a symlink to a file outside the roots.
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join(INDEX_FILE)).unwrap()).unwrap();
    let shard_name = index["weight_map"]["layers.0.attn.wo_a.weight"].as_str().unwrap().to_string();
    let outside = tmp.path().join("elsewhere");
    std::fs::create_dir_all(&outside).unwrap();
    let target = outside.join("stolen.safetensors");
    std::fs::rename(ckpt.join(&shard_name), &target).unwrap();
    symlink(&target, ckpt.join(&shard_name)).unwrap();

    let err = Checkpoint::open_within(&ckpt, &roots).err().unwrap();
    let shard = ckpt.canonicalize().unwrap().join(&shard_name);
    assert!(
        matches!(&err, ModelError::Roots(RootsError::Outside { path, resolved, .. })
            if path == &shard && resolved == &target.canonicalize().unwrap()),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&shard_name) && msg.contains("stolen.safetensors"), "{msg}");
    // Plain `open` (no roots) still reads it: the check is the caller's choice.
    Checkpoint::open(&ckpt).unwrap();

    // `..` stays refused, even when it resolves inside.
    let dotted = root.join("ckpt/../ckpt");
    assert!(matches!(Checkpoint::open_within(&dotted, &roots), Err(ModelError::Roots(RootsError::DotDot { .. }))));
    // config.json symlinked outside is refused the same way.
    let tmp2 = tempfile::tempdir().unwrap();
    let ckpt2 = tmp2.path().join("allowed/ckpt");
    synth(&ckpt2, 3);
    let roots2 = AllowedRoots::new(&[tmp2.path().join("allowed")]).unwrap();
    let cfg_target = tmp2.path().join("config.json");
    std::fs::rename(ckpt2.join(CONFIG_FILE), &cfg_target).unwrap();
    symlink(&cfg_target, ckpt2.join(CONFIG_FILE)).unwrap();
    let err = Checkpoint::open_within(&ckpt2, &roots2).err().unwrap();
    assert!(matches!(&err, ModelError::Roots(RootsError::Outside { path, .. }) if path.ends_with(CONFIG_FILE)), "{err:?}");
}
