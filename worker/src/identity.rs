//! The layout identity of a rank: everything that determines which bytes its kernels must
//! see, hashed, so ranks, load paths and versions can be compared by one value.

use orchestrator_kernels::{Digest, ScaleRule};
use orchestrator_model::{Geometry, RankShard, WeightFormat};
use serde::{Deserialize, Serialize};

/// Bumped whenever the pipeline's output for the same input changes.
pub const LAYOUT_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct LayoutIdentity {
    pub layout_version: u32,
    pub geometry: Geometry,
    pub tp_size: usize,
    pub rank: usize,
    /// `fp8[32x32]` or `bf16`: the checkpoint's storage format.
    pub weight_format: String,
    pub scale_rule: String,
    /// Kernel-visible dtypes: weights, linear-hook scales, packed `wo_a` scales, `attn_sink`.
    pub kernel_dtypes: [String; 4],
    /// XXH3-64 of the canonical text of all fields above.
    pub digest: String,
}

impl LayoutIdentity {
    pub fn new(geometry: &Geometry, shard: &RankShard, format: WeightFormat, rule: ScaleRule) -> Self {
        let weight_format = match format {
            WeightFormat::Fp8 { block: [a, b] } => format!("fp8[{a}x{b}]"),
            WeightFormat::Bf16 => "bf16".to_string(),
        };
        let kernel_dtypes = ["F8_E4M3", "F8_E8M0", "I32", "F32"].map(String::from);
        let mut id = Self {
            layout_version: LAYOUT_VERSION,
            geometry: geometry.clone(),
            tp_size: shard.tp_size,
            rank: shard.rank,
            weight_format,
            scale_rule: rule.name().to_string(),
            kernel_dtypes,
            digest: String::new(),
        };
        id.digest = Digest::of(id.canonical_text().as_bytes()).hex();
        id
    }

    /// The text the digest covers: one `key=value` per line, in a fixed order.
    pub fn canonical_text(&self) -> String {
        let g = &self.geometry;
        format!(
            "layout_version={}\nhidden={}\nlayers={}\nheads={}\nkv_heads={}\nhead_dim={}\nrope_dim={}\nq_lora_rank={}\no_lora_rank={}\no_groups={}\ntp_size={}\nrank={}\nweight_format={}\nscale_rule={}\nkernel_dtypes={}\n",
            self.layout_version,
            g.hidden,
            g.layers,
            g.heads,
            g.kv_heads,
            g.head_dim,
            g.rope_dim,
            g.q_lora_rank,
            g.o_lora_rank,
            g.o_groups,
            self.tp_size,
            self.rank,
            self.weight_format,
            self.scale_rule,
            self.kernel_dtypes.join(",")
        )
    }
}
