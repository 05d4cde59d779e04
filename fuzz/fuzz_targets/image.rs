#![no_main]
//! Whole-image open + walk of the `mixed` fixture with the input's byte patches laid
//! over its tree blocks and superblock (checksums fixed up). See
//! `ubtrfs_fuzz::targets::image`.

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use ubtrfs_fuzz::targets::{image, ImageBase};

static BASE: OnceLock<ImageBase> = OnceLock::new();

fuzz_target!(|data: &[u8]| image(BASE.get_or_init(|| ImageBase::from_fixture("mixed")), data));
