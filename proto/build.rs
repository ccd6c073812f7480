//! Compiles `orchestrator.proto` with protox (pure Rust, no protoc) and generates the tonic
//! client and server code from the descriptor set; the encoded set is kept for gRPC reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=orchestrator.proto");
    let fds = protox::compile(["orchestrator.proto"], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("orchestrator_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
