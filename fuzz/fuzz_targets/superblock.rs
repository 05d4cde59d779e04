#![no_main]
//! `check_super` and `sys_chunk_array` over arbitrary 4096-byte superblocks (checksum
//! fixed up unless the control byte says not to). See `ubtrfs_fuzz::targets::superblock`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ubtrfs_fuzz::targets::superblock(data);
});
