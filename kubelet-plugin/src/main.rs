//! cleave's kubelet plugin binary; see [`cleave_kubelet_plugin::cli`].

fn main() -> std::process::ExitCode {
    // `demo` runs this binary as its fake NVIDIA tools (hidden, never in --help).
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = cleave_kubelet_plugin::demo::play_fake_tool(&args) {
        return code;
    }
    cleave_kubelet_plugin::cli::main()
}
