//! The probe's yardstick, read from the checkpoint: one layer of a rank in checkpoint order on
//! the host (E4M3 elements with per-row scales, the attention sink), never permuted or hooked,
//! so the reference it feeds stays independent of every kernel layout. FP8 weights are the
//! stored bytes (in place in the file's mapping where the rank's slice is whole rows); BF16 is
//! quantized with the loader's rule through the load's own source stage.

use std::ops::Range;
use std::sync::Arc;

use orchestrator_kernels::Backend;
use orchestrator_kernels::params::{CheckpointOrder, Mx, WqB};
use orchestrator_model::checkpoint::Shard;
use orchestrator_model::names::{checkpoint_name, layer_tensors};
use orchestrator_model::{Param, Part, TensorSpec, WeightFormat};

use crate::loader::{LayerScratch, LoadError, RankLoader, StageTimes, param_slot, tensor_error};
use crate::source::{Fetched, LoadSource};

/// One layer of a rank in checkpoint order, on the host: what the probe's reference reads.
#[derive(Default)]
pub struct ReferenceLayer {
    /// `(E4M3 elements, per-row scales)` of `wq_b [heads*512, q_lora]`.
    pub wq_b: (ReferenceBytes, Vec<u8>),
    /// `wo_a [groups*o_lora, 4096]`.
    pub wo_a: (ReferenceBytes, Vec<u8>),
    /// `wo_b [hidden, groups*o_lora]`.
    pub wo_b: (ReferenceBytes, Vec<u8>),
    pub attn_sink: Vec<f32>,
}

/// The E4M3 bytes of one reference weight: where they lie in the checkpoint's mapping (an FP8
/// slice of whole rows), or copied out (a slice of some columns, a generated checkpoint, BF16
/// quantized). Equal when the bytes are.
pub enum ReferenceBytes {
    Mapped { shard: Arc<Shard>, range: Range<usize> },
    Owned(Vec<u8>),
}

impl ReferenceBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            ReferenceBytes::Mapped { shard, range } => shard.slice(range.clone()),
            ReferenceBytes::Owned(v) => v,
        }
    }

    /// Whether the bytes are read where they lie in the checkpoint's mapping.
    pub fn is_mapped(&self) -> bool {
        matches!(self, ReferenceBytes::Mapped { .. })
    }

    /// The copied-out buffer, to refill (empty when the bytes were mapped).
    fn take_owned(&mut self) -> Vec<u8> {
        match std::mem::take(self) {
            ReferenceBytes::Owned(v) => v,
            ReferenceBytes::Mapped { .. } => Vec::new(),
        }
    }
}

impl Default for ReferenceBytes {
    fn default() -> Self {
        ReferenceBytes::Owned(Vec::new())
    }
}

impl PartialEq for ReferenceBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// What a reference reuses from one layer to the next ([`RankLoader::reference_layer_into`]).
pub struct ReferenceScratch<B: Backend> {
    scratch: LayerScratch<B>,
    layer: ReferenceLayer,
}

impl<B: Backend> Default for ReferenceScratch<B> {
    fn default() -> Self {
        Self::reusing(ReferenceLayer::default())
    }
}

impl<B: Backend> ReferenceScratch<B> {
    /// A scratch that copies out into `kept`'s buffers (see [`ReferenceScratch::into_kept`]).
    pub fn reusing(kept: ReferenceLayer) -> Self {
        Self { scratch: LayerScratch::default(), layer: kept }
    }

    /// The host buffers a later reference reuses ([`ReferenceScratch::reusing`]): a weight slice
    /// copied out of the checkpoint (some columns of whole rows) then lands in memory already
    /// faulted in rather than in fresh pages, which cost more than the copy where the kernel
    /// zeroes each one on first touch. Mapped bytes are let go (no checkpoint mapping is held).
    pub fn into_kept(self) -> ReferenceLayer {
        let mut layer = self.layer;
        for (w, _) in [&mut layer.wq_b, &mut layer.wo_a, &mut layer.wo_b] {
            *w = ReferenceBytes::Owned(w.take_owned());
        }
        layer
    }
}

