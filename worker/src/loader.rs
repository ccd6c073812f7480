//! Loading one rank: for every layer and parameter, read the rank's checkpoint-order slice
//! (or generate it), then run the typed pipeline (expand or quantize -> permute -> kernel
//! hooks) on the backend. Real, dummy and reload paths all go through [`RankLoader::load_layer`].

use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use orchestrator_kernels::params::{
    CheckpointOrder, Fused, HostBytes, KernelTensor, Mx, OPermutation, QPermutation, SourceDigests, WeightSource, WoA, WoB, WqB,
};
use orchestrator_kernels::placement::QuantizedDigests;
use orchestrator_kernels::{Backend, BufferPool, Digest, KernelError, ScaleRule};
use orchestrator_model::names::{checkpoint_name, kernel_name, layer_tensors};
use orchestrator_model::{Geometry, ModelConfig, ModelError, Param, Part, RankShard, TensorSpec, WeightFormat};
use rayon::prelude::*;

use crate::identity::LayoutIdentity;
use crate::source::{Fetched, LoadSource};

/// Why a rank failed to load.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{}tensor `{tensor}`: {source}", file.as_ref().map(|f| format!("{}: ", f.display())).unwrap_or_default())]
    Tensor { tensor: String, file: Option<PathBuf>, source: KernelError },
    #[error("{0}")]
    Config(String),
    /// A probe over the limits on the weights it would run on ([`ProbeSpec::check_on`]).
    #[error("probe {spec}: {error}")]
    ProbeSize { spec: crate::probe::ProbeSpec, error: orchestrator_model::limits::LimitError },
}

impl LoadError {
    /// The tensor the error is about, when there is one.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            LoadError::Tensor { tensor, .. } => Some(tensor),
            LoadError::Model(
                ModelError::MissingTensor { tensor, .. }
                | ModelError::MissingShard { tensor, .. }
                | ModelError::MalformedHeader { tensor, .. }
                | ModelError::Truncated { tensor, .. }
                | ModelError::BadOffsets { tensor, .. }
                | ModelError::WrongDtype { tensor, .. }
                | ModelError::WrongShape { tensor, .. }
                | ModelError::NanScale { tensor, .. }
                | ModelError::NonFinite { tensor, .. },
            ) => Some(tensor),
            _ => None,
        }
    }
}

/// Time spent per stage, summed over the threads that ran it.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StageTimes {
    /// Copying (or generating) the rank's slices and hashing them (source digests).
    pub read_s: f64,
    /// Expansion or quantization, permutation and kernel hooks.
    pub pipeline_s: f64,
    /// Kernel digests.
    pub digest_s: f64,
}

impl StageTimes {
    fn add(&mut self, o: &StageTimes) {
        self.read_s += o.read_s;
        self.pipeline_s += o.pipeline_s;
        self.digest_s += o.digest_s;
    }
}

/// A digest of one named tensor with its stored dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TensorDigest {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: usize,
    #[serde(serialize_with = "serialize_hex")]
    pub digest: Digest,
}

/// Digests appear in JSON as 16 lowercase hex digits.
pub fn serialize_hex<S: serde::Serializer>(d: &Digest, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&d.hex())
}

/// Scratch memory one layer keeps for reloads: backend buffers and host staging.
pub struct LayerScratch<B: Backend> {
    /// Backend buffers per parameter (indexed by [`param_slot`]), each parameter's own: its
    /// pipeline takes and gives them in the same order on every load, so a reload finds each
    /// buffer it needs where the load left it. (One pool for the layer let a reload hand one
    /// parameter's scale buffer to another's scratch, and allocate the first a new one.)
    pub(crate) pools: [BufferPool<B>; 4],
    /// Host staging per parameter (indexed by [`param_slot`]): each keeps the capacity its
    /// parameter needs, so a reload never reallocates.
    pub(crate) host_weight: [Vec<u8>; 4],
    pub(crate) host_scale: Vec<u8>,
}

/// Index of a parameter's host staging buffer.
pub(crate) fn param_slot(p: Param) -> usize {
    match p {
        Param::WqB => 0,
        Param::WoA => 1,
        Param::WoB => 2,
        Param::AttnSink => 3,
    }
}

impl<B: Backend> Default for LayerScratch<B> {
    fn default() -> Self {
        Self { pools: Default::default(), host_weight: Default::default(), host_scale: Vec::new() }
    }
}

