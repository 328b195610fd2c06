//! Compiles the kubelet plugin protos with protox (a pure-Rust protobuf parser, so no
//! system `protoc` is needed) and generates prost messages plus tonic servers and clients.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: [&str; 5] = [
        "pluginregistration.proto",
        "dra/v1.proto",
        "dra/v1beta1.proto",
        "health/v1alpha1.proto",
        "health/v1.proto",
    ];
    let fds = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
