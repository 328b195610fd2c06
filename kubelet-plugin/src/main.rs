//! cleave's kubelet plugin binary; see [`cleave_kubelet_plugin::main`].

fn main() -> std::process::ExitCode {
    cleave_kubelet_plugin::main()
}
