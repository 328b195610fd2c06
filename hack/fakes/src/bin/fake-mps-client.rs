//! Fake CUDA client of an MPS control daemon; see `cleave_fakes::mps_control`.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    std::process::exit(cleave_fakes::mps_control::client_main(&args));
}
