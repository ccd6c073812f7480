//! Attention geometry of the DeepSeek-V4 family (spec section 2) and its validation.

use serde::{Deserialize, Serialize};

use crate::ModelError;
use crate::limits;

/// The dims mega attention's layouts are defined by.
pub const HEAD_DIM: usize = 512;
pub const HEADS_PER_GROUP: usize = 8;
pub const ROPE_DIM: usize = 64;

/// The attention geometry of one model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Geometry {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_lora_rank: usize,
    pub o_groups: usize,
}

/// How weights are stored in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// E4M3 weights with UE8M0 block scales of `[rows, cols]` elements.
    Fp8 { block: [usize; 2] },
    /// BF16 weights, no scales (a trainer's export).
    Bf16,
}

impl WeightFormat {
    /// The FP8 block size, if any.
    pub fn block(&self) -> Option<[usize; 2]> {
        match *self {
            WeightFormat::Fp8 { block } => Some(block),
            WeightFormat::Bf16 => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            WeightFormat::Fp8 { .. } => "fp8",
            WeightFormat::Bf16 => "bf16",
        }
    }
}

/// Which config layout the model family uses (V4.1 nests fields under `text_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    V41,
    V4,
}

/// A named geometry with its family's FP8 block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// DeepSeek-V4.1-Flash.
    Dsv41Flash,
    /// DeepSeek-V4-Flash.
    Dsv4Flash,
    /// DeepSeek-V4-Pro.
    Dsv4Pro,
    /// V4.1 layouts at test size: 64 heads / 8 groups (TP 1..8 valid), small ranks and hidden.
    Tiny,
}

impl Preset {
    pub const ALL: [Preset; 4] = [Preset::Dsv41Flash, Preset::Dsv4Flash, Preset::Dsv4Pro, Preset::Tiny];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Dsv41Flash => "dsv41-flash",
            Preset::Dsv4Flash => "dsv4-flash",
            Preset::Dsv4Pro => "dsv4-pro",
            Preset::Tiny => "tiny",
        }
    }

    pub fn family(self) -> Family {
        match self {
            Preset::Dsv41Flash | Preset::Tiny => Family::V41,
            Preset::Dsv4Flash | Preset::Dsv4Pro => Family::V4,
        }
    }

    /// The FP8 checkpoint block size of the family: 32x32 for V4.1, 128x128 for V4.
    pub fn fp8_block(self) -> [usize; 2] {
        match self.family() {
            Family::V41 => [32, 32],
            Family::V4 => [128, 128],
        }
    }

    pub fn geometry(self) -> Geometry {
        let g = |hidden, layers, heads, q_lora_rank, o_groups| Geometry {
            hidden,
            layers,
            heads,
            kv_heads: 1,
            head_dim: HEAD_DIM,
            rope_dim: ROPE_DIM,
            q_lora_rank,
            o_lora_rank: 1024,
            o_groups,
        };
        match self {
            Preset::Dsv41Flash => g(5120, 40, 64, 1280, 8),
            Preset::Dsv4Flash => g(4096, 43, 64, 1024, 8),
            Preset::Dsv4Pro => g(7168, 61, 128, 1536, 16),
            Preset::Tiny => Geometry { o_lora_rank: 64, ..g(256, 2, 64, 64, 8) },
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, ModelError> {
        Preset::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| ModelError::UnknownPreset {
            name: s.to_string(),
            known: Preset::ALL.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
        })
    }
}

impl Geometry {
    /// Heads per `wo_a` group.
    pub fn heads_per_group(&self) -> usize {
        self.heads / self.o_groups.max(1)
    }
    /// `wq_b` rows: `heads * head_dim`.
    pub fn q_rows(&self) -> usize {
        self.heads * self.head_dim
    }
    /// `wo_a` columns: one group's heads times head_dim.
    pub fn o_cols(&self) -> usize {
        HEADS_PER_GROUP * self.head_dim
    }
    /// `wo_a` rows and `wo_b` columns: `o_groups * o_lora_rank`.
    pub fn o_rows(&self) -> usize {
        self.o_groups * self.o_lora_rank
    }