impl<B: Backend + Sync> RankLoader<'_, B> {
    /// The rank's layer in checkpoint order (FP8 scales expanded per row, BF16 quantized with
    /// this loader's rule), read through the same source stage as a load, but never permuted
    /// or hooked: the yardstick of the probe.
    pub fn reference_layer(&self, source: &LoadSource, layer: usize) -> Result<ReferenceLayer, LoadError> {
        let mut scratch = ReferenceScratch::default();
        self.reference_layer_into(source, layer, &mut scratch)?;
        Ok(scratch.layer)
    }

    /// [`RankLoader::reference_layer`] into buffers kept from the previous layer: a reference
    /// over every layer faults in one layer's memory instead of every layer's.
    pub fn reference_layer_into<'s>(
        &self,
        source: &LoadSource,
        layer: usize,
        into: &'s mut ReferenceScratch<B>,
    ) -> Result<&'s ReferenceLayer, LoadError> {
        self.check_source(source)?;
        let specs = layer_tensors(&self.geometry, self.format, layer);
        let find = |param, part| specs.iter().find(|s| s.param == param && s.part == part);
        let ReferenceScratch { scratch, layer: out } = into;
        for (param, slot) in [(Param::WqB, &mut out.wq_b), (Param::WoA, &mut out.wo_a), (Param::WoB, &mut out.wo_b)] {
            match self.format {
                WeightFormat::Fp8 { block } => self.reference_fp8(source, &find, param, block, &mut scratch.host_scale, slot)?,
                WeightFormat::Bf16 => self.reference_quantized(source, &find, layer, param, scratch, slot)?,
            }
        }
        let spec = find(Param::AttnSink, Part::Weight).expect("every layer has attn_sink");
        let (rows, cols) = self.slice_of(spec);
        let bytes = &mut scratch.host_weight[param_slot(Param::AttnSink)];
        source.read(spec, rows, cols, bytes)?;
        out.attn_sink.clear();
        out.attn_sink.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        Ok(out)
    }

    /// One BF16 weight of a reference layer: read through the load's source stage and quantized
    /// with this loader's rule, in checkpoint order (never permuted or hooked, so the parameter
    /// marker of the matrix does not matter), then copied to the host.
    fn reference_quantized<'s>(
        &self,
        source: &LoadSource,
        find: &impl Fn(Param, Part) -> Option<&'s TensorSpec>,
        layer: usize,
        param: Param,
        scratch: &mut LayerScratch<B>,
        (w, s): &mut (ReferenceBytes, Vec<u8>),
    ) -> Result<(), LoadError> {
        let (backend, rule) = (self.backend(), self.rule());
        let (mut digests, mut times) = (Vec::new(), StageTimes::default());
        let (mx, _): (Mx<B, WqB, CheckpointOrder>, _) =
            self.read_matrix(source, param, find, scratch, &mut digests, &mut Vec::new(), &mut times, |src, rows, k, pool| {
                Mx::from_source(backend, src, rows, k, rule, pool)
            })?;
        let mut bytes = w.take_owned();
        let copied = mx.to_host_into(backend, &mut bytes, s);
        *w = ReferenceBytes::Owned(bytes);
        mx.recycle(&mut scratch.pools[param_slot(param)]);
        copied.map_err(|e| tensor_error(&checkpoint_name(layer, param, Part::Weight), None, e))
    }

    /// One FP8 weight of a reference layer: its E4M3 bytes as stored, where they lie in the
    /// file's mapping when the slice is whole rows (else copied once), and its block scales
    /// expanded to per-row MXFP8 scales. The load these weights are compared with has checked
    /// the same bytes for NaN; a NaN byte here would only make the reference disagree.
    fn reference_fp8<'s>(
        &self,
        source: &LoadSource,
        find: &impl Fn(Param, Part) -> Option<&'s TensorSpec>,
        param: Param,
        block: [usize; 2],
        block_scale: &mut Vec<u8>,
        (w, s): &mut (ReferenceBytes, Vec<u8>),
    ) -> Result<(), LoadError> {
        let wspec = find(param, Part::Weight).expect("every layer has the weight");
        let (rows, cols) = self.slice_of(wspec);
        let (n_rows, k) = (rows.len(), cols.len());
        let mut staging = w.take_owned();
        *w = match source.fetch(wspec, rows, cols, &mut staging)? {
            Fetched::Mapped { shard, range } => ReferenceBytes::Mapped { shard, range },
            Fetched::Staged { .. } => ReferenceBytes::Owned(staging),
        };
        let sspec = find(param, Part::Scale).expect("FP8 layers have scales");
        let (srows, scols) = self.slice_of(sspec);
        let file = source.read(sspec, srows, scols, block_scale)?;
        orchestrator_kernels::backend::expand_block_scales(block_scale, n_rows, k, block, s).map_err(|e| tensor_error(&sspec.name, file, e))
    }
}
