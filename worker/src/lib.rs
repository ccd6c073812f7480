//! The orchestrator worker: loads one rank's shard of DeepSeek-V4.1 attention weights through
//! the permuting pipeline, on a compute backend, and reports what its kernels will read.

pub mod alloc;
pub mod background;
pub mod bench;
pub mod cli;
pub mod collective;
pub mod device;
pub mod dump;
pub mod faults;
pub mod golden;
pub mod identity;
pub mod loader;
pub mod manifest;
pub mod metrics;
pub mod nccl;
pub mod placement;
pub mod probe;
pub mod rank;
pub mod reference;
pub mod report;
pub mod roundtrip;
pub mod server;
pub mod source;

pub use identity::LayoutIdentity;
pub use loader::{LoadError, RankLoader, RankWeights};
pub use report::RankReport;
pub use source::LoadSource;

use std::path::Path;
use std::time::Instant;

use orchestrator_kernels::{Backend, ScaleRule};

/// Loads one rank, checks its round trip, optionally dumps it and runs a probe, and reports.
pub fn load_and_report<B: Backend + Sync>(
    backend: &B,
    source: &LoadSource,
    tp_size: usize,
    rank: usize,
    rule: ScaleRule,
    dump_dir: Option<&Path>,
    probe: Option<probe::ProbeSpec>,
) -> anyhow::Result<RankReport>
where
    B::Buffer: Send + Sync,
{
    let loader = RankLoader::new(backend, source.config(), tp_size, rank, rule)?;
    let weights = loader.load(source)?;
    let t = Instant::now();
    let rt = roundtrip::check_rank(backend, &weights, source);
    let rt_s = t.elapsed().as_secs_f64();
    let dump = match dump_dir {
        Some(d) => {
            let dir = dump::DumpDir::create(d).map_err(|e| anyhow::anyhow!("--dump {}: {e}", d.display()))?;
            Some(dump::dump_rank(backend, &weights, &dir)?)
        }
        None => None,
    };
    let probe = match probe {
        Some(spec) => Some(probe::probe_rank(&loader, &weights, source, spec, rule)?),
        None => None,
    };
    Ok(RankReport::new(backend, &weights, rt, rt_s, dump, probe))
}