/// One layer's parameters in their kernel layouts.
pub struct LayerWeights<B: Backend> {
    pub layer: usize,
    pub wq_b: KernelTensor<B>,
    pub wo_a: KernelTensor<B>,
    pub wo_b: KernelTensor<B>,
    pub attn_sink: B::Buffer,
    /// Digests of the rank's checkpoint slices as stored, by checkpoint name.
    pub source: Vec<TensorDigest>,
    /// Digests of the kernel-visible tensors, by parameter name.
    pub kernel: Vec<TensorDigest>,
    /// BF16 sources quantized on the host: checkpoint weight name -> the MXFP8 its quantizer
    /// produced, in checkpoint order (what the round trip must read back out of the kernel
    /// tensor). Empty for FP8, and where the backend quantized on the device.
    pub quantized: Vec<(String, QuantizedDigests)>,
    pub times: StageTimes,
    scratch: LayerScratch<B>,
}

impl<B: Backend> LayerWeights<B> {
    /// Gives every buffer back to the layer's scratch (a reload then writes into them).
    fn into_scratch(self) -> LayerScratch<B> {
        let mut s = self.scratch;
        self.wq_b.recycle(&mut s.pools[param_slot(Param::WqB)]);
        self.wo_a.recycle(&mut s.pools[param_slot(Param::WoA)]);
        self.wo_b.recycle(&mut s.pools[param_slot(Param::WoB)]);
        s.pools[param_slot(Param::AttnSink)].give(self.attn_sink);
        s
    }

    /// Allocation identities of the scratch buffers kept for reloads.
    pub fn scratch_allocation_ids(&self, backend: &B) -> Vec<usize> {
        let host = self.scratch.host_weight.iter().chain(std::iter::once(&self.scratch.host_scale)).map(|v| v.as_ptr() as usize);
        self.scratch.pools.iter().flat_map(|p| p.allocation_ids(backend)).chain(host).collect()
    }

    /// Allocation identities of the kernel buffers (to show a reload reuses them).
    pub fn allocation_ids(&self, backend: &B) -> Vec<usize> {
        [&self.wq_b, &self.wo_a, &self.wo_b]
            .iter()
            .flat_map(|k| [backend.allocation_id(&k.weight), backend.allocation_id(&k.scale)])
            .chain(std::iter::once(backend.allocation_id(&self.attn_sink)))
            .collect()
    }
}

/// A loaded rank.
pub struct RankWeights<B: Backend> {
    pub shard: RankShard,
    pub identity: LayoutIdentity,
    pub layers: Vec<LayerWeights<B>>,
    pub load_format: &'static str,
    pub source: String,
    pub wall: Duration,
    pub times: StageTimes,
    /// How many times the pipeline has filled these buffers (1 after a load).
    pub generation: u64,
}

impl<B: Backend> RankWeights<B> {
    /// Recomputes the kernel digests from the buffers (after anything edited them in place).
    pub fn refresh_kernel_digests(&mut self, backend: &B) -> Result<(), LoadError> {
        let heads = self.shard.n_local_heads;
        for l in &mut self.layers {
            l.kernel = kernel_digests(backend, l.layer, [&l.wq_b, &l.wo_a, &l.wo_b], [None; 3], &l.attn_sink, heads)?;
        }
        Ok(())
    }

    /// All kernel tensor digests, sorted by name.
    pub fn kernel_digests(&self) -> Vec<&TensorDigest> {
        let mut v: Vec<&TensorDigest> = self.layers.iter().flat_map(|l| &l.kernel).collect();
        v.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        v
    }
    /// All source digests, sorted by name.
    pub fn source_digests(&self) -> Vec<&TensorDigest> {
        let mut v: Vec<&TensorDigest> = self.layers.iter().flat_map(|l| &l.source).collect();
        v.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        v
    }
    /// Rank digest over the kernel tensors (spec section 9).
    pub fn kernel_rank_digest(&self) -> Digest {
        orchestrator_kernels::digest::rank_digest(self.kernel_digests().into_iter().map(|d| (d.name.as_str(), d.digest)))
    }
    /// Rank digest over the checkpoint slices as stored.
    pub fn source_rank_digest(&self) -> Digest {
        orchestrator_kernels::digest::rank_digest(self.source_digests().into_iter().map(|d| (d.name.as_str(), d.digest)))
    }
    /// Bytes of kernel-visible tensors held.
    pub fn kernel_bytes(&self) -> usize {
        self.layers.iter().flat_map(|l| &l.kernel).map(|d| d.bytes).sum()
    }
    /// Bytes of checkpoint slices read.
    pub fn source_bytes(&self) -> usize {
        self.layers.iter().flat_map(|l| &l.source).map(|d| d.bytes).sum()
    }
}

