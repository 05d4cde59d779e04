//! The free-space tree's FREE_SPACE_INFO and FREE_SPACE_BITMAP items.

use super::{aligned, exact, read_prefix, CheckResult, ItemCtx};
use crate::key::*;
use crate::structs::*;

/// As check_free_space_info.
pub(crate) fn check_free_space_info(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    if !aligned(key.objectid, ctx.sectorsize) || !aligned(key.offset, ctx.sectorsize) {
        return Err(format!("free space info key is not aligned to {}, has {key}", ctx.sectorsize));
    }
    exact::<FreeSpaceInfo>(data, "free space info")?;
    let f: &FreeSpaceInfo = read_prefix(data, "free space info")?;
    if f.flags.get() & !FREE_SPACE_USING_BITMAPS != 0 {
        return Err(format!(
            "unknown flags for free space info, has {:#x} valid mask {FREE_SPACE_USING_BITMAPS:#x}",
            f.flags.get()
        ));
    }
    let max = key.offset / u64::from(ctx.sectorsize);
    if u64::from(f.extent_count.get()) > max {
        return Err(format!(
            "suspicious extent count, has {} max valid {max}",
            f.extent_count.get()
        ));
    }
    Ok(())
}

/// The kernel has no rule for the free-space tree's bitmaps; kept: a bitmap holds one bit
/// per sector of its range (what the readers index).
pub(crate) fn check_free_space_bitmap(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    let bits = key.offset / u64::from(ctx.sectorsize);
    let want = bits.div_ceil(8);
    if key.offset == 0 || !aligned(key.offset, ctx.sectorsize) || data.len() as u64 != want {
        return Err(format!(
            "invalid free space bitmap item size {}, expect {want} for length {}",
            data.len(),
            key.offset
        ));
    }
    Ok(())
}
