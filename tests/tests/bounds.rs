//! End to end: every size is bounded before anything starts, every file a checkpoint names lies
//! under an allowed root (the Hugging Face hub cache layout included), the version is the
//! content, `recover` never destroys what it did not create, and a long report blocks nothing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use orchestrator_e2e::{Served, bin, copy_checkpoint, journal, run, stderr, stdout, synth_tiny, versions};
use serde_json::Value;

/// Impossible cluster and probe sizes are refused at once with the field named, and no worker
/// process is started.
#[test]
fn impossible_sizes_are_refused_before_anything_starts() {
    for (args, expect) in [
        (vec!["--tp", "1", "--dp", "1000"], "local workers"),
        (vec!["--tp", "1", "--dp", "4294967295"], "world size"),
        (vec!["--tp", "2", "--dp", "2147483648"], "world size"),
        (vec!["--tp", "1", "--probe", "100000,1"], "probe tokens"),
        (vec!["--tp", "1", "--probe", "1,100000000"], "probe latents"),
    ] {
        let t = Instant::now();
        let mut full = vec!["launch", "--dummy", "--preset", "tiny", "--layers", "1"];
        full.extend_from_slice(&args);
        let o = run("orchestrator", &full);
        assert!(!o.status.success(), "{args:?}: {}", stdout(&o));
        assert!(stderr(&o).contains(expect), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("starting"), "{args:?}: no worker may start: {}", stderr(&o));
        assert!(t.elapsed() < Duration::from_secs(5), "{args:?} took {:?}", t.elapsed());
    }
    // Within the size limits, but not within the memory a dsv41-flash rank would hold for it
    // (39.5 GB at TP 1): refused before anything starts, with the probe named.
    let o = run("orchestrator", &["launch", "--dummy", "--preset", "dsv41-flash", "--tp", "1", "--probe", "4096,1"]);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(stderr(&o).contains("--probe 4096,1,0: probe working set (bytes)"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("starting"), "no worker may start: {}", stderr(&o));
}

/// A routed probe too large for the ranks' memory is the caller's error: the coordinator
/// refuses it, and no replica leaves rotation for it (before, each replica it was tried on was
/// pulled).
#[test]
fn a_routed_probe_too_large_for_the_ranks_takes_no_replica_out_of_rotation() {
    let cluster = Served::start(&["--dummy", "--preset", "tiny", "--layers", "8", "--tp", "1", "--dp", "2", "--probe", "2,16"]);
    let o = cluster.cmd("probe", &["--size", "4096,1", "--rate", "4", "--duration", "1", "--json"]);
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    assert!(doc["failed"].as_u64().unwrap() >= 1 && doc["served"] == 0, "{doc}");
    assert!(doc["errors"][0].as_str().unwrap().contains("probe working set"), "{doc}");
    let o = cluster.cmd("probe", &["--rate", "10", "--duration", "1", "--json"]);
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    assert_eq!(doc["failed"], 0, "{doc}");
    assert!(doc["by_replica"]["dp0"]["served"].as_u64() > Some(0) && doc["by_replica"]["dp1"]["served"].as_u64() > Some(0), "{doc}");
    assert_eq!(cluster.report()["ok"], true);
}

/// A `config.json` with absurd sizes (8·2^34 heads, 8·2^58 heads, 10^12 layers) is refused by
/// `checkpoint inspect` and `load` at once, naming the field: no spin, no abort, no panic.
#[test]
fn absurd_configs_are_refused_by_field() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    synth_tiny(&base, "1");
    let config: Value = serde_json::from_slice(&std::fs::read(base.join("config.json")).unwrap()).unwrap();
    for (field, value, name) in [
        ("num_attention_heads", Value::from(8u64 << 34), "heads-2-34"),
        ("num_attention_heads", Value::from(8u64 << 58), "heads-2-58"),
        ("num_hidden_layers", Value::from(1_000_000_000_000u64), "layers-1e12"),
    ] {
        let dir = tmp.path().join(name);
        copy_checkpoint(&base, &dir, |_| false);
        let mut c = config.clone();
        let fields = if c.get("text_config").is_some() { &mut c["text_config"] } else { &mut c };
        fields[field] = value;
        std::fs::write(dir.join("config.json"), serde_json::to_vec(&c).unwrap()).unwrap();
        for cmd in [
            vec!["orchestrator", "checkpoint", "inspect", dir.to_str().unwrap()],
            vec!["orchestrator-worker", "load", "--checkpoint", dir.to_str().unwrap(), "--tp", "1"],
        ] {
            let t = Instant::now();
            let o = run(cmd[0], &cmd[1..]);
            let text = format!("{}{}", stdout(&o), stderr(&o));
            assert!(!o.status.success(), "{name} {cmd:?}: {text}");
            assert_ne!(o.status.code(), None, "{name} {cmd:?}: killed by a signal: {text}");
            assert!(!text.contains("panicked"), "{name} {cmd:?}: {text}");
            assert!(text.contains(field), "{name} {cmd:?}: the field is named: {text}");
            assert!(t.elapsed() < Duration::from_secs(5), "{name} {cmd:?} took {:?}", t.elapsed());
        }
    }
}

