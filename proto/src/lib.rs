//! The gRPC contract of orchestrator (`orchestrator.proto`), generated at build time with
//! protox and tonic-prost-build.

#![allow(clippy::all, clippy::pedantic)]

/// Bumped whenever the contract's meaning changes; workers and the coordinator must agree.
pub const PROTOCOL_VERSION: u32 = 3;

pub mod limits;

pub mod v1 {
    tonic::include_proto!("orchestrator.v1");

    /// The encoded file descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/orchestrator_descriptor.bin"));
}