    /// Checks that mega attention's layouts are defined for this geometry (independent of TP).
    ///
    /// Every field is first checked against its limit in [`crate::limits`] (so nothing sized
    /// by the geometry is allocated or iterated for an absurd one), then the layout rules, then
    /// every tensor's byte size and the checkpoint's in-scope total are formed with checked
    /// arithmetic.
    pub fn validate(&self, block: Option<[usize; 2]>) -> Result<(), ModelError> {
        let bad = |field: &'static str, why: String| Err(ModelError::Geometry { field, why });
        for (field, v, limit, name) in [
            ("num_hidden_layers", self.layers, limits::MAX_LAYERS, "MAX_LAYERS"),
            ("num_attention_heads", self.heads, limits::MAX_HEADS, "MAX_HEADS"),
            ("o_groups", self.o_groups, limits::MAX_O_GROUPS, "MAX_O_GROUPS"),
            ("hidden_size", self.hidden, limits::MAX_HIDDEN, "MAX_HIDDEN"),
            ("q_lora_rank", self.q_lora_rank, limits::MAX_LORA_RANK, "MAX_LORA_RANK"),
            ("o_lora_rank", self.o_lora_rank, limits::MAX_LORA_RANK, "MAX_LORA_RANK"),
        ] {
            if v > limit {
                return bad(field, format!("is {v}, over the limit of {limit} (limits::{name})"));
            }
        }
        if self.head_dim != HEAD_DIM {
            return bad("head_dim", format!("is {}, mega attention's layouts need {HEAD_DIM}", self.head_dim));
        }
        if self.rope_dim != ROPE_DIM {
            return bad("qk_rope_head_dim", format!("is {}, expected {ROPE_DIM}", self.rope_dim));
        }
        if self.kv_heads != 1 {
            return bad("num_key_value_heads", format!("is {}, DeepSeek-V4 attention is MQA (1)", self.kv_heads));
        }
        if self.o_groups == 0 || self.heads == 0 || !self.heads.is_multiple_of(self.o_groups) {
            return bad("o_groups", format!("{} groups do not divide {} heads", self.o_groups, self.heads));
        }
        if self.heads_per_group() != HEADS_PER_GROUP {
            return bad(
                "o_groups",
                format!(
                    "{} heads / {} groups = {} heads per group; mega attention needs {HEADS_PER_GROUP}",
                    self.heads,
                    self.o_groups,
                    self.heads_per_group()
                ),
            );
        }
        for (field, v) in [("hidden_size", self.hidden), ("q_lora_rank", self.q_lora_rank), ("o_lora_rank", self.o_lora_rank)] {
            if v == 0 || v % 32 != 0 {
                return bad(field, format!("is {v}, must be a positive multiple of 32 (MXFP8 blocks)"));
            }
        }
        if self.layers == 0 {
            return bad("num_hidden_layers", "is 0".to_string());
        }
        if let Some([bm, bk]) = block {
            if bm == 0 || bk == 0 || bm % 32 != 0 || bk % 32 != 0 {
                return Err(ModelError::Quantization(format!("weight_block_size [{bm}, {bk}] must be multiples of 32")));
            }
            if bm > limits::MAX_BLOCK || bk > limits::MAX_BLOCK {
                return Err(ModelError::Quantization(format!(
                    "weight_block_size [{bm}, {bk}] is over the limit of {} (limits::MAX_BLOCK)",
                    limits::MAX_BLOCK
                )));
            }
            for (what, rows, cols) in
                [("wq_b", self.q_rows(), self.q_lora_rank), ("wo_a", self.o_rows(), self.o_cols()), ("wo_b", self.hidden, self.o_rows())]
            {
                if rows % bm != 0 || cols % bk != 0 {
                    return Err(ModelError::Quantization(format!(
                        "{what} [{rows}, {cols}] is not tiled by weight_block_size [{bm}, {bk}]"
                    )));
                }
            }
        }
        self.checked_in_scope_bytes().map(|_| ())
    }

    /// An upper bound of the checkpoint's in-scope bytes (every matrix counted at BF16's 2
    /// bytes per element, which is more than E4M3 plus its scales), formed with checked
    /// arithmetic: `Geometry { field: "geometry", .. }` when a product overflows.
    pub fn checked_in_scope_bytes(&self) -> Result<usize, ModelError> {
        let overflow = |e: limits::LimitError| ModelError::Geometry { field: "geometry", why: e.to_string() };
        let q_rows = limits::mul("wq_b rows (heads * head_dim)", self.heads, self.head_dim).map_err(overflow)?;
        let o_rows = limits::mul("wo_a rows (o_groups * o_lora_rank)", self.o_groups, self.o_lora_rank).map_err(overflow)?;
        let o_cols = limits::mul("wo_a columns", HEADS_PER_GROUP, self.head_dim).map_err(overflow)?;
        let mut layer = 0usize;
        for (what, rows, cols) in
            [("wq_b bytes", q_rows, self.q_lora_rank), ("wo_a bytes", o_rows, o_cols), ("wo_b bytes", self.hidden, o_rows)]
        {
            // BF16: 2 bytes per element (E4M3 is 1, and its scales are 1/1024 of that).
            let bytes = limits::mul(what, limits::mul(what, rows, cols).map_err(overflow)?, 2).map_err(overflow)?;
            layer = layer.checked_add(bytes).ok_or_else(|| overflow(limits::LimitError::Overflow { what, detail: "sum".into() }))?;
        }
        let sink = limits::mul("attn_sink bytes", self.heads, 4).map_err(overflow)?;
        let layer =
            layer.checked_add(sink).ok_or_else(|| ModelError::Geometry { field: "geometry", why: "layer bytes overflow".into() })?;
        limits::mul("in-scope checkpoint bytes", layer, self.layers).map_err(overflow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_spec_table() {
        let f = Preset::Dsv41Flash.geometry();
        assert_eq!((f.hidden, f.layers, f.heads, f.q_lora_rank, f.o_lora_rank, f.o_groups), (5120, 40, 64, 1280, 1024, 8));
        assert_eq!((f.q_rows(), f.o_rows(), f.o_cols()), (32768, 8192, 4096));
        let v4 = Preset::Dsv4Flash.geometry();
        assert_eq!((v4.hidden, v4.layers, v4.heads, v4.q_lora_rank), (4096, 43, 64, 1024));
        let pro = Preset::Dsv4Pro.geometry();
        assert_eq!((pro.hidden, pro.layers, pro.heads, pro.q_lora_rank, pro.o_groups), (7168, 61, 128, 1536, 16));
        for p in Preset::ALL {
            p.geometry().validate(Some(p.fp8_block())).unwrap();
            assert_eq!(p.geometry().heads_per_group(), 8);
            assert_eq!(p.name().parse::<Preset>().unwrap(), p);
        }
        assert!("dsv5".parse::<Preset>().is_err());
    }

    #[test]
    fn rejects_geometry_without_mega_attention_layouts() {
        let mut g = Preset::Tiny.geometry();
        g.head_dim = 256;
        assert!(matches!(g.validate(None), Err(ModelError::Geometry { field: "head_dim", .. })));
        let mut g = Preset::Tiny.geometry();
        g.o_groups = 16;
        assert!(matches!(g.validate(None), Err(ModelError::Geometry { field: "o_groups", .. })));
    }
}
