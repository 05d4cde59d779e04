//! `info`: a one-screen summary of a filesystem: identity, geometry, features, devices
//! (from the chunk tree's DEV_ITEMs), the default subvolume, whether a log tree waits
//! for replay, and usage per block-group type and profile like `btrfs filesystem df`.
//!
//! Every section is printed even when another fails; the first failure is returned at
//! the end so the exit status still says something was wrong.

use crate::ImageArgs;
use std::io::{self, BufWriter, Write};
use ubtrfs_core::{Error, FsInfo, Result, TreeView};
use ubtrfs_format::features::{
    flag_names, COMPAT_RO_NAMES, INCOMPAT_METADATA_UUID, INCOMPAT_NAMES,
};
use ubtrfs_format::hash::name_hash;
use ubtrfs_format::items::{self, read_prefix, uuid_str};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

fn out_err(e: io::Error) -> Error {
    Error::io("stdout", e)
}

/// Print the summary of the filesystem in `a`.
///
/// # Errors
/// Opening errors, stdout errors, and (after printing the rest) the first error met
/// reading the device list, the default subvolume or the block groups.
pub fn run(a: &ImageArgs) -> Result<()> {
    let fs = a.open_raw()?;
    let mut o = BufWriter::new(io::stdout().lock());
    let r = print_info(&fs, &mut o);
    o.flush().map_err(out_err)?;
    drop(o);
    crate::print_warnings(&fs);
    r
}

/// `1.50MiB`: binary units with two decimals, like `btrfs filesystem df`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    let mut div = 1u64;
    while unit + 1 < UNITS.len() && n / div >= 1024 {
        div *= 1024;
        unit += 1;
    }
    format!("{:.2}{}", n as f64 / div as f64, UNITS[unit])
}

fn feature_line(bits: u64, table: &[(u64, &str)]) -> String {
    let names = flag_names(bits, table);
    if names.is_empty() {
        format!("{bits:#x}")
    } else {
        format!("{bits:#x} ({names})")
    }
}

