//! The served worker's device switch: `AnyBackend` on the CPU forwards every operation to the
//! CPU backend (same digests, same probe), and an unknown or unavailable device is a clear error.

use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::{Generator, ModelConfig, Preset};
use orchestrator_worker::device::AnyBackend;
use orchestrator_worker::probe::{ProbeSpec, probe_rank};
use orchestrator_worker::roundtrip::check_rank;
use orchestrator_worker::{LoadSource, RankLoader};

#[test]
fn any_backend_on_the_cpu_is_the_cpu_backend() {
    let any = AnyBackend::open("cpu").unwrap();
    assert!(!any.is_cuda());
    assert!(any.nccl_unique_id().unwrap().is_empty());
    for bf16 in [false, true] {
        let source =
            LoadSource::Dummy { config: ModelConfig::from_preset(Preset::Tiny, Some(1), bf16).unwrap(), generator: Generator::new(9) };
        let spec = ProbeSpec { tokens: 3, latents: 8, seed: 1 };
        let cpu = RankLoader::new(&CpuBackend, source.config(), 2, 1, ScaleRule::Floor).unwrap();
        let dev = RankLoader::new(&any, source.config(), 2, 1, ScaleRule::Floor).unwrap();
        let (want, got) = (cpu.load(&source).unwrap(), dev.load(&source).unwrap());
        assert_eq!(got.kernel_rank_digest(), want.kernel_rank_digest());
        assert!(check_rank(&any, &got, &source).ok);
        let (pw, pg) = (
            probe_rank(&cpu, &want, &source, spec, ScaleRule::Floor).unwrap(),
            probe_rank(&dev, &got, &source, spec, ScaleRule::Floor).unwrap(),
        );
        assert!(pg.ok);
        assert_eq!(pg.y_partial_digest, pw.y_partial_digest);
        let again = dev.reload(got, &source).unwrap();
        assert_eq!(again.kernel_rank_digest(), want.kernel_rank_digest());
    }
}

#[test]
fn unknown_or_unusable_devices_are_clear_errors() {
    let err = AnyBackend::open("tpu").err().expect("no such device").to_string();
    assert!(err.contains("unknown device `tpu`"), "{err}");
    // Without a usable GPU (or without the feature) `cuda` is an error that says why; with one,
    // it opens.
    if let Err(e) = AnyBackend::open("cuda") {
        let e = e.to_string();
        assert!(e.contains("without the `cuda` feature") || e.contains("CUDA"), "{e}");
    }
    let mut collectives = orchestrator_worker::device::DeviceCollectives::default();
    let cpu = AnyBackend::open("cpu").unwrap();
    let mut y = vec![1.0f32; 4];
    assert!(cpu.nccl_all_reduce(&mut collectives, 0, &[0; 128], 0, 1, std::time::Duration::from_secs(1), &mut y).is_err());
}
