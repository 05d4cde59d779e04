//! `ubtrfs-bench`: measurements that compare ubtrfs with a baseline in one run. One
//! subcommand per benchmark (a module of the `ubtrfs_bench` library); each has a `--tiny`
//! form for quick checks, which `cargo test` also runs.

use clap::{Parser, Subcommand};
use ubtrfs_bench::seed000;

#[derive(Parser)]
#[command(
    name = "ubtrfs-bench",
    about = "reproducible ubtrfs measurements against their baselines"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Seed 000: front steal by forward walk (kernel before the patch) vs backward word
    /// scan, on a ~1M-extent delete + commit + 4 GiB write
    Seed000 {
        /// Scaled-down run (a few MiB of file, under 2 s)
        #[arg(long)]
        tiny: bool,
        /// Bitmap size of the main comparison (32768: 4 KiB pages, 131072: 16 KiB pages)
        #[arg(long, default_value_t = 131072)]
        bits: u32,
        /// Skip the per-call steal measurements (at 32768 and 131072 bits)
        #[arg(long)]
        no_per_call: bool,
        /// Allocation size of the write phase, in bytes
        #[arg(long, default_value_t = 1 << 20)]
        write_request: u64,
        /// Seed of the fragmenting pattern
        #[arg(long, default_value_t = 0x5eed_0000)]
        seed: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Seed000 { tiny, bits, no_per_call, write_request, seed } => {
            let tune = |mut c: seed000::Config| {
                c.write_request = write_request;
                c.seed = seed;
                c
            };
            let main =
                tune(if tiny { seed000::Config::tiny(bits) } else { seed000::Config::full(bits) });
            let percall: Vec<seed000::Config> = if no_per_call {
                Vec::new()
            } else {
                [32768, 131072]
                    .into_iter()
                    .map(|b| {
                        tune(if tiny {
                            seed000::Config::tiny(b)
                        } else {
                            seed000::Config::per_call(b)
                        })
                    })
                    .collect()
            };
            seed000::report(&main, &percall)
        }
    };
    if let Err(e) = result {
        eprintln!("ubtrfs-bench: {e}");
        std::process::exit(1);
    }
}
