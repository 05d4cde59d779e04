//! FUSE node ids and `st_ino` for btrfs inodes, which are (tree, objectid) pairs.
//!
//! The mapping is fixed, so an inode keeps its number across lookups, forgets and
//! remounts, and two subvolumes' inodes never share one: the low `INO_BITS` bits hold
//! the objectid, the bits above hold the tree (0 for the top-level tree 5, `id - 255`
//! for subvolume `id` >= 256). FUSE's root, node id 1, is the mounted directory; no
//! btrfs inode has objectid 1, so no other inode maps there, and its `st_ino` is its
//! encoded number like any other's.
//!
//! FUSE has one `st_dev` per mount, so subvolumes cannot show their own device numbers
//! as they do on a kernel mount; the unique numbers stand in for that (hard-link and
//! cycle detection in tar, du, find and rsync key on (st_dev, st_ino)).

use ubtrfs_core::{Error, InodeId, PosixKind, Result};

/// Objectid bits: up to 2^44 inodes per tree.
pub const INO_BITS: u32 = 44;
/// The top-level tree (FS_TREE).
const FS_TREE: u64 = 5;
/// The first subvolume id (BTRFS_FIRST_FREE_OBJECTID).
const FIRST_SUBVOL: u64 = 256;
/// Trees that fit above the objectid bits: 2^20 - 1 subvolumes.
const MAX_TREE_SLOT: u64 = (1 << (64 - INO_BITS)) - 1;

/// A FUSE node id (the number the kernel names an inode by).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FuseIno(pub u64);

impl FuseIno {
    pub const ROOT: FuseIno = FuseIno(1);
}

/// The mapping for one mount, whose root directory is `top`.
#[derive(Clone, Copy, Debug)]
pub struct InoMap {
    pub top: InodeId,
}

impl InoMap {
    /// The number inode `id` is known by: its node id, and its `st_ino` (the mount's
    /// root is node id 1, but its `st_ino` is `encode(top)`).
    ///
    /// # Errors
    /// `Posix(Range)` (EOVERFLOW would be the kernel's) for a tree or objectid past
    /// the bits the numbering has.
    pub fn encode(id: InodeId) -> Result<u64> {
        let slot = match id.root {
            FS_TREE => 0,
            r if r >= FIRST_SUBVOL && r - (FIRST_SUBVOL - 1) <= MAX_TREE_SLOT => {
                r - (FIRST_SUBVOL - 1)
            }
            _ => {
                return Err(Error::posix_detail(
                    PosixKind::Range,
                    id.to_string(),
                    "tree id past what FUSE inode numbers can carry",
                ))
            }
        };
        if id.ino >> INO_BITS != 0 || id.ino < 2 {
            return Err(Error::posix_detail(
                PosixKind::Range,
                id.to_string(),
                "objectid past what FUSE inode numbers can carry",
            ));
        }
        Ok((slot << INO_BITS) | id.ino)
    }

    /// Inverse of `encode`.
    fn decode(n: u64) -> Option<InodeId> {
        let (slot, ino) = (n >> INO_BITS, n & ((1 << INO_BITS) - 1));
        if ino < 2 {
            return None;
        }
        let root = if slot == 0 { FS_TREE } else { slot + (FIRST_SUBVOL - 1) };
        Some(InodeId { root, ino })
    }

    /// The node id the kernel is given for `id`.
    ///
    /// # Errors
    /// As `encode`.
    pub fn to_fuse(&self, id: InodeId) -> Result<FuseIno> {
        if id == self.top {
            return Ok(FuseIno::ROOT);
        }
        let n = Self::encode(id)?;
        debug_assert_ne!(n, FuseIno::ROOT.0, "node id 1 is the mount's root alone");
        Ok(FuseIno(n))
    }

    /// The inode the kernel names by node id `n`.
    ///
    /// # Errors
    /// `Posix(NotFound)` for a number no inode maps to (the kernel never sends one).
    pub fn from_fuse(&self, n: FuseIno) -> Result<InodeId> {
        if n == FuseIno::ROOT {
            return Ok(self.top);
        }
        Self::decode(n.0).ok_or_else(|| {
            Error::posix_detail(
                PosixKind::NotFound,
                format!("node id {}", n.0),
                "no inode has this FUSE number",
            )
        })
    }
}

/// Node ids for placeholders: the empty directories the kernel shows where a snapshot
/// holds the entry of a subvolume it does not contain. They all are inode
/// `InodeId::placeholder(tree)` of their tree (the kernel too gives each objectid 2),
/// but the kernel's dentry cache allows a directory inode one name only, so each
/// placeholder entry (tree, directory, subvolume) gets a node id of its own. These come
/// from the objectids 3 to 255 of each tree slot, which no inode has (inodes start at
/// BTRFS_FIRST_FREE_OBJECTID, 256), so they never meet `InoMap::encode`'s numbers; they
/// are handed out in order and kept for the mount's life (an entry keeps its number).
#[derive(Default)]
pub struct Placeholders {
    inner: std::sync::Mutex<PlaceholderTable>,
}

#[derive(Default)]
struct PlaceholderTable {
    by_entry: std::collections::HashMap<(u64, u64, u64), u64>,
    /// The directory each number's entry is in.
    dir_of: std::collections::HashMap<u64, InodeId>,
}

/// Node ids per tree slot for placeholders: objectids 3..=255.
const PLACEHOLDERS_PER_SLOT: u64 = 253;

impl Placeholders {
    /// Whether node id `n` is one `node` hands out.
    pub fn is_placeholder_number(n: u64) -> bool {
        let ino = n & ((1 << INO_BITS) - 1);
        (3..FIRST_SUBVOL).contains(&ino)
    }

