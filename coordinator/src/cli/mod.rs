//! The CLI's commands, one module per command family (moving here from `main.rs` as they are
//! touched).

pub mod bench;
pub mod launch;
pub mod load;
pub mod manifest;