/// Loads one rank of one TP group with a backend.
pub struct RankLoader<'b, B: Backend> {
    backend: &'b B,
    pub(crate) geometry: Geometry,
    pub(crate) format: WeightFormat,
    shard: RankShard,
    rule: ScaleRule,
    q: QPermutation,
    o: OPermutation,
}

fn dtype_name(d: safetensors::Dtype) -> String {
    format!("{d:?}")
}

impl<'b, B: Backend + Sync> RankLoader<'b, B> {
    /// Validates the TP plan against the geometry and builds the permutations from the rank's
    /// geometry (local heads, head_dim).
    pub fn new(backend: &'b B, config: &ModelConfig, tp_size: usize, rank: usize, rule: ScaleRule) -> Result<Self, LoadError> {
        let geometry = config.geometry.clone();
        let shard = RankShard::new(&geometry, tp_size, rank)?;
        let kernel = |e: KernelError| LoadError::Config(format!("permutation for rank {rank}: {e}"));
        let q = QPermutation::new(shard.n_local_heads, geometry.head_dim).map_err(kernel)?;
        let o = OPermutation::new(geometry.head_dim).map_err(kernel)?;
        Ok(Self { backend, geometry, format: config.format, shard, rule, q, o })
    }

    pub fn shard(&self) -> &RankShard {
        &self.shard
    }

