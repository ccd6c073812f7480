//! Checkpoint tensor names and specs (spec section 3) and kernel parameter names.

use safetensors::Dtype;

use crate::geometry::{Geometry, WeightFormat};

/// The attention parameters this project loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    WqB,
    WoA,
    WoB,
    AttnSink,
}

impl Param {
    pub const ALL: [Param; 4] = [Param::WqB, Param::WoA, Param::WoB, Param::AttnSink];

    pub fn short(self) -> &'static str {
        match self {
            Param::WqB => "wq_b",
            Param::WoA => "wo_a",
            Param::WoB => "wo_b",
            Param::AttnSink => "attn_sink",
        }
    }
}

/// Which part of a parameter a checkpoint tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    Weight,
    Scale,
}

/// Checkpoint name: `layers.{i}.attn.wq_b.weight`, `layers.{i}.attn.wq_b.scale`,
/// `layers.{i}.attn.attn_sink`.
pub fn checkpoint_name(layer: usize, param: Param, part: Part) -> String {
    match (param, part) {
        (Param::AttnSink, _) => format!("layers.{layer}.attn.attn_sink"),
        (p, Part::Weight) => format!("layers.{layer}.attn.{}.weight", p.short()),
        (p, Part::Scale) => format!("layers.{layer}.attn.{}.scale", p.short()),
    }
}

/// Kernel-visible parameter name: `layers.{i}.attn.wq_b.weight`, `..weight_scale`,
/// `layers.{i}.attn.attn_sink`.
pub fn kernel_name(layer: usize, param: Param, part: Part) -> String {
    match (param, part) {
        (Param::AttnSink, _) => format!("layers.{layer}.attn.attn_sink"),
        (p, Part::Weight) => format!("layers.{layer}.attn.{}.weight", p.short()),
        (p, Part::Scale) => format!("layers.{layer}.attn.{}.weight_scale", p.short()),
    }
}

/// What a checkpoint tensor must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub layer: usize,
    pub param: Param,
    pub part: Part,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn element_bytes(&self) -> usize {
        self.dtype.bitsize() / 8
    }
    pub fn bytes(&self) -> usize {
        self.elements() * self.element_bytes()
    }
    /// Rows of the row-major view (all dims but the last; 1 for a 1-D tensor).
    pub fn rows(&self) -> usize {
        self.shape[..self.shape.len().saturating_sub(1)].iter().product()
    }
    /// Row length in elements (last dim; 1 for scalars).
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
}

/// The in-scope tensors of one layer, in a fixed order.
pub fn layer_tensors(g: &Geometry, format: WeightFormat, layer: usize) -> Vec<TensorSpec> {
    let spec =
        |param, part, dtype, shape: Vec<usize>| TensorSpec { name: checkpoint_name(layer, param, part), layer, param, part, dtype, shape };
    let mut out = Vec::with_capacity(7);
    let matrices = [(Param::WqB, g.q_rows(), g.q_lora_rank), (Param::WoA, g.o_rows(), g.o_cols()), (Param::WoB, g.hidden, g.o_rows())];
    for (param, rows, cols) in matrices {
        match format {
            WeightFormat::Fp8 { block: [bm, bk] } => {
                out.push(spec(param, Part::Weight, Dtype::F8_E4M3, vec![rows, cols]));
                out.push(spec(param, Part::Scale, Dtype::F8_E8M0, vec![rows / bm, cols / bk]));
            }
            WeightFormat::Bf16 => out.push(spec(param, Part::Weight, Dtype::BF16, vec![rows, cols])),
        }
    }
    out.push(spec(Param::AttnSink, Part::Weight, Dtype::F32, vec![g.heads]));
    out
}

/// The in-scope tensors of every layer.
pub fn checkpoint_tensors(g: &Geometry, format: WeightFormat) -> Vec<TensorSpec> {
    (0..g.layers).flat_map(|l| layer_tensors(g, format, l)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Preset;

    #[test]
    fn v41_flash_names_and_shapes() {
        let g = Preset::Dsv41Flash.geometry();
        let t = layer_tensors(&g, WeightFormat::Fp8 { block: [32, 32] }, 3);
        let got: Vec<(&str, Dtype, &[usize])> = t.iter().map(|s| (s.name.as_str(), s.dtype, s.shape.as_slice())).collect();
        assert_eq!(
            got,
            vec![
                ("layers.3.attn.wq_b.weight", Dtype::F8_E4M3, &[32768, 1280][..]),
                ("layers.3.attn.wq_b.scale", Dtype::F8_E8M0, &[1024, 40][..]),
                ("layers.3.attn.wo_a.weight", Dtype::F8_E4M3, &[8192, 4096][..]),
                ("layers.3.attn.wo_a.scale", Dtype::F8_E8M0, &[256, 128][..]),
                ("layers.3.attn.wo_b.weight", Dtype::F8_E4M3, &[5120, 8192][..]),
                ("layers.3.attn.wo_b.scale", Dtype::F8_E8M0, &[160, 256][..]),
                ("layers.3.attn.attn_sink", Dtype::F32, &[64][..]),
            ]
        );
        assert_eq!(kernel_name(3, Param::WqB, Part::Scale), "layers.3.attn.wq_b.weight_scale");
    }
}
