#![no_main]
//! Random operations through the engine on a fuzzed copy of the `blake2` fixture
//! (open for writing, change, commit, reopen, walk). See
//! `ubtrfs_fuzz::targets::engine_ops`.

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use ubtrfs_fuzz::targets::{engine_ops, ImageBase};

static BASE: OnceLock<ImageBase> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let base = BASE.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/blake2.0.img.zst");
        let z = std::fs::read(path).unwrap_or_else(|e| panic!("fuzz setup: {path}: {e}"));
        let mut dec = zstd::stream::read::Decoder::new(&z[..]).expect("fuzz setup: zstd");
        dec.window_log_max(31).expect("fuzz setup: zstd window");
        let mut img = Vec::new();
        std::io::Read::read_to_end(&mut dec, &mut img).expect("fuzz setup: decompress the fixture");
        ImageBase::new(img, "blake2").expect("fuzz setup: the pristine fixture opens")
    });
    engine_ops(base, data);
});
