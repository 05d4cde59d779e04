#![no_main]
//! `check_tree_block` over arbitrary blocks (checksum fixed up), then every `NodeRef`
//! accessor and item parser on what it accepts. See `ubtrfs_fuzz::targets::tree_block`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ubtrfs_fuzz::targets::tree_block(data);
});
