//! A reload replays the pipeline into the rank's existing buffers: after the first load, a
//! reload of the same shapes allocates no large buffer at all; and a round trip on the scratch
//! an earlier one kept allocates none either (counted by a global allocator; this file holds
//! one test so nothing else allocates meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use orchestrator_kernels::{CpuBackend, ScaleRule};
use orchestrator_model::synth::{SynthOptions, write_checkpoint};
use orchestrator_model::{Generator, ModelConfig, Preset, WeightFormat};
use orchestrator_worker::roundtrip::{RoundTripScratch, check_rank_with};
use orchestrator_worker::{LoadSource, RankLoader};

struct Counting;

static LARGE_ALLOCS: AtomicUsize = AtomicUsize::new(0);
const LARGE: usize = 64 * 1024;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= LARGE {
            LARGE_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= LARGE {
            LARGE_ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Every reload, the first included, allocates no large buffer: the tiny shapes (both formats,
/// from a checkpoint and synthesized), and one layer of the real `dsv41-flash` geometry (where,
/// with one pool for the layer, the first reload handed `wq_b`'s scale buffer to `wo_a`'s
/// scratch and allocated `wo_b`'s swizzled scale anew, once per layer).
#[test]
fn reloads_allocate_no_large_buffers() {
    let mut geometry = Preset::Tiny.geometry();
    geometry.layers = 2;
    for format in [WeightFormat::Fp8 { block: [32, 32] }, WeightFormat::Bf16] {
        let config = ModelConfig { family: Preset::Tiny.family(), geometry: geometry.clone(), format };
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        write_checkpoint(&dir, &SynthOptions { config: config.clone(), seed: 3, max_shard_bytes: 1 << 30, preset_name: None }).unwrap();
        reloads_of(&LoadSource::open_checkpoint(&dir).unwrap(), &[(1, 0), (2, 1), (8, 5)]);
        reloads_of(&LoadSource::Dummy { config, generator: Generator::new(4) }, &[(1, 0), (2, 1), (8, 5)]);
    }
    let mut geometry = Preset::Dsv41Flash.geometry();
    geometry.layers = 1;
    let config = ModelConfig { family: Preset::Dsv41Flash.family(), geometry, format: WeightFormat::Fp8 { block: [32, 32] } };
    reloads_of(&LoadSource::Dummy { config, generator: Generator::new(4) }, &[(2, 1), (8, 5)]);
}

/// Loads each rank of `ranks` (TP size, rank) from `source`, then reloads it twice, counting
/// the large allocations of each reload; then runs its round trip twice on the same kept
/// scratch, the second of which must allocate nothing large either.
fn reloads_of(source: &LoadSource, ranks: &[(usize, usize)]) {
    let format = source.config().format;
    let large_allocs_of = |f: &mut dyn FnMut()| {
        let before = LARGE_ALLOCS.load(Ordering::Relaxed);
        f();
        LARGE_ALLOCS.load(Ordering::Relaxed) - before
    };
    for &(tp, rank) in ranks {
        let what = format!("{format:?} {} tp {tp} rank {rank}", source.format_name());
        let loader = RankLoader::new(&CpuBackend, source.config(), tp, rank, ScaleRule::Rceil).unwrap();
        let mut w = Some(loader.load(source).unwrap());
        for _ in 0..2 {
            let during = large_allocs_of(&mut || w = Some(loader.reload(w.take().unwrap(), source).unwrap()));
            assert_eq!(during, 0, "{what}: a reload made {during} allocations of >= {LARGE} bytes");
        }
        // On one thread, so that both round trips check their layers one at a time (more at
        // once would each take a scratch set of their own, as many as ran at once before).
        let (w, scratch) = (w.unwrap(), RoundTripScratch::default());
        let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert!(one_thread.install(|| check_rank_with(&CpuBackend, &w, source, &scratch)).ok, "{what}: the first round trip");
        let mut second = None;
        let during = large_allocs_of(&mut || second = Some(one_thread.install(|| check_rank_with(&CpuBackend, &w, source, &scratch))));
        assert!(second.is_some_and(|rt| rt.ok && rt.checked > 0), "{what}: the second round trip");
        assert_eq!(during, 0, "{what}: a round trip on kept scratch made {during} allocations of >= {LARGE} bytes");
    }
}
