//! A content version computed once per host: a checkpoint opened with a claim adopts the
//! claimed version only when it sees the very files the claim was computed from, and hashes
//! every tensor itself otherwise (another copy, a rewritten shard, another frame, a fresh file).

use std::path::Path;
use std::time::Duration;

use orchestrator_model::checkpoint::{ContentClaim, VersionFrom};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{AllowedRoots, Checkpoint, ModelConfig, Preset};

fn synth(dir: &Path, seed: u64, max_shard_bytes: usize) {
    let config = ModelConfig::from_preset(Preset::Tiny, Some(2), false).unwrap();
    write_checkpoint(dir, &SynthOptions { config, seed, max_shard_bytes, preset_name: Some("tiny".into()) }).unwrap();
}

fn open(dir: &Path, claim: Option<&ContentClaim>) -> Checkpoint {
    let roots = AllowedRoots::new(&[dir.parent().unwrap().to_path_buf()]).unwrap();
    Checkpoint::open_within_claimed(dir, &roots, claim).unwrap()
}

/// The claim of a freshly written checkpoint, as if its files were old enough.
fn claim(dir: &Path) -> ContentClaim {
    open(dir, None).claim_with_margin(Duration::ZERO).unwrap()
}

#[test]
fn the_same_files_adopt_the_claimed_version() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 1, 1_000_000);
    let c = claim(&a);
    assert!(c.files.len() > 1, "several shards: {:?}", c.files.keys());
    let hashed = open(&a, None);
    assert_eq!(hashed.version_from(), VersionFrom::Hashed);
    let adopted = open(&a, Some(&c));
    assert_eq!(adopted.version_from(), VersionFrom::Claim);
    assert_eq!(adopted.content_version(), hashed.content_version());
    // Adopted means not hashed: a claim with another version on the same files is taken as is
    // (the coordinator is trusted with the version; the files' identity is what is checked).
    let forged = ContentClaim { version: "0123456789abcdef".into(), ..c.clone() };
    assert_eq!(open(&a, Some(&forged)).content_version(), "0123456789abcdef");
}

#[test]
fn another_copy_or_a_rewritten_shard_is_hashed_again() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    synth(&a, 2, 1_000_000);
    synth(&b, 2, 1_000_000);
    let c = claim(&a);
    // The same bytes in other files (another copy, another host): hashed, same version.
    let copy = open(&b, Some(&c));
    assert_eq!(copy.version_from(), VersionFrom::Hashed);
    assert_eq!(copy.content_version(), c.version);
    // A shard rewritten in place with other bytes of the same size: another identity.
    let shard = a.join(c.files.keys().next().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let rewritten = open(&a, Some(&c));
    assert_eq!(rewritten.version_from(), VersionFrom::Hashed);
    assert_ne!(rewritten.content_version(), c.version);
    // A shard replaced by rename (a new inode), bytes unchanged: hashed, same version as now.
    let now = rewritten.content_version().to_string();
    let c = claim(&a);
    let tmpfile = shard.with_extension("new");
    std::fs::copy(&shard, &tmpfile).unwrap();
    std::fs::rename(&tmpfile, &shard).unwrap();
    let renamed = open(&a, Some(&c));
    assert_eq!(renamed.version_from(), VersionFrom::Hashed);
    assert_eq!(renamed.content_version(), now);
}

#[test]
fn another_frame_is_hashed_again() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 3, 1_000_000);
    let c = claim(&a);
    let other = ContentClaim { frame: "0000000000000000".into(), ..c.clone() };
    assert_eq!(open(&a, Some(&other)).version_from(), VersionFrom::Hashed);
    let mut fewer = c.clone();
    fewer.files.pop_first();
    assert_eq!(open(&a, Some(&fewer)).version_from(), VersionFrom::Hashed);
    let mut moved = c.clone();
    moved.files.values_mut().next().unwrap().mtime_ns += 1;
    assert_eq!(open(&a, Some(&moved)).version_from(), VersionFrom::Hashed);
    // The index moving a tensor to another shard changes the frame: the same files, hashed.
    let index = a.join(orchestrator_model::checkpoint::INDEX_FILE);
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    let map = doc["weight_map"].as_object_mut().unwrap();
    let name = map.keys().find(|k| k.ends_with("attn_sink")).unwrap().clone();
    map.insert(name, serde_json::Value::String("elsewhere.safetensors".into()));
    std::fs::write(&index, doc.to_string()).unwrap();
    let roots = AllowedRoots::new(&[tmp.path().to_path_buf()]).unwrap();
    let moved = Checkpoint::open_within_claimed(&a, &roots, Some(&c)).unwrap();
    assert_eq!(moved.version_from(), VersionFrom::Hashed);
    assert_ne!(moved.content_version(), c.version);
}

#[test]
fn files_changed_just_before_they_were_opened_are_not_claimed() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 4, 1_000_000);
    assert!(open(&a, None).content_claim().is_none(), "written a moment ago: racy");
    assert!(open(&a, None).claim_with_margin(Duration::ZERO).is_some());
}

/// The pass that hashes a checkpoint checks every in-scope value too, and an inspection of that
/// checkpoint takes those checks instead of reading the values again: the same verdict, to the
/// row and column, as an inspection of the same files opened from a claim (which reads them).
#[test]
fn the_hashing_pass_checks_the_values_an_inspection_then_reads_no_more() {
    use orchestrator_model::inspect::inspect;
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    synth(&a, 1, 1 << 30);
    let c = claim(&a);
    let name = "layers.1.attn.wo_a.weight";
    let (hashed, adopted) = (open(&a, None), open(&a, Some(&c)));
    assert_eq!(hashed.checked_values(name), Some(None), "checked while hashing, nothing illegal");
    assert_eq!(adopted.checked_values(name), None, "adopted: nothing was read");
    assert!(inspect(&hashed).valid && inspect(&adopted).valid);
    drop((hashed, adopted));
    // One E4M3 byte NaN (0x7F) at row 3, column 5 of the tensor, written in place.
    let file = a.join("model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let cols = header[name]["shape"][1].as_u64().unwrap() as usize;
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + n + start + 3 * cols + 5] = 0x7F;
    std::fs::write(&file, bytes).unwrap();
    let hashed = open(&a, None);
    assert_eq!(hashed.checked_values(name).flatten().map(|(at, _)| at), Some(3 * cols + 5));
    let (mine, read) = (inspect(&hashed), inspect(&open(&a, Some(&claim(&a)))));
    assert!(
        !mine.valid && mine.problems.len() == 1 && mine.problems[0].contains(name) && mine.problems[0].contains("[3, 5]"),
        "{:?}",
        mine.problems
    );
    assert_eq!(mine.problems, read.problems);
}
