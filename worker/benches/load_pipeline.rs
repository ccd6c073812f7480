//! `cargo bench -p orchestrator-worker`: the load pipeline on the real DeepSeek-V4.1-Flash
//! geometry (FP8 and BF16), as a ratio to memcpy measured in the same run.
//! Environment: BENCH_LAYERS (default 2), BENCH_TP (default 1), BENCH_DIR (default target/bench-ckpt).

use orchestrator_model::Preset;
use orchestrator_worker::bench::{BenchOptions, run};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing: run either way.
    let dir = std::env::var("BENCH_DIR").map(Into::into).unwrap_or_else(|_| std::path::PathBuf::from("../target/bench-ckpt"));
    let opts = BenchOptions {
        preset: Preset::Dsv41Flash,
        layers: env("BENCH_LAYERS", 2),
        tp_size: env("BENCH_TP", 1),
        rank: 0,
        iters: 5,
        dir,
        formats: vec!["fp8".into(), "bf16".into()],
        worker_exe: Some(env!("CARGO_BIN_EXE_orchestrator-worker").into()),
    };
    let report = run(&opts)?;
    print!("{}", report.render(&opts));
    Ok(())
}
