//! The [`Collective`] of GPU workers: the probe's all-reduce over NCCL (without the `cuda`
//! feature, the kernels crate's dummy `cuda` module makes every call an error). Rank 0 of a TP
//! group creates the unique id ([`NcclCollective::unique_id`]), the coordinator relays it, and
//! every rank joins on the thread that owns its GPU. The result is the same rank-order sum as
//! every other [`Collective`] (an NCCL all-gather, then the sum on the host), bit-identical on
//! every rank; every call has a deadline, and a dead peer is an error, never a hang.

use std::time::Duration;

use orchestrator_kernels::cuda::CudaBackend;
use orchestrator_kernels::cuda::nccl::{self, NcclComm};

use crate::collective::{Collective, CollectiveError};

/// The default deadline of joining and of each all-reduce.
pub const DEFAULT_NCCL_TIMEOUT: Duration = Duration::from_secs(30);

/// One rank of a TP group on NCCL.
pub struct NcclCollective {
    comm: NcclComm,
    timeout: Duration,
}

fn device(e: orchestrator_kernels::KernelError) -> CollectiveError {
    CollectiveError::Device { reason: e.to_string() }
}

impl NcclCollective {
    /// A new unique id for a group (created by its rank 0).
    pub fn unique_id() -> Result<Vec<u8>, CollectiveError> {
        nccl::unique_id().map_err(device)
    }

    /// Joins group `id` as `rank` of `world` on `backend`'s GPU; `timeout` bounds the join and
    /// every later all-reduce.
    pub fn join(backend: &CudaBackend, id: &[u8], rank: usize, world: usize, timeout: Duration) -> Result<Self, CollectiveError> {
        if world == 0 || rank >= world {
            return Err(CollectiveError::InvalidGroup { reason: format!("rank {rank} is outside a group of {world}") });
        }
        Ok(Self { comm: NcclComm::join(backend, id, rank, world, timeout).map_err(device)?, timeout })
    }
}

impl Collective for NcclCollective {
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let n = data.len();
        let gathered = self.comm.all_gather_f32(data, self.timeout).map_err(device)?;
        if gathered.len() != n * self.comm.world_size() {
            return Err(CollectiveError::Device { reason: format!("all-gather returned {} values for {n} per rank", gathered.len()) });
        }
        // y = d_0 + d_1 + ... in rank order, exactly as the trait defines it.
        let mut parts = gathered.chunks_exact(n.max(1));
        if let Some(first) = parts.next() {
            data.copy_from_slice(first);
            for part in parts {
                for (a, b) in data.iter_mut().zip(part) {
                    *a += b;
                }
            }
        }
        Ok(())
    }
}
