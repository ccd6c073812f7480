//! `cargo bench -p orchestrator-worker --bench gemm`: MXFP8 GEMM GFLOP/s on the dsv41-flash
//! TP 4 shapes (T = 1, 16, 128) next to the naive triple loop and the memory read roof,
//! measured in the same run, and the time of one probe (T = 16, S = 128) per rank.

use orchestrator_worker::bench::run_gemm;

fn main() -> anyhow::Result<()> {
    let dir = std::env::var("BENCH_DIR").map(Into::into).unwrap_or_else(|_| std::path::PathBuf::from("../target/bench-ckpt"));
    let report = run_gemm(&[1, 2, 4, 8, 16, 128], &dir)?;
    print!("{}", report.render());
    Ok(())
}