    pub fn backend(&self) -> &'b B {
        self.backend
    }

    pub fn rule(&self) -> ScaleRule {
        self.rule
    }

    pub fn identity(&self) -> LayoutIdentity {
        LayoutIdentity::new(&self.geometry, &self.shard, self.format, self.rule)
    }

    /// Loads every layer (in parallel across layers).
    pub fn load(&self, source: &LoadSource) -> Result<RankWeights<B>, LoadError>
    where
        B::Buffer: Send,
    {
        self.load_with_progress(source, &|_| {})
    }

    /// [`RankLoader::load`], calling `progress(layer)` as each layer finishes.
    pub fn load_with_progress(&self, source: &LoadSource, progress: &(dyn Fn(usize) + Sync)) -> Result<RankWeights<B>, LoadError>
    where
        B::Buffer: Send,
    {
        self.check_source(source)?;
        let start = Instant::now();
        let layers: Vec<LayerWeights<B>> = (0..self.geometry.layers)
            .into_par_iter()
            .map(|l| {
                let layer = self.load_layer(source, l, LayerScratch::default());
                progress(l);
                layer
            })
            .collect::<Result<_, _>>()?;
        Ok(self.assemble(source, layers, start.elapsed(), 1))
    }

    /// [`RankLoader::load`] one layer after another, asking `cancelled` before each layer:
    /// `None` (and what was loaded freed) once it says so.
    pub fn load_unless(&self, source: &LoadSource, cancelled: &dyn Fn() -> bool) -> Result<Option<RankWeights<B>>, LoadError>
    where
        B::Buffer: Send,
    {
        self.check_source(source)?;
        let start = Instant::now();
        let mut layers = Vec::with_capacity(self.geometry.layers);
        for l in 0..self.geometry.layers {
            if cancelled() {
                return Ok(None);
            }
            layers.push(self.load_layer(source, l, LayerScratch::default())?);
        }
        Ok(Some(self.assemble(source, layers, start.elapsed(), 1)))
    }

    /// Replays the same pipeline into the existing buffers: every kernel buffer and scratch
    /// buffer of `weights` is reused. On error the rank holds no weights (it never serves a
    /// mix of versions); the error says which tensor failed.
    pub fn reload(&self, weights: RankWeights<B>, source: &LoadSource) -> Result<RankWeights<B>, LoadError>
    where
        B::Buffer: Send,
    {
        self.reload_with_progress(weights, source, &|_| {})
    }

    /// [`RankLoader::reload`], calling `progress(layer)` as each layer finishes.
    pub fn reload_with_progress(
        &self,
        weights: RankWeights<B>,
        source: &LoadSource,
        progress: &(dyn Fn(usize) + Sync),
    ) -> Result<RankWeights<B>, LoadError>
    where
        B::Buffer: Send,
    {
        self.check_source(source)?;
        let start = Instant::now();
        let generation = weights.generation + 1;
        let layers: Vec<LayerWeights<B>> = weights
            .layers
            .into_par_iter()
            .map(|old| {
                let layer = old.layer;
                let loaded = self.load_layer(source, layer, old.into_scratch());
                progress(layer);
                loaded
            })
            .collect::<Result<_, _>>()?;
        Ok(self.assemble(source, layers, start.elapsed(), generation))
    }

    pub(crate) fn check_source(&self, source: &LoadSource) -> Result<(), LoadError> {
        let cfg = source.config();
        if cfg.geometry != self.geometry || cfg.format != self.format {
            return Err(LoadError::Config(format!(
                "{} has geometry {:?} / {:?}, but this rank was planned for {:?} / {:?}",
                source.describe(),
                cfg.geometry,
                cfg.format,
                self.geometry,
                self.format
            )));
        }
        Ok(())
    }

    fn assemble(&self, source: &LoadSource, layers: Vec<LayerWeights<B>>, wall: Duration, generation: u64) -> RankWeights<B> {
        let mut times = StageTimes::default();
        for l in &layers {
            times.add(&l.times);
        }
        RankWeights {
            shard: self.shard.clone(),
            identity: self.identity(),
            layers,
            load_format: source.format_name(),
            source: source.describe(),
            wall,
            times,
            generation,
        }
    }

    pub(crate) fn slice_of(&self, spec: &TensorSpec) -> (Range<usize>, Range<usize>) {
        rank_slice(&self.geometry, self.format, &self.shard, spec)
    }

    /// Loads one layer through the pipeline, reusing `scratch`.
    pub fn load_layer(&self, source: &LoadSource, layer: usize, mut scratch: LayerScratch<B>) -> Result<LayerWeights<B>, LoadError> {
        let specs = layer_tensors(&self.geometry, self.format, layer);
        let find = |param, part| specs.iter().find(|s| s.param == param && s.part == part);
        let mut times = StageTimes::default();
        let mut source_digests = Vec::with_capacity(specs.len());
        let mut quantized = Vec::new();

        // wq_b and wo_a go straight from the source into their fused layouts (FP8 gathered,
        // BF16 quantized into place); wo_b is never permuted.
        let rule = self.rule;
        let backend = self.backend;
        // The source stage digests the weights as it places them where that comes for free (the
        // hooks below never change weight bytes): those digests stand for the kernel weights'.
        let mut placed = [None; 3];
        let wq_b = {
            let (fused, placed_wq_b): (Mx<B, WqB, Fused>, _) = self.read_matrix(
                source,
                Param::WqB,
                &find,
                &mut scratch,
                &mut source_digests,
                &mut quantized,
                &mut times,
                |src, rows, k, pool| Mx::<B, WqB, Fused>::from_source_permuted(backend, src, rows, k, rule, &self.q, pool),
            )?;
            placed[0] = placed_wq_b;
            let t = Instant::now();
            let k = fused
                .into_kernel(backend, &mut scratch.pools[param_slot(Param::WqB)])
                .map_err(|e| tensor_error(&checkpoint_name(layer, Param::WqB, Part::Weight), None, e))?;
            times.pipeline_s += t.elapsed().as_secs_f64();
            k
        };
        let wo_a = {
            let (fused, placed_wo_a): (Mx<B, WoA, Fused>, _) = self.read_matrix(
                source,
                Param::WoA,
                &find,
                &mut scratch,
                &mut source_digests,
                &mut quantized,
                &mut times,
                |src, rows, k, pool| Mx::<B, WoA, Fused>::from_source_permuted(backend, src, rows, k, rule, &self.o, pool),
            )?;
            placed[1] = placed_wo_a;
            let t = Instant::now();
            let k = fused
                .into_kernel(backend, self.shard.n_local_groups, &mut scratch.pools[param_slot(Param::WoA)])
                .map_err(|e| tensor_error(&checkpoint_name(layer, Param::WoA, Part::Weight), None, e))?;
            times.pipeline_s += t.elapsed().as_secs_f64();
            k
        };
        let wo_b = {
            let (mx, placed_wo_b): (Mx<B, WoB, CheckpointOrder>, _) = self.read_matrix(
                source,
                Param::WoB,
                &find,
                &mut scratch,
                &mut source_digests,
                &mut quantized,
                &mut times,
                |src, rows, k, pool| Mx::from_source(backend, src, rows, k, rule, pool),
            )?;
            placed[2] = placed_wo_b;
            let t = Instant::now();
            let k = mx
                .into_kernel(backend, &mut scratch.pools[param_slot(Param::WoB)])
                .map_err(|e| tensor_error(&checkpoint_name(layer, Param::WoB, Part::Weight), None, e))?;
            times.pipeline_s += t.elapsed().as_secs_f64();
            k
        };
        let attn_sink = {
            let spec = find(Param::AttnSink, Part::Weight).expect("every layer has attn_sink");
            let t = Instant::now();
            let (rows, cols) = self.slice_of(spec);
            let host = &mut scratch.host_weight[param_slot(Param::AttnSink)];
            let file = source.read(spec, rows, cols, host)?;
            if let Some(at) = host.chunks_exact(4).position(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite()) {
                return Err(tensor_error(&spec.name, file, KernelError::NonFinite { row: 0, col: self.shard.heads().start + at }));
            }
            source_digests.push(digest_of(spec, host, vec![self.shard.n_local_heads]));
            let mut buf = scratch.pools[param_slot(Param::AttnSink)].take(self.backend, host.len());
            self.backend.upload(host, &mut buf).map_err(|e| tensor_error(&spec.name, None, e))?;
            times.read_s += t.elapsed().as_secs_f64();
            buf
        };

        let t = Instant::now();
        let kernel = kernel_digests(self.backend, layer, [&wq_b, &wo_a, &wo_b], placed, &attn_sink, self.shard.n_local_heads)?;
        times.digest_s += t.elapsed().as_secs_f64();

        Ok(LayerWeights { layer, wq_b, wo_a, wo_b, attn_sink, source: source_digests, kernel, quantized, times, scratch })
    }

    /// Fetches a matrix parameter's slice (weight and, for FP8, block scale), hands the bytes
    /// to `build` (a pipeline constructor, which validates and digests them as stored), records
    /// the source digests, and maps errors to the tensor and absolute checkpoint position.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read_matrix<'s, T>(
        &self,
        source: &LoadSource,
        param: Param,
        find: &impl Fn(Param, Part) -> Option<&'s TensorSpec>,
        scratch: &mut LayerScratch<B>,
        digests: &mut Vec<TensorDigest>,
        quantized: &mut Vec<(String, QuantizedDigests)>,
        times: &mut StageTimes,
        build: impl FnOnce(WeightSource<'_>, usize, usize, &mut BufferPool<B>) -> Result<(T, SourceDigests), KernelError>,
    ) -> Result<(T, Option<Digest>), LoadError> {
        let t = Instant::now();
        let wspec = find(param, Part::Weight).expect("every layer has the weight");
        let (rows, cols) = self.slice_of(wspec);
        let (n_rows, n_cols) = (rows.len(), cols.len());
        let (row0, col0) = (rows.start, cols.start);
        let slot = param_slot(param);
        let fetched = source.fetch(wspec, rows, cols, &mut scratch.host_weight[slot])?;
        let wfile = fetched.file();
        let wbytes = fetched.bytes(&scratch.host_weight[slot]).len();
        let mut scale_ctx = None;
        if let WeightFormat::Fp8 { .. } = self.format {
            let sspec = find(param, Part::Scale).expect("FP8 layers have scales");
            let (srows, scols) = self.slice_of(sspec);
            let shape = vec![srows.len(), scols.len()];
            let origin = (srows.start, scols.start);
            let sfile = source.read(sspec, srows, scols, &mut scratch.host_scale)?;
            scale_ctx = Some((sspec, sfile, origin, shape));
        }
        times.read_s += t.elapsed().as_secs_f64();

        let t = Instant::now();
        let weight = match &fetched {
            Fetched::Mapped { shard, range } => HostBytes::Borrowed(shard.slice(range.clone())),
            Fetched::Staged { .. } => HostBytes::Staged(&mut scratch.host_weight[slot]),
        };
        let src = match self.format {
            WeightFormat::Fp8 { block } => WeightSource::Fp8 { weight, block_scale: &scratch.host_scale, block },
            WeightFormat::Bf16 => WeightSource::Bf16 { weight },
        };
        let (built, sd) = build(src, n_rows, n_cols, &mut scratch.pools[slot]).map_err(|e| match (e, &scale_ctx) {
            (KernelError::NanScale { row, col }, Some((sspec, file, (r0, c0), _))) => LoadError::Tensor {
                tensor: sspec.name.clone(),
                file: file.clone(),
                source: KernelError::NanScale { row: row + r0, col: col + c0 },
            },
            (KernelError::NonFinite { row, col }, _) => {
                tensor_error(&wspec.name, wfile.clone(), KernelError::NonFinite { row: row + row0, col: col + col0 })
            }
            (other, _) => tensor_error(&wspec.name, wfile.clone(), other),
        })?;
        times.pipeline_s += t.elapsed().as_secs_f64();
        let dtype = dtype_name(wspec.dtype);
        digests.push(TensorDigest { name: wspec.name.clone(), dtype, shape: vec![n_rows, n_cols], bytes: wbytes, digest: sd.weight });
        if let Some(q) = sd.quantized {
            quantized.push((wspec.name.clone(), q));
        }
        if let (Some((sspec, _, _, shape)), Some(d)) = (scale_ctx, sd.block_scale) {
            let bytes = shape.iter().product::<usize>();
            digests.push(TensorDigest { name: sspec.name.clone(), dtype: dtype_name(sspec.dtype), shape, bytes, digest: d });
        }
        Ok((built, sd.placed_weight))
    }
}