/// Copies a checkpoint into the Hugging Face hub cache layout: `models--ORG--NAME/blobs/HASH`
/// and `snapshots/REV/NAME -> ../../blobs/HASH`. Returns the snapshot directory.
fn hub_layout(src: &Path, cache: &Path) -> std::path::PathBuf {
    let repo = cache.join("models--deepseek-ai--DeepSeek-V4.1-Tiny");
    let (blobs, snapshot) = (repo.join("blobs"), repo.join("snapshots").join("0123abcd"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for (i, f) in std::fs::read_dir(src).unwrap().enumerate() {
        let f = f.unwrap().path();
        let blob = format!("blob{i:04}");
        std::fs::copy(&f, blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(f.file_name().unwrap())).unwrap();
    }
    snapshot
}

/// Launching from a hub-cache snapshot loads (its repo folder is allowed); an update whose shard
/// is a symlink to a file outside the allowed roots is refused before any replica leaves
/// rotation, naming the shard.
#[test]
fn hub_snapshots_load_and_a_symlinked_shard_cannot_escape_the_roots() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    synth_tiny(&a, "1");
    synth_tiny(&b, "2");
    let snapshot = hub_layout(&a, &tmp.path().join("hub"));
    let o = run("orchestrator", &["launch", "--json", "--no-probe", "--tp", "2", "--checkpoint", snapshot.to_str().unwrap()]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let fresh: Value = serde_json::from_slice(&o.stdout).unwrap();
    let direct: Value = serde_json::from_slice(
        &run("orchestrator", &["launch", "--json", "--no-probe", "--tp", "2", "--checkpoint", a.to_str().unwrap()]).stdout,
    )
    .unwrap();
    assert_eq!(versions(&fresh), versions(&direct), "the same content is the same version wherever it lives");

    let root = tmp.path().join("root");
    let (inside, escape) = (root.join("A"), root.join("escape"));
    synth_tiny(&inside, "1");
    // B's shards, linked from inside the root to outside it.
    copy_checkpoint(&b, &escape, |f| f.extension().is_some_and(|e| e == "safetensors"));
    let cluster = Served::on_checkpoint("2", "2", &inside, &root, &[]);
    let before = cluster.report();
    let load = cluster.probe_load("10", "2");
    let o = cluster.cmd("update", &["--checkpoint", escape.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("refused before touching any replica") && stdout(&o).contains("outside the allowed roots"),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&o).contains(".safetensors"), "the shard is named: {}", stdout(&o));
    assert_eq!(versions(&cluster.report()), versions(&before));
    let probes: Value = serde_json::from_slice(&load.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(probes["failed"], 0, "no replica left rotation: {probes:#}");
}

/// Other weights under an identical config.json and index are another version; editing
/// config.json after loading changes no reported version.
#[test]
fn the_version_is_the_content() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("A"), tmp.path().join("B"));
    synth_tiny(&a, "1");
    synth_tiny(&b, "2");
    for f in ["config.json", "model.safetensors.index.json"] {
        std::fs::copy(a.join(f), b.join(f)).unwrap();
    }
    let cluster = Served::on_checkpoint("1", "2", &a, tmp.path(), &[]);
    let va = versions(&cluster.report())[0].clone();
    let mut config = std::fs::read(a.join("config.json")).unwrap();
    config.push(b' ');
    std::fs::write(a.join("config.json"), config).unwrap();
    assert!(versions(&cluster.report()).iter().all(|v| *v == va), "editing config.json changed nothing on the ranks");
    let o = cluster.cmd("update", &["--checkpoint", b.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", stdout(&o));
    let out: Value = serde_json::from_slice(&o.stdout).unwrap();
    let vb = out["update"]["new_version"].as_str().unwrap();
    assert_ne!(vb, va, "other weights, another version");
    assert!(versions(&cluster.report()).iter().all(|v| v == vb));
}

/// `recover` against the state directory of a live coordinator refuses without changing
/// anything: the token file stays, the journal is untouched, and the cluster serves on.
#[test]
fn recover_refuses_a_live_state_directory_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, state) = (tmp.path().join("A"), tmp.path().join("state"));
    synth_tiny(&a, "1");
    let cluster = Served::on_checkpoint("1", "2", &a, tmp.path(), &["--state-dir", state.to_str().unwrap()]);
    let journal_before = std::fs::read(state.join("journal.jsonl")).unwrap();
    let o = run("orchestrator", &["recover", "--state-dir", state.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("held by a running coordinator") && stderr(&o).contains("nothing was changed"), "{}", stderr(&o));
    assert!(Path::new(&cluster.token).exists(), "the token file must stay");
    assert_eq!(std::fs::read(state.join("journal.jsonl")).unwrap(), journal_before);
    assert_eq!(cluster.report()["ok"], true);
    let o = cluster.cmd("shutdown", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A journal whose plan asks for an impossible probe (edited by hand, or written by something
/// else) is refused by `recover` with the journal and the field named, before it listens or
/// touches the journal.
#[test]
fn recover_refuses_a_journal_with_an_impossible_probe() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, state) = (tmp.path().join("A"), tmp.path().join("state"));
    synth_tiny(&a, "1");
    let mut cluster = Served::on_checkpoint("1", "1", &a, tmp.path(), &["--state-dir", state.to_str().unwrap()]);
    assert_eq!(journal(&state)[0]["probe"], serde_json::json!([2, 16, 0]));
    cluster.kill_coordinator();
    let good = std::fs::read_to_string(state.join("journal.jsonl")).unwrap();
    for (probe, field) in [("[0,16,0]", "probe tokens"), ("[2,100000000,0]", "probe latents")] {
        let bad = good.replacen("\"probe\":[2,16,0]", &format!("\"probe\":{probe}"), 1);
        assert_ne!(bad, good);
        std::fs::write(state.join("journal.jsonl"), &bad).unwrap();
        let o = run("orchestrator", &["recover", "--state-dir", state.to_str().unwrap()]);
        assert!(!o.status.success(), "{probe}: {}", stdout(&o));
        assert!(stderr(&o).contains("journal.jsonl") && stderr(&o).contains(field), "{probe}: {}", stderr(&o));
        assert!(!stderr(&o).contains("adopting"), "{probe}: it refused before adopting anything: {}", stderr(&o));
        assert_eq!(std::fs::read_to_string(state.join("journal.jsonl")).unwrap(), bad, "{probe}: the journal is untouched");
    }
}

/// A journal that names a pid which is now another process (a `sleep` standing in for a reused
/// pid) never gets that process signalled by `recover`.
#[test]
fn recover_signals_no_process_it_cannot_prove_is_its_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, state) = (tmp.path().join("A"), tmp.path().join("state"));
    synth_tiny(&a, "1");
    let mut cluster = Served::on_checkpoint("1", "1", &a, tmp.path(), &["--state-dir", state.to_str().unwrap(), "--worker-grace", "1"]);
    let worker = journal(&state)[0]["workers"][0]["pid"].as_u64().unwrap();
    cluster.kill_coordinator();
    // The worker stops on its own after its grace period; a `sleep` takes its place in the journal.
    let start = Instant::now();
    while Path::new(&format!("/proc/{worker}")).exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut sleep = Command::new("sleep").arg("60").spawn().unwrap();
    let text = std::fs::read_to_string(state.join("journal.jsonl")).unwrap();
    let text = text.replace(&format!("\"pid\":{worker},"), &format!("\"pid\":{},", sleep.id()));
    std::fs::write(state.join("journal.jsonl"), text).unwrap();
    // The recovered coordinator finds no worker it can prove is its own; asked to stop (SIGTERM),
    // it stops its "workers", and must not touch the sleep.
    let mut recovering = Command::new(bin("orchestrator"))
        .args(["recover", "--state-dir", state.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    let _ = Command::new("kill").args(["-TERM", &recovering.id().to_string()]).status();
    let start = Instant::now();
    while recovering.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = recovering.kill();
    let _ = recovering.wait();
    assert_eq!(sleep.try_wait().unwrap(), None, "recover signalled a process it could not prove was its worker");
    let _ = sleep.kill();
    let _ = sleep.wait();
}

/// A report that takes long (large probes) holds up neither routed probes nor shutdown.
#[test]
fn a_long_report_blocks_neither_probes_nor_shutdown() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("A");
    synth_tiny(&a, "1");
    let cluster = Served::start(&["--probe", "32,1024", "--tp", "1", "--dp", "2", "--checkpoint", a.to_str().unwrap()]);
    let report = {
        let (coordinator, token) = (cluster.coordinator.clone(), cluster.token.clone());
        std::thread::spawn(move || {
            let t = Instant::now();
            let o = run("orchestrator", &["report", "--coordinator", &coordinator, "--token-file", &token]);
            (t.elapsed(), o)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let o = cluster.cmd("shutdown", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_secs(1), "shutdown took {:?} behind a report", t.elapsed());
    // The report itself may end either way once the cluster stops; it must not hold it up.
    drop(report);
}

/// A launch refused late (`--worker-grace nan`) or interrupted (SIGTERM mid-launch) leaves no
/// token file behind.
#[test]
fn failed_and_interrupted_launches_leave_no_token_file() {
    let cache = tempfile::tempdir().unwrap();
    let run_dir = cache.path().join("run");
    let tokens = || std::fs::read_dir(&run_dir).map(|d| d.count()).unwrap_or(0);
    let o = Command::new(bin("orchestrator"))
        .env("ORCHESTRATOR_CACHE", cache.path())
        .args(["launch", "--dummy", "--preset", "tiny", "--layers", "1", "--tp", "1", "--worker-grace", "nan"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--worker-grace"), "{}", stderr(&o));
    assert_eq!(tokens(), 0, "a refused launch left a token file");
    let mut child = Command::new(bin("orchestrator"))
        .env("ORCHESTRATOR_CACHE", cache.path())
        .args(["launch", "--dummy", "--preset", "tiny", "--layers", "2", "--tp", "2", "--probe", "256,4096"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while tokens() == 0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(tokens(), 1, "the launch makes its token file");
    std::thread::sleep(Duration::from_millis(300));
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(tokens(), 0, "an interrupted launch left its token file");
}
