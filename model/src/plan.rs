//! The tensor-parallel shard plan (spec section 4): which rows and columns of each checkpoint
//! tensor one rank holds, and the validation that mega attention allows the TP size.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::ModelError;
use crate::geometry::{Geometry, HEADS_PER_GROUP};
use crate::limits;

/// Checks that a TP size gives every rank whole heads and groups, with `n_local_heads % 8 == 0`
/// and 8 heads per local group (mega attention's requirement).
pub fn validate_tp(geometry: &Geometry, tp: usize) -> Result<(), ModelError> {
    let err = |why: String| Err(ModelError::TpSize { tp, why });
    if tp == 0 {
        return err("TP size must be at least 1".to_string());
    }
    if tp > limits::MAX_TP {
        return err(format!("over the limit of {} (limits::MAX_TP)", limits::MAX_TP));
    }
    if geometry.o_groups == 0 || geometry.heads == 0 {
        return err(format!("the geometry has {} heads in {} o_groups", geometry.heads, geometry.o_groups));
    }
    if !geometry.heads.is_multiple_of(tp) {
        return err(format!("{tp} ranks do not split {} heads evenly", geometry.heads));
    }
    let local_heads = geometry.heads / tp;
    if !local_heads.is_multiple_of(HEADS_PER_GROUP) {
        return err(format!(
            "TP {tp} leaves {local_heads} heads per rank; mega attention needs {HEADS_PER_GROUP} per group \
             (valid TP sizes for {} heads: {})",
            geometry.heads,
            valid_tp_sizes(geometry).iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    if !geometry.o_groups.is_multiple_of(tp) {
        return err(format!("{tp} ranks do not split {} o_groups evenly", geometry.o_groups));
    }
    let local_groups = geometry.o_groups / tp;
    if local_heads / local_groups != HEADS_PER_GROUP {
        return err(format!(
            "TP {tp} gives {local_heads} heads over {local_groups} groups; mega attention needs {HEADS_PER_GROUP} heads per group"
        ));
    }
    Ok(())
}

/// Every TP size this geometry allows. Only candidates up to `min(o_groups, MAX_TP)` are
/// tried (a valid TP size splits the groups), so an absurd geometry costs no more than a real one.
pub fn valid_tp_sizes(geometry: &Geometry) -> Vec<usize> {
    (1..=geometry.o_groups.min(limits::MAX_TP))
        .filter(|&t| {
            geometry.o_groups >= t
                && geometry.heads.is_multiple_of(t)
                && (geometry.heads / t).is_multiple_of(HEADS_PER_GROUP)
                && geometry.o_groups.is_multiple_of(t)
                && (geometry.heads / t) / (geometry.o_groups / t) == HEADS_PER_GROUP
        })
        .collect()
}

/// What one rank of a TP group holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankShard {
    pub tp_size: usize,
    pub rank: usize,
    pub n_local_heads: usize,
    pub n_local_groups: usize,
}

impl RankShard {
    pub fn new(geometry: &Geometry, tp_size: usize, rank: usize) -> Result<Self, ModelError> {
        validate_tp(geometry, tp_size)?;
        if rank >= tp_size {
            return Err(ModelError::TpSize { tp: tp_size, why: format!("rank {rank} is outside 0..{tp_size}") });
        }
        Ok(Self { tp_size, rank, n_local_heads: geometry.heads / tp_size, n_local_groups: geometry.o_groups / tp_size })
    }

    /// The rank's heads (also its `attn_sink` entries).
    pub fn heads(&self) -> Range<usize> {
        self.rank * self.n_local_heads..(self.rank + 1) * self.n_local_heads
    }
    /// The rank's `wq_b` rows: its heads times head_dim.
    pub fn wq_b_rows(&self, g: &Geometry) -> Range<usize> {
        let h = self.heads();
        h.start * g.head_dim..h.end * g.head_dim
    }
    /// The rank's `wo_a` rows: its groups times o_lora_rank.
    pub fn wo_a_rows(&self, g: &Geometry) -> Range<usize> {
        let n = self.n_local_groups * g.o_lora_rank;
        self.rank * n..(self.rank + 1) * n
    }
    /// The rank's `wo_b` columns (row-parallel): the same range as its `wo_a` rows.
    pub fn wo_b_cols(&self, g: &Geometry) -> Range<usize> {
        self.wo_a_rows(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Preset;

    #[test]
    fn tp_sizes_of_64_heads() {
        let g = Preset::Dsv41Flash.geometry();
        assert_eq!(valid_tp_sizes(&g), vec![1, 2, 4, 8]);
        for t in [1, 2, 4, 8] {
            validate_tp(&g, t).unwrap();
        }
        let err = validate_tp(&g, 16).unwrap_err().to_string();
        assert!(err.contains("leaves 4 heads per rank; mega attention needs 8 per group"), "{err}");
        assert!(matches!(validate_tp(&g, 3), Err(ModelError::TpSize { tp: 3, .. })));
        assert!(matches!(validate_tp(&g, 0), Err(ModelError::TpSize { tp: 0, .. })));
        assert_eq!(valid_tp_sizes(&Preset::Dsv4Pro.geometry()), vec![1, 2, 4, 8, 16]);
        let no_groups = Geometry { o_groups: 0, ..g };
        assert!(matches!(validate_tp(&no_groups, 1), Err(ModelError::TpSize { .. })));
        assert!(valid_tp_sizes(&no_groups).is_empty());
        assert!(matches!(validate_tp(&g, limits::MAX_TP + 1), Err(ModelError::TpSize { .. })));
        assert!(matches!(validate_tp(&g, usize::MAX), Err(ModelError::TpSize { .. })));
    }

    #[test]
    fn absurd_geometries_cost_nothing() {
        // Unvalidated geometries straight from a caller: no loop up to `heads`, no overflow.
        let start = std::time::Instant::now();
        for heads in [8usize << 34, 8 << 58, usize::MAX] {
            let g = Geometry { heads, o_groups: heads / 8, ..Preset::Dsv41Flash.geometry() };
            let sizes = valid_tp_sizes(&g);
            assert!(sizes.iter().all(|&t| t <= limits::MAX_TP), "{sizes:?}");
            assert!(matches!(g.validate(None), Err(ModelError::Geometry { field: "num_attention_heads", .. })));
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn rank_ranges() {
        let g = Preset::Dsv41Flash.geometry();
        let s = RankShard::new(&g, 4, 1).unwrap();
        assert_eq!(s.n_local_heads, 16);
        assert_eq!(s.n_local_groups, 2);
        assert_eq!(s.heads(), 16..32);
        assert_eq!(s.wq_b_rows(&g), 8192..16384);
        assert_eq!(s.wo_a_rows(&g), 2048..4096);
        assert_eq!(s.wo_b_cols(&g), 2048..4096);
        assert!(RankShard::new(&g, 4, 4).is_err());
    }
}
