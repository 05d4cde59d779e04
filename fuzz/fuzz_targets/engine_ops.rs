#![no_main]
//! Random operations through the engine on a fuzzed copy of the `blake2` fixture
//! (open for writing, change, commit, reopen, walk). See
//! `ubtrfs_fuzz::targets::engine_ops`.

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use ubtrfs_fuzz::targets::{engine_ops, ImageBase};

static BASE: OnceLock<ImageBase> = OnceLock::new();

fuzz_target!(|data: &[u8]| engine_ops(
    BASE.get_or_init(|| ImageBase::from_fixture("blake2")),
    data
));
