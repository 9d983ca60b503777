//! Compiles the wire API in `proto/` with protox (no system `protoc`) and
//! writes the encoded descriptor set that server reflection serves.

use std::{env, fs, path::PathBuf};

use anyhow::Context;
use prost::Message;

const PROTOS: &[&str] = &["envoy/service/ratelimit/v3/rls.proto"];

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(PROTOS, ["proto"]).context("compiling proto/")?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out.join("rls_descriptor.bin"), fds.encode_to_vec())
        .context("writing the reflection descriptor set")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .context("generating Rust code for proto/")?;
    Ok(())
}
