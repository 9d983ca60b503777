//! Compiles the wire API in `proto/` with protox (no system `protoc`) and writes the encoded descriptor
//! set that server reflection serves.
//!
//! Two sets: the services ratelimitd serves (the rate limit service and the rate limit quota service),
//! which reflection describes; and the xDS
//! discovery service with the rules it carries, which ratelimitd only calls (its server side is
//! generated for the tests' control plane), so reflection does not list it.

use std::{env, fs, path::PathBuf};

use anyhow::Context;
use prost::Message;

/// What ratelimitd serves.
const SERVED: &[&str] = &[
    "envoy/service/ratelimit/v3/rls.proto",
    "envoy/service/rate_limit_quota/v3/rlqs.proto",
];

/// What ratelimitd calls: rules over xDS.
const CALLED: &[&str] = &[
    "envoy/service/discovery/v3/ads.proto",
    "ratelimit/config/ratelimit/v3/rls_conf.proto",
];

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-changed=proto");
    let served = protox::compile(SERVED, ["proto"]).context("compiling proto/")?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out.join("rls_descriptor.bin"), served.encode_to_vec())
        .context("writing the reflection descriptor set")?;
    let all =
        protox::compile(SERVED.iter().chain(CALLED), ["proto"]).context("compiling proto/")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(all)
        .context("generating Rust code for proto/")?;
    Ok(())
}
