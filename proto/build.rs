//! Compiles zds.proto with protox (pure Rust, no system `protoc`) and
//! generates the message types with prost.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=zds.proto");
    let descriptors = protox::compile(["zds.proto"], ["."])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