    /// The node id of the placeholder entry in directory `dir` for subvolume `subvol`.
    ///
    /// # Errors
    /// `Posix(Range)` once every number is taken (2^20 x 253 placeholders).
    pub fn node(&self, dir: InodeId, subvol: u64) -> Result<FuseIno> {
        let mut t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&n) = t.by_entry.get(&(dir.root, dir.ino, subvol)) {
            return Ok(FuseIno(n));
        }
        let k = t.by_entry.len() as u64;
        let slot = k / PLACEHOLDERS_PER_SLOT;
        if slot > MAX_TREE_SLOT {
            return Err(Error::posix_detail(
                PosixKind::Range,
                format!("{dir} subvolume {subvol}"),
                "no FUSE number left for another subvolume placeholder",
            ));
        }
        let n = (slot << INO_BITS) | (3 + k % PLACEHOLDERS_PER_SLOT);
        debug_assert!(Self::is_placeholder_number(n), "{n:#x}");
        t.by_entry.insert((dir.root, dir.ino, subvol), n);
        t.dir_of.insert(n, dir);
        Ok(FuseIno(n))
    }

    /// The placeholder inode node id `n` names.
    ///
    /// # Errors
    /// `Posix(NotFound)` for a number never handed out.
    pub fn id(&self, n: FuseIno) -> Result<InodeId> {
        Ok(InodeId::placeholder(self.parent(n)?.root))
    }

    /// The directory holding the placeholder entry node id `n` names (its `..`).
    ///
    /// # Errors
    /// `Posix(NotFound)` for a number never handed out: also every placeholder's
    /// number from before a remount, as the numbers are handed out anew.
    pub fn parent(&self, n: FuseIno) -> Result<InodeId> {
        let t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        t.dir_of.get(&n.0).copied().ok_or_else(|| {
            Error::posix_detail(
                PosixKind::NotFound,
                format!("node id {}", n.0),
                "no placeholder has this FUSE number",
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_round_trip_and_never_collide() {
        let m = InoMap { top: InodeId { root: 5, ino: 256 } };
        let ids = [
            InodeId { root: 5, ino: 257 },
            InodeId { root: 256, ino: 256 },
            InodeId { root: 256, ino: 257 },
            InodeId { root: 300, ino: 256 },
            InodeId { root: 5, ino: (1 << 44) - 1 },
            InodeId { root: 256 + (1 << 20) - 2, ino: 258 },
        ];
        let mut seen = std::collections::HashSet::new();
        for id in ids {
            let f = m.to_fuse(id).unwrap();
            assert_ne!(f, FuseIno::ROOT, "{id}");
            assert!(seen.insert(f), "{id} collides");
            assert_eq!(m.from_fuse(f).unwrap(), id);
        }
        assert_eq!(m.to_fuse(m.top).unwrap(), FuseIno::ROOT);
        assert_eq!(m.from_fuse(FuseIno::ROOT).unwrap(), m.top);
        // The top's own st_ino is its encoded number, not 1.
        assert_eq!(InoMap::encode(m.top).unwrap(), 256);
        assert_eq!(InoMap::encode(InodeId { root: 257, ino: 256 }).unwrap(), (2 << 44) | 256);
    }

    #[test]
    fn placeholders_get_numbers_of_their_own() {
        let p = Placeholders::default();
        let m = InoMap { top: InodeId { root: 5, ino: 256 } };
        let a = p.node(InodeId { root: 258, ino: 256 }, 256).unwrap();
        let b = p.node(InodeId { root: 258, ino: 256 }, 257).unwrap();
        let c = p.node(InodeId { root: 259, ino: 300 }, 256).unwrap();
        assert_eq!(
            p.node(InodeId { root: 258, ino: 256 }, 256).unwrap(),
            a,
            "an entry keeps its number"
        );
        assert!(a != b && b != c && a != c);
        for n in [a, b, c] {
            assert!(Placeholders::is_placeholder_number(n.0));
            assert_ne!(n, FuseIno::ROOT);
        }
        assert_eq!(p.id(a).unwrap(), InodeId::placeholder(258));
        assert_eq!(p.id(c).unwrap(), InodeId::placeholder(259));
        assert_eq!(p.parent(b).unwrap(), InodeId { root: 258, ino: 256 });
        assert_eq!(p.parent(c).unwrap(), InodeId { root: 259, ino: 300 });
        // No inode's number is a placeholder's.
        for id in [
            InodeId { root: 5, ino: 256 },
            InodeId { root: 258, ino: 257 },
            InodeId { root: 300, ino: (1 << 44) - 1 },
        ] {
            assert!(!Placeholders::is_placeholder_number(m.to_fuse(id).unwrap().0), "{id}");
        }
        // Past the first slot's 253 numbers, the next slot's.
        for d in 0..300 {
            let n = p.node(InodeId { root: 5, ino: 1000 + d }, 256).unwrap();
            assert!(Placeholders::is_placeholder_number(n.0));
        }
        assert!(p.id(FuseIno(3 + 252 + (5 << 44))).is_err());
        assert!(p.parent(FuseIno(3 + 252 + (5 << 44))).is_err());
    }

    #[test]
    fn numbers_past_the_bits_are_refused() {
        let m = InoMap { top: InodeId { root: 5, ino: 256 } };
        for id in [
            InodeId { root: 5, ino: 1 << 44 },
            InodeId { root: 7, ino: 256 },
            InodeId { root: 256 + (1 << 20) - 1, ino: 256 },
        ] {
            let e = m.to_fuse(id).unwrap_err();
            assert_eq!(e.posix_kind(), Some(PosixKind::Range), "{id}: {e}");
        }
        assert!(m.from_fuse(FuseIno(0)).is_err());
        assert!(m.from_fuse(FuseIno(1 << 44)).is_err());
    }
}
