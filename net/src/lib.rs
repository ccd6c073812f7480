//! What the coordinator and the workers share on the wire, apart from the protocol itself
//! (`orchestrator-proto`): the cluster's shared token and the interceptor that checks it
//! ([`auth`]), TLS files, endpoints and certificate generation, and the formatting of a failed
//! call's status ([`tls`]), and the standard gRPC server pieces: health and reflection beside the
//! service, accepted connections without Nagle's delay, the shutdown signal ([`grpc`]).

pub mod auth;
pub mod grpc;
pub mod tls;
