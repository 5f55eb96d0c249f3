//! Compiles the trimmed Envoy RLS v3 protos and emits the file descriptor set
//! that gRPC reflection serves. protoc comes from $PROTOC when set, else from
//! protoc-bin-vendored, so a fresh machine needs no system protoc.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY-free: build scripts are single-threaded; set_var is only unsafe on
        // edition 2024, and this crate is edition 2021.
        std::env::set_var("PROTOC", protoc);
    }
    let vendored_include = protoc_bin_vendored::include_path()?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // Without the `server` feature only the messages are generated, so the
    // core builds without tonic.
    let services = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    tonic_prost_build::configure()
        .build_server(services)
        .build_client(services)
        .file_descriptor_set_path(out_dir.join("rls_descriptor.bin"))
        .compile_protos(
            &[PathBuf::from("proto/envoy/service/ratelimit/v3/rls.proto")],
            &[PathBuf::from("proto"), vendored_include],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
