//! `cleave-cdi-hook`: the OCI `createContainer` hook cleave's CDI specs name (symlinks, the
//! container's ld cache, CUDA forward compatibility, device-node modification). The plugin
//! copies this file onto the host at start; all of it is in the `cleave-cdi-hook` library.

fn main() -> std::process::ExitCode {
    cleave_cdi_hook::main()
}
