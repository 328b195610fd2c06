//! Fake `nvidia-smi`; see `cleave_fakes::nvidia_smi`.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    std::process::exit(cleave_fakes::nvidia_smi::run(&args));
}
