//! Path lookup for the write path: resolve `/a/b/c` in the image as the running
//! transaction sees it, crossing into subvolumes where a directory entry names one.
//! Symlinks are not followed (the write commands operate on the names themselves).

use crate::error::{Error, PosixKind, Result};
use crate::transaction::FsWriter;
use ubtrfs_format::hash::name_hash;
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::FT_DIR;
use ubtrfs_format::Key;

/// An inode as the write path names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ino {
    pub root: u64,
    pub ino: u64,
}

impl FsWriter {
    /// The default subvolume (root tree dir item "default"), else 5.
    ///
    /// # Errors
    /// Read failures.
    pub fn default_subvol(&mut self) -> Result<u64> {
        let key = Key::new(ROOT_TREE_DIR_OBJECTID, DIR_ITEM_KEY, name_hash(b"default"));
        let r = self.root(ROOT_TREE_OBJECTID)?;
        if let Some((k, d)) = self.first_item_ge(&r, &key)? {
            if k == key {
                for e in items::dir_entries(&d) {
                    let e = e.expect("validated by the tree checker");
                    if e.name == b"default" && e.location.type_ == ROOT_ITEM_KEY {
                        return Ok(e.location.objectid);
                    }
                }
            }
        }
        Ok(FS_TREE_OBJECTID)
    }

    /// The top directory of subvolume `root`.
    ///
    /// # Errors
    /// `Posix(NotFound)` for an unknown subvolume.
    pub fn subvol_top(&mut self, root: u64) -> Result<Ino> {
        self.root(root)?;
        let dirid = self.roots.get(&root).and_then(|s| s.item).map(|i| i.root_dirid.get()).unwrap_or(FIRST_FREE_OBJECTID);
        Ok(Ino { root, ino: if dirid == 0 { FIRST_FREE_OBJECTID } else { dirid } })
    }

    /// Resolve `path` from the default subvolume's top directory.
    ///
    /// # Errors
    /// `Posix` NotFound / NotDir naming the path.
    pub fn resolve_path(&mut self, path: &str) -> Result<Ino> {
        let def = self.default_subvol()?;
        let mut cur = self.subvol_top(def)?;
        let comps: Vec<&[u8]> = path.as_bytes().split(|&b| b == b'/').filter(|c| !c.is_empty() && *c != b".").collect();
        for (i, c) in comps.iter().enumerate() {
            if *c == b".." {
                return Err(Error::posix(PosixKind::Invalid, format!("{}: '..' is not supported in image paths", crate::quote::name(path.as_bytes()))));
            }
            let Some((target, ftype, is_subvol)) = self.lookup_name(cur.root, cur.ino, c)? else {
                return Err(Error::posix(PosixKind::NotFound, crate::quote::name(path.as_bytes())));
            };
            if i + 1 < comps.len() && ftype != FT_DIR {
                return Err(Error::posix(PosixKind::NotDir, crate::quote::name(path.as_bytes())));
            }
            cur = if is_subvol { self.subvol_top(target)? } else { Ino { root: cur.root, ino: target } };
        }
        Ok(cur)
    }

    /// Split `path` into (parent directory, last name); the parent must exist.
    ///
    /// # Errors
    /// `Posix` Invalid for the top itself, NotFound / NotDir for the parent.
    pub fn resolve_parent(&mut self, path: &str) -> Result<(Ino, Vec<u8>)> {
        let trimmed = path.trim_end_matches('/');
        let (dir, name) = match trimmed.rfind('/') {
            Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
            None => ("", trimmed),
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(Error::posix(PosixKind::Invalid, format!("{}: needs a name inside a directory", crate::quote::name(path.as_bytes()))));
        }
        let parent = self.resolve_path(dir)?;
        let ii = self.inode_item(parent.root, parent.ino)?;
        if ii.mode.get() & ubtrfs_format::structs::S_IFMT != ubtrfs_format::structs::S_IFDIR {
            return Err(Error::posix(PosixKind::NotDir, dir.to_string()));
        }
        Ok((parent, name.as_bytes().to_vec()))
    }
}
