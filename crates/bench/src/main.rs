//! `ubtrfs-bench`: measurements that compare ubtrfs with a baseline in one run.
fn main() {
    eprintln!("ubtrfs-bench: no benchmarks yet");
    std::process::exit(2);
}
