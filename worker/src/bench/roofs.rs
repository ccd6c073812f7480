//! The yardsticks the benchmarks divide by, timed in the same run: memcpy on all threads and
//! on one, a streaming read of a buffer larger than the caches, and the peak rates of f32
//! multiply-adds and of `vdpbf16ps`.

use std::time::Instant;

use rayon::prelude::*;

/// A buffer larger than the caches and its copy, for timing memcpy.
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    pub fn new(bytes: usize) -> Self {
        Self { src: (0..bytes).map(|i| (i * 31) as u8).collect(), dst: vec![0u8; bytes] }
    }

    /// Seconds of one copy on all rayon threads (each copies its own part).
    pub fn all_threads(&mut self) -> f64 {
        let part = self.src.len().div_ceil(rayon::current_num_threads().max(1));
        let t = Instant::now();
        self.dst.par_chunks_mut(part).zip(self.src.par_chunks(part)).for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&self.dst);
        t.elapsed().as_secs_f64()
    }

    /// Seconds of one copy on this thread.
    fn one_thread(&mut self) -> f64 {
        let t = Instant::now();
        self.dst.copy_from_slice(&self.src);
        std::hint::black_box(&self.dst);
        t.elapsed().as_secs_f64()
    }

    pub(super) fn gb_per_s(&self, seconds: f64) -> f64 {
        self.src.len() as f64 / seconds / 1e9
    }

    /// Best-of-`iters` bandwidth on one thread and on all rayon threads (each copies its own
    /// part).
    pub fn bandwidth(&mut self, iters: usize) -> (f64, f64) {
        let (mut best_all, mut best_one) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..iters.max(1) {
            best_all = best_all.min(self.all_threads());
            best_one = best_one.min(self.one_thread());
        }
        (self.gb_per_s(best_one), self.gb_per_s(best_all))
    }
}

/// Reading a buffer larger than the caches (summing its words) on all rayon threads: the roof
/// of a kernel that streams its weights once.
pub struct ReadRoof {
    words: Vec<u64>,
}

impl ReadRoof {
    pub fn new(bytes: usize) -> Self {
        Self { words: (0..bytes / 8).map(|i| i as u64 * 0x9E37_79B9).collect() }
    }

    /// Seconds of one read of the whole buffer.
    pub fn once(&self) -> f64 {
        let part = self.words.len().div_ceil(rayon::current_num_threads().max(1));
        let t = Instant::now();
        let sum: u64 = self.words.par_chunks(part).map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w))).sum();
        std::hint::black_box(sum);
        t.elapsed().as_secs_f64()
    }

    pub fn gb_per_s(&self, seconds: f64) -> f64 {
        (self.words.len() * 8) as f64 / seconds / 1e9
    }

    /// Best-of-`iters` bandwidth.
    pub fn bandwidth(&self, iters: usize) -> f64 {
        self.gb_per_s((0..iters.max(1)).map(|_| self.once()).fold(f64::INFINITY, f64::min))
    }
}

/// Best-of-3 rate of f32 multiply-adds, vector lanes per second summed over all rayon threads
/// running at once (so two hardware threads of one core count as the one core they are): the
/// arithmetic roof of a GEMM bound to the plain loop's bits, where each output adds one rounded
/// product per weight in `k` order, so that `T` activation rows cost `T` multiply-adds per
/// weight. `None` where it is not measured (no AVX-512 F, no AVX2 with FMA).
pub fn multiply_add_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let lanes = peak::lanes()?;
        Some(best_rate(|iters| peak::run(lanes, iters), lanes))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// The same for `vdpbf16ps`, which does two of those multiply-adds per f32 lane in one
/// instruction (each rounded, in order: the plain loop's bits): the arithmetic roof where the
/// GEMM takes its BF16 dot-product path ([`orchestrator_kernels::gemm::uses_bf16_dot`]), in
/// multiply-adds per second. `None` where that path is not taken.
pub fn bf16_dot_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        if !orchestrator_kernels::gemm::uses_bf16_dot(1) {
            return None;
        }
        // SAFETY: the dot path runs only where the CPU has AVX-512 F and BF16.
        Some(best_rate(|iters| unsafe { peak::run_bf16(iters) }, 32))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Best of 3: multiply-adds per second of `run` (`per_op` per instruction, `peak::ACCUMULATORS`
/// chains) on every rayon thread at once.
#[cfg(target_arch = "x86_64")]
fn best_rate(run: impl Fn(usize) -> f32 + Sync, per_op: usize) -> f64 {
    const ITERS: usize = 1 << 21;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let sums = rayon::broadcast(|_| run(ITERS));
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        best = best.max((rayon::current_num_threads() * ITERS * peak::ACCUMULATORS * per_op) as f64 / s);
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    /// Independent chains, enough to cover the latency of two pipes.
    pub const ACCUMULATORS: usize = 16;

    pub fn lanes() -> Option<usize> {
        if is_x86_feature_detected!("avx512f") {
            Some(16)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some(8)
        } else {
            None
        }
    }

    /// The chains on the vectors `lanes` chose (16 or 8 lanes).
    pub fn run(lanes: usize, iters: usize) -> f32 {
        // SAFETY: `lanes` returned 16 only where AVX-512 F is, 8 only where AVX2 and FMA are.
        unsafe { if lanes == 16 { run512(iters) } else { run256(iters) } }
    }

    /// `ACCUMULATORS` independent chains of `iters` multiply-adds each, in whatever vector
    /// type the caller's instructions take.
    #[inline(always)]
    fn chains<V: Copy>(iters: usize, one: V, fma: impl Fn(V) -> V) -> [V; ACCUMULATORS] {
        let mut acc = [one; ACCUMULATORS];
        for _ in 0..iters {
            for a in &mut acc {
                *a = fma(*a);
            }
        }
        acc
    }

    /// `ACCUMULATORS` chains of `iters` `vdpbf16ps` each.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn run_bf16(iters: usize) -> f32 {
        // SAFETY: the same size and bits; 32 BF16 lanes of 0.5 and of 1e-7's top half.
        let (x, y): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x3F00)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(0x33D6)),
            )
        };
        let acc = chains(iters, _mm512_set1_ps(1.0), |a| _mm512_dpbf16_ps(a, x, y));
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    #[target_feature(enable = "avx512f")]
    fn run512(iters: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let acc = chains(iters, _mm512_set1_ps(1.0), |a| _mm512_fmadd_ps(a, x, y));
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    fn run256(iters: usize) -> f32 {
        let (x, y) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let acc = chains(iters, _mm256_set1_ps(1.0), |a| _mm256_fmadd_ps(a, x, y));
        let mut lanes = [0f32; 8];
        acc.iter().fold(0.0, |sum, &a| {
            // SAFETY: eight lanes of four bytes.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
            sum + lanes.iter().sum::<f32>()
        })
    }
}