fn print_info(fs: &FsInfo, o: &mut dyn Write) -> Result<()> {
    let mut first_err: Option<Error> = None;
    let sb = fs.super_copy();
    let w = |o: &mut dyn Write, name: &str, value: String| {
        writeln!(o, "{:<20}{value}", format!("{name}:")).map_err(out_err)
    };
    let label_len = sb.label.iter().position(|&b| b == 0).unwrap_or(LABEL_SIZE);
    w(o, "label", ubtrfs_core::quote::name(&sb.label[..label_len]).into_owned())?;
    w(o, "fsid", uuid_str(&sb.fsid))?;
    if sb.incompat_flags.get() & INCOMPAT_METADATA_UUID != 0 && sb.metadata_uuid != sb.fsid {
        w(o, "metadata uuid", uuid_str(&sb.metadata_uuid))?;
    }
    w(o, "generation", sb.generation.get().to_string())?;
    w(o, "sectorsize", fs.sectorsize.to_string())?;
    w(o, "nodesize", fs.nodesize.to_string())?;
    w(o, "csum type", fs.csum_type.name().to_string())?;
    w(o, "incompat flags", feature_line(sb.incompat_flags.get(), INCOMPAT_NAMES))?;
    w(o, "compat_ro flags", feature_line(sb.compat_ro_flags.get(), COMPAT_RO_NAMES))?;
    if sb.compat_flags.get() != 0 {
        w(o, "compat flags", feature_line(sb.compat_flags.get(), &[]))?;
    }
    w(o, "total bytes", format!("{} ({})", sb.total_bytes.get(), human(sb.total_bytes.get())))?;
    w(o, "bytes used", format!("{} ({})", sb.bytes_used.get(), human(sb.bytes_used.get())))?;
    match default_subvol(fs) {
        Ok(id) => w(o, "default subvolume", id.to_string())?,
        Err(e) => {
            w(o, "default subvolume", format!("unknown ({e})"))?;
            first_err.get_or_insert(e);
        }
    }
    let log = match fs.log_root() {
        Some(r) => format!(
            "present (log_root {} level {}), not replayed: showing the last commit",
            r.bytenr, r.level
        ),
        None => "none".to_string(),
    };
    w(o, "log tree", log)?;
    if let Some(why) = &fs.read_only_reason {
        w(o, "read-only", why.clone())?;
    }
    if let Some(r) = fs.dev_replace.as_ref().filter(|r| r.is_ongoing()) {
        let target = fs
            .devices
            .replace_target
            .as_ref()
            .map(|t| t.dev.name().to_string())
            .unwrap_or_else(|| "<not given>".to_string());
        w(o, "device replace", format!("{}; target devid 0 path {target}", r.refusal()))?;
    }
    w(o, "devices", sb.num_devices.get().to_string())?;
    match dev_items(fs) {
        Ok(devs) => {
            for d in devs {
                let devid = d.devid.get();
                let path = fs
                    .devices
                    .by_id
                    .get(&devid)
                    .map(|dev| dev.dev.name().to_string())
                    .unwrap_or_else(|| "<missing>".to_string());
                writeln!(
                    o,
                    "\tdevid {devid} size {} used {} path {path}",
                    human(d.total_bytes.get()),
                    human(d.bytes_used.get())
                )
                .map_err(out_err)?;
            }
        }
        Err(e) => {
            writeln!(o, "\terror: cannot list devices: {e}").map_err(out_err)?;
            first_err.get_or_insert(e);
        }
    }
    writeln!(o).map_err(out_err)?;
    match fs.space_info() {
        Ok(spaces) => {
            for s in spaces {
                writeln!(
                    o,
                    "{}: total={}, used={}",
                    block_group_flags_str(s.flags),
                    human(s.total),
                    human(s.used)
                )
                .map_err(out_err)?;
            }
        }
        Err(e) => {
            writeln!(o, "error: cannot read block groups: {e}").map_err(out_err)?;
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The DEV_ITEMs of the chunk tree, by devid.
fn dev_items(fs: &FsInfo) -> Result<Vec<DevItem>> {
    let mut out = Vec::new();
    let mut it = fs.iter(&fs.chunk_root(), Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0))?;
    while let Some(item) = it.next_item()? {
        let k = item.key();
        if k.objectid != DEV_ITEMS_OBJECTID || k.type_ != DEV_ITEM_KEY {
            break;
        }
        let d: &DevItem = read_prefix(item.data(), "dev item").map_err(|r| {
            ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, r)
                .root(CHUNK_TREE_OBJECTID)
                .block(item.eb.bytenr)
                .slot(item.slot as u32, k)
        })?;
        out.push(*d);
    }
    Ok(out)
}

/// The subvolume mounted by default: the "default" dir item of the root tree's
/// directory (objectid 6) points at it; without one it is the fs tree.
fn default_subvol(fs: &FsInfo) -> Result<u64> {
    const NAME: &[u8] = b"default";
    let key = Key::new(ROOT_TREE_DIR_OBJECTID, DIR_ITEM_KEY, name_hash(NAME));
    let Some(path) = fs.search_slot(&fs.tree_root(), &key)?.into_found() else {
        return Ok(FS_TREE_OBJECTID);
    };
    let Some(item) = path.item() else { return Ok(FS_TREE_OBJECTID) };
    for e in items::dir_entries(item.data()) {
        // Validated by the tree checker when the leaf was read.
        let Ok(e) = e else { break };
        if e.name == NAME {
            return Ok(e.location.objectid);
        }
    }
    Ok(FS_TREE_OBJECTID)
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0.00B");
        assert_eq!(human(1023), "1023.00B");
        assert_eq!(human(1024), "1.00KiB");
        assert_eq!(human(8 << 20), "8.00MiB");
        assert_eq!(human(1536 << 20), "1.50GiB");
        assert_eq!(human(u64::MAX), "16.00EiB");
    }
}