/// The rows and columns of a checkpoint tensor a rank holds (spec section 4); scale tensors
/// take the block-scaled rows or columns.
pub fn rank_slice(g: &Geometry, format: WeightFormat, s: &RankShard, spec: &TensorSpec) -> (Range<usize>, Range<usize>) {
    let (rows, cols) = (spec.rows(), spec.cols());
    let (bm, bk) = match (format, spec.part) {
        (WeightFormat::Fp8 { block: [bm, bk] }, Part::Scale) => (bm, bk),
        _ => (1, 1),
    };
    let div = |r: Range<usize>, d: usize| r.start / d..r.end / d;
    match spec.param {
        Param::WqB => (div(s.wq_b_rows(g), bm), 0..cols),
        Param::WoA => (div(s.wo_a_rows(g), bm), 0..cols),
        Param::WoB => (0..rows, div(s.wo_b_cols(g), bk)),
        Param::AttnSink => (0..1, s.heads()),
    }
}

/// Digests of one layer's kernel-visible tensors, in storage order. `placed`: weight digests
/// the source stage computed while writing these very buffers (used instead of reading them
/// again); `None` reads the buffers.
fn kernel_digests<B: Backend>(
    backend: &B,
    layer: usize,
    [wq_b, wo_a, wo_b]: [&KernelTensor<B>; 3],
    placed: [Option<Digest>; 3],
    attn_sink: &B::Buffer,
    heads: usize,
) -> Result<Vec<TensorDigest>, LoadError> {
    let mut kernel = Vec::with_capacity(7);
    for ((param, kt), placed) in [(Param::WqB, wq_b), (Param::WoA, wo_a), (Param::WoB, wo_b)].into_iter().zip(placed) {
        let wname = kernel_name(layer, param, Part::Weight);
        let sname = kernel_name(layer, param, Part::Scale);
        let wd = match placed {
            Some(d) => d,
            None => backend.digest(&kt.weight).map_err(|e| tensor_error(&wname, None, e))?,
        };
        let sd = backend.digest(&kt.scale).map_err(|e| tensor_error(&sname, None, e))?;
        let (sdtype, sshape) = kt.scale_layout.dtype_and_shape();
        kernel.push(TensorDigest {
            name: wname,
            dtype: "F8_E4M3".into(),
            shape: kt.weight_shape.clone(),
            bytes: backend.len(&kt.weight),
            digest: wd,
        });
        kernel.push(TensorDigest { name: sname, dtype: sdtype.into(), shape: sshape, bytes: backend.len(&kt.scale), digest: sd });
    }
    let sink_name = kernel_name(layer, Param::AttnSink, Part::Weight);
    kernel.push(TensorDigest {
        name: sink_name.clone(),
        dtype: "F32".into(),
        shape: vec![heads],
        bytes: backend.len(attn_sink),
        digest: backend.digest(attn_sink).map_err(|e| tensor_error(&sink_name, None, e))?,
    });
    Ok(kernel)
}

pub(crate) fn tensor_error(tensor: &str, file: Option<PathBuf>, source: KernelError) -> LoadError {
    LoadError::Tensor { tensor: tensor.to_string(), file, source }
}

fn digest_of(spec: &TensorSpec, bytes: &[u8], shape: Vec<usize>) -> TensorDigest {
    TensorDigest { name: spec.name.clone(), dtype: dtype_name(spec.dtype), shape, bytes: bytes.len(), digest: Digest::of(bytes) }
}
