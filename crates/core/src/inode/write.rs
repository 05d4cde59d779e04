//! Inode and name items: create inodes, link and unlink names (DIR_ITEM + DIR_INDEX +
//! INODE_REF/EXTREF, directory sizes, link counts), update INODE_ITEMs (the in-memory
//! inode follows), drop and insert file extent items with exact reference and `nbytes`
//! accounting (`drop_extents`, inline items, holes), and remove inodes with everything
//! they own. The file data path over these is `data::write`.
//!
//! Invariants kept per change: a file's nlink equals its names; a directory's size is
//! twice the sum of its entries' name lengths; nbytes is the sum of non-hole regular
//! extent lengths plus inline lengths.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;
use ubtrfs_format::hash::{extref_hash, name_hash};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

/// Where a new INODE_REF entry goes (`add_inode_ref`).
pub(crate) enum RefRoom {
    /// The first name in this directory: a new INODE_REF item.
    New,
    /// Appended to the directory's INODE_REF item.
    Extend,
    /// That item is full: an INODE_EXTREF.
    Extref,
    /// That item is full and there are no extrefs: EMLINK.
    Full,
}

pub use crate::mapping::MAX_EXTENT_SIZE;

/// The kernel's default `max_inline`.
pub const MAX_INLINE: u64 = 2048;

/// What a change does to an inode, for the immutable / append-only rules.
#[derive(Clone, Copy)]
pub(crate) enum IflagOp {
    AddName,
    RemoveName,
    Relink,
    Write,
}

/// The kernel's rules for immutable (`chattr +i`) and append-only (`chattr +a`)
/// inodes: `what` on inode `id` is refused with EPERM when its flags forbid it.
/// `name` is the entry being changed, for the message.
pub(crate) fn iflags_allow(id: InodeId, flags: u64, what: IflagOp, name: &[u8]) -> Result<()> {
    let (forbid, desc) = match what {
        // Creating or removing a name changes the directory.
        IflagOp::AddName => (INODE_IMMUTABLE, "immutable directory"),
        IflagOp::RemoveName => {
            (INODE_IMMUTABLE | INODE_APPEND, "immutable or append-only directory")
        }
        // A name of this inode is added or removed.
        IflagOp::Relink => (INODE_IMMUTABLE | INODE_APPEND, "immutable or append-only inode"),
        // fs-verity: fsverity_file_open refuses writers and fsverity_prepare_setattr a
        // new size (EPERM); the Merkle tree would go stale.
        IflagOp::Write if flags & INODE_RO_VERITY != 0 => {
            (INODE_RO_VERITY, "fs-verity file, whose data cannot change")
        }
        IflagOp::Write => (INODE_IMMUTABLE, "immutable file"),
    };
    if flags & forbid != 0 {
        let name = crate::quote::name(name);
        let target = match what {
            IflagOp::AddName | IflagOp::RemoveName => {
                format!("{name}: its directory ({id}) is an {desc}")
            }
            IflagOp::Relink => format!("{name} ({id}) is an {desc}"),
            IflagOp::Write => format!("{id} is an {desc}"),
        };
        return Err(Error::posix(PosixKind::NotPermitted, target));
    }
    Ok(())
}

/// The mode a write, truncation or fallocate by a caller without CAP_FSETID leaves
/// (`should_remove_suid`): set-user-ID goes; set-group-ID goes when the group may
/// execute, and without group execute (it then marks mandatory locking) when the caller
/// is outside the file's group `gid` (`setattr_should_drop_sgid`; `in_group` answers
/// for the caller, and is asked only then).
pub fn mode_without_privs(mode: u32, gid: u32, in_group: &dyn Fn(u32) -> bool) -> u32 {
    let mut m = mode & !0o4000;
    if m & 0o2000 != 0 && (m & 0o010 != 0 || !in_group(gid)) {
        m &= !0o2000;
    }
    m
}

/// Flags a new inode takes from its directory's flags `d`, as the kernel's
/// `btrfs_inherit_iflags`: compression preference, and NODATACOW (with NODATASUM for
/// regular files).
pub(crate) fn inherited_flags(d: u64, regular: bool) -> u64 {
    let mut f = 0;
    if d & INODE_NOCOMPRESS != 0 {
        f |= INODE_NOCOMPRESS;
    } else if d & INODE_COMPRESS != 0 {
        f |= INODE_COMPRESS;
    }
    if d & INODE_NODATACOW != 0 {
        f |= INODE_NODATACOW;
        if regular {
            f |= INODE_NODATASUM;
        }
    }
    f
}

/// Items a new name adds or changes: DIR_ITEM, DIR_INDEX, INODE_REF, both inodes.
pub(crate) const LINK_ITEMS: u64 = 5;

/// The kernel's most links an inode can have (BTRFS_LINK_MAX).
pub const LINK_MAX: u32 = 65535;

/// The largest an INODE_REF item may grow to: a whole leaf's data area less its item
/// header (BTRFS_MAX_ITEM_SIZE), past which the kernel's extension fails (EOVERFLOW)
/// and the name goes to an INODE_EXTREF, or is EMLINK without extrefs. Measured
/// against the kernel to the name by `tests/namespace.rs`.
fn max_ref_item(nodesize: u32) -> usize {
    nodesize as usize - ubtrfs_format::node::HEADER_SIZE - ubtrfs_format::node::ITEM_SIZE
}

/// Attributes of a new inode.
#[derive(Clone, Copy, Debug)]
pub struct InodeAttrs {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    /// (seconds, nanoseconds); None = now.
    pub atime: Option<(i64, u32)>,
    pub mtime: Option<(i64, u32)>,
    /// Inode flags (INODE_*); `mkdir` and `create_file` add what the directory passes
    /// on (compression preference, NODATACOW).
    pub flags: u64,
}

impl InodeAttrs {
    pub fn new(mode: u32) -> InodeAttrs {
        InodeAttrs { mode, uid: 0, gid: 0, rdev: 0, atime: None, mtime: None, flags: 0 }
    }
}

impl FsWriter {
    /// The largest file kept in an uncompressed inline extent: the kernel's
    /// `max_inline`, at most half a leaf, and below a sector.
    pub(crate) fn max_inline(&self) -> u64 {
        MAX_INLINE.min(u64::from(self.nodesize()) / 2).min(u64::from(self.sectorsize()) - 1)
    }

    /// The current time from the engine's clock (`OpenOptions::sources`).
    pub fn now(&self) -> Timespec {
        timespec(self.info.sources.clock.now())
    }

    /// `t`, or `dflt` when it is None.
    pub(crate) fn time_or(t: Option<(i64, u32)>, dflt: Timespec) -> Timespec {
        t.map_or(dflt, |(s, n)| Timespec { sec: (s as u64).into(), nsec: n.into() })
    }
}

/// A clock reading as an inode's timestamp (btrfs stores the seconds' bits unsigned).
pub(crate) fn timespec(t: crate::sources::Time) -> Timespec {
    Timespec { sec: (t.sec as u64).into(), nsec: t.nsec.into() }
}

/// How errors name a placeholder directory.
pub(crate) fn id_of_placeholder(root: u64) -> String {
    format!("root={root} ino={} (the empty placeholder of a subvolume)", EMPTY_SUBVOL_DIR_OBJECTID)
}

pub(crate) fn ino_err(id: InodeId, r: String) -> Error {
    let mut c = Corrupt::new(CorruptWhere::Item, r).root(id.root);
    c.ino = Some(id.ino);
    c.into()
}

impl FsWriter {
    /// The INODE_ITEM of inode `id` as the live view has it: the in-memory inode's copy
    /// when it has one (`update_inode` keeps it current, a removal drops it), else
    /// the tree's. An operation that reads the item again after each step of its own
    /// (a writeback's delalloc and completion, fallocate, truncate) would otherwise
    /// search the tree for it every time.
    ///
    /// # Errors
    /// As `FsRead::load_inode`: `Posix(NotFound)` if absent, read failures.
    pub(crate) fn inode_item(&self, id: InodeId) -> Result<InodeItem> {
        if let Some(item) = self.inodes.lookup(id).and_then(|i| i.attrs()) {
            return Ok(item);
        }
        Ok(self.live().load_inode(id, Load::ITEM)?.item)
    }

    /// Change inode `id` in place.
    ///
    /// # Errors
    /// `Posix(NotFound)` if absent.
    pub fn update_inode(&mut self, id: InodeId, f: impl FnOnce(&mut InodeItem)) -> Result<()> {
        self.update_inode_settling(id, 0, f)
    }

    /// `update_inode` for a change whose nbytes took `settled` of the in-memory
    /// inode's new delalloc bytes (`Inode::set_attrs_settling`).
    fn update_inode_settling(
        &mut self,
        id: InodeId,
        settled: u64,
        f: impl FnOnce(&mut InodeItem),
    ) -> Result<()> {
        self.check_root_writable(id.root)?;
        // A placeholder has no item; its callers refuse or skip it before they begin.
        if id.is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                id_of_placeholder(id.root),
                "an empty subvolume placeholder has no inode to change",
            ));
        }
        self.transaction("update_inode", 0, |w| {
            let key = Key::new(id.ino, INODE_ITEM_KEY, 0);
            let (leaf, slot) = w
                .lookup_for_update(id.root, &key, 0)?
                .ok_or_else(|| Error::posix(PosixKind::NotFound, id.to_string()))?;
            let transid = w.transid;
            let data = w.item_data_mut(leaf, slot);
            let mut ii =
                InodeItem::read_from_bytes(data).expect("inode size checked by the tree checker");
            f(&mut ii);
            ii.transid = transid.into();
            ii.sequence = (ii.sequence.get() + 1).into();
            data.copy_from_slice(ii.as_bytes());
            // The in-memory inode's copy follows the item (the one place items change).
            if let Some(i) = w.inodes.lookup(id) {
                i.set_attrs_settling(Some(ii), settled);
            }
            Ok(())
        })
    }

    /// The next free objectid of tree `root` (`btrfs_find_free_objectid`).
    ///
    /// # Errors
    /// Read failures; `Posix(NoSpace)` when objectids run out.
    pub fn alloc_objectid(&mut self, root: u64) -> Result<u64> {
        if let Some(n) = self.next_objectid.get_mut(&root) {
            let v = *n;
            *n += 1;
            return Ok(v);
        }
        let highest =
            match self.last_item_le(root, &Key::new(LAST_FREE_OBJECTID, u8::MAX, u64::MAX))? {
                Some((k, _)) if k.objectid >= FIRST_FREE_OBJECTID => k.objectid,
                _ => FIRST_FREE_OBJECTID - 1,
            };
        let next = highest + 1;
        if next > LAST_FREE_OBJECTID {
            return Err(Error::posix(
                PosixKind::NoSpace,
                format!("tree {root} has no free inode numbers"),
            ));
        }
        self.next_objectid.insert(root, next + 1);
        Ok(next)
    }

    /// Create an unlinked inode (nlink 0; `link` adds names), as an O_TMPFILE: it carries
    /// an orphan item until its first name, so a commit (or a crash) before that leaves
    /// an inode the next mount cleans, never one `btrfs check` calls lost.
    ///
    /// # Errors
    /// Tree modification failures.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn create_inode(&mut self, root: u64, a: &InodeAttrs) -> Result<u64> {
        self.check_root_writable(root)?;
        self.transaction("create_inode", 2, |w| {
            let ino = w.create_inode_inner(root, a)?;
            w.orphan_add(InodeId { root, ino })?;
            Ok(ino)
        })
    }

    pub(crate) fn create_inode_inner(&mut self, root: u64, a: &InodeAttrs) -> Result<u64> {
        let ino = self.alloc_objectid(root)?;
        let mut ii = InodeItem::new_zeroed();
        let t = self.now();
        ii.generation = self.transid.into();
        ii.transid = self.transid.into();
        ii.mode = a.mode.into();
        ii.uid = a.uid.into();
        ii.gid = a.gid.into();
        ii.rdev = a.rdev.into();
        ii.flags = a.flags.into();
        // One reading for all four, as the kernel's inode_init gives them.
        ii.atime = Self::time_or(a.atime, t);
        ii.mtime = Self::time_or(a.mtime, t);
        ii.ctime = t;
        ii.otime = t;
        self.insert_item(root, &Key::new(ino, INODE_ITEM_KEY, 0), ii.as_bytes())?;
        Ok(ino)
    }

    /// The next DIR_INDEX of directory `dir`, kept in its in-memory inode
    /// (`btrfs_set_inode_index`; looked up from the last index item the first time, or
    /// again after the inode was evicted).
    pub(crate) fn next_dir_index(&mut self, root: u64, dir: u64) -> Result<u64> {
        let d = self.inodes.get(InodeId { root, ino: dir });
        // Changed only under the writer (`&mut self`): no other thread races this.
        let n = d.next_dir_index.load(std::sync::atomic::Ordering::Relaxed);
        let next = if n != 0 {
            n
        } else {
            match self.last_item_le(root, &Key::new(dir, DIR_INDEX_KEY, u64::MAX))? {
                Some((k, _)) if k.objectid == dir && k.type_ == DIR_INDEX_KEY => {
                    k.offset.checked_add(1).ok_or_else(|| {
                        ino_err(
                            InodeId { root, ino: dir },
                            "the directory's last DIR_INDEX is the largest possible".into(),
                        )
                    })?
                }
                _ => 2,
            }
        };
        d.next_dir_index.store(next + 1, std::sync::atomic::Ordering::Relaxed);
        Ok(next)
    }

    /// Add name `name` in directory `dir` for inode `ino` of type `ftype` (FT_*).
    ///
    /// # Errors
    /// `Posix`: Exists if the name is taken, NameTooLong, NotPermitted for a directory
    /// or an immutable or append-only inode, TooManyLinks at `LINK_MAX`; tree failures.
    pub fn link(&mut self, root: u64, dir: u64, name: &[u8], ino: u64, ftype: u8) -> Result<()> {
        self.check_root_writable(root)?;
        self.check_new_name(root, dir, name)?;
        let id = InodeId { root, ino };
        self.check_iflags(id, IflagOp::Relink, name)?;
        let item = self.live().load_inode(id, Load::ITEM)?.item;
        if item.mode.get() & S_IFMT == S_IFDIR {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                crate::quote::name(name),
                format!("{id} is a directory, which takes no hard links"),
            ));
        }
        if item.nlink.get() >= LINK_MAX {
            return Err(Error::posix_detail(
                PosixKind::TooManyLinks,
                crate::quote::name(name),
                format!("{id} has {} links, the most an inode can have", item.nlink.get()),
            ));
        }
        self.check_ref_room(root, ino, dir, name)?;
        let first_name = item.nlink.get() == 0;
        self.transaction("link", LINK_ITEMS + 1, |w| {
            w.link_inner(root, dir, name, ino, ftype)?;
            // An inode's first name ends its life as an orphan (`create_inode`).
            if first_name {
                w.orphan_del(id)?;
            }
            Ok(())
        })
    }

    /// Refuse a new `name` in `dir` before anything changes: a bad or taken name found
    /// after the inode or half the entries were inserted would leave them behind.
    /// Returns the directory's inode flags (for inheritance).
    pub(crate) fn check_new_name(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<u64> {
        if name.is_empty()
            || name.len() > NAME_LEN
            || name.contains(&b'/')
            || name == b"."
            || name == b".."
        {
            return Err(Error::posix(
                if name.len() > NAME_LEN { PosixKind::NameTooLong } else { PosixKind::Invalid },
                crate::quote::name(name),
            ));
        }
        let dir_id = InodeId { root, ino: dir };
        let d = self.live().load_inode(dir_id, Load::ITEM)?.item;
        if d.mode.get() & S_IFMT != S_IFDIR {
            return Err(Error::posix(PosixKind::NotDir, dir_id.to_string()));
        }
        crate::inode::namespace::refuse_placeholder_dir(root, dir, name)?;
        if self.live().lookup(dir_id, name)?.is_some() {
            return Err(Error::posix(PosixKind::Exists, crate::quote::name(name)));
        }
        iflags_allow(dir_id, d.flags.get(), IflagOp::AddName, name)?;
        Ok(d.flags.get())
    }

    /// `iflags_allow` for inode `id`, looked up.
    pub(crate) fn check_iflags(&mut self, id: InodeId, what: IflagOp, name: &[u8]) -> Result<()> {
        let flags = self.live().load_inode(id, Load::ITEM)?.item.flags.get();
        iflags_allow(id, flags, what, name)
    }

    /// A new name for an existing inode (`btrfs_link`): its ctime becomes now.
    pub(crate) fn link_inner(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        ino: u64,
        ftype: u8,
    ) -> Result<()> {
        self.add_link(root, dir, name, ino, ftype, true)
    }

    /// The first name of an inode `create_inode_inner` just made: its times stay the
    /// creation's, all four one reading (as `btrfs_create_new_inode` leaves them).
    pub(crate) fn link_new_inner(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        ino: u64,
        ftype: u8,
    ) -> Result<()> {
        self.add_link(root, dir, name, ino, ftype, false)
    }

    fn add_link(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        ino: u64,
        ftype: u8,
        change: bool,
    ) -> Result<()> {
        let index = self.next_dir_index(root, dir)?;
        self.add_inode_ref(root, ino, dir, name, index)?;
        self.add_dir_entries(root, dir, name, ino, ftype, index)?;
        let t = if change { Some(self.now()) } else { None };
        self.update_inode(InodeId { root, ino }, |i| {
            i.nlink = (i.nlink.get() + 1).into();
            if let Some(t) = t {
                i.ctime = t;
            }
        })
    }

    /// The DIR_ITEM and DIR_INDEX (at `index`) of `name` in `dir` for inode `ino`, and
    /// the directory's size and times (`btrfs_add_link` without the back reference).
    pub(crate) fn add_dir_entries(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        ino: u64,
        ftype: u8,
        index: u64,
    ) -> Result<()> {
        self.add_dir_entries_to(root, dir, name, Key::new(ino, INODE_ITEM_KEY, 0), ftype, index)
    }

    /// As `add_dir_entries`, for an entry whose location is `location`: an inode's
    /// INODE_ITEM key, or a subvolume's ROOT_ITEM key.
    pub(crate) fn add_dir_entries_to(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        location: Key,
        ftype: u8,
        index: u64,
    ) -> Result<()> {
        self.insert_dir_entries(root, dir, name, location, ftype, index)?;
        let t = self.now();
        let nl = name.len() as u64;
        self.update_inode(InodeId { root, ino: dir }, |d| {
            d.size = (d.size.get() + 2 * nl).into();
            d.mtime = t;
            d.ctime = t;
        })
    }

    /// The DIR_ITEM and DIR_INDEX items of `add_dir_entries_to`, and nothing of the
    /// directory's inode.
    pub(crate) fn insert_dir_entries(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        location: Key,
        ftype: u8,
        index: u64,
    ) -> Result<()> {
        let mut entry = Vec::with_capacity(30 + name.len());
        let di = DirItem {
            location: location.to_disk(),
            transid: self.transid.into(),
            data_len: 0.into(),
            name_len: (name.len() as u16).into(),
            type_: ftype,
        };
        entry.extend_from_slice(di.as_bytes());
        entry.extend_from_slice(name);
        // DIR_ITEM: append to an item holding a colliding hash.
        let dkey = Key::new(dir, DIR_ITEM_KEY, name_hash(name));
        match self.lookup_for_update(root, &dkey, entry.len())? {
            Some(_) => {
                let (leaf, slot) = self.extend_item(root, &dkey, entry.len())?;
                let d = self.item_data_mut(leaf, slot);
                let l = d.len();
                d[l - entry.len()..].copy_from_slice(&entry);
            }
            None => self.insert_item(root, &dkey, &entry)?,
        }
        self.insert_item(root, &Key::new(dir, DIR_INDEX_KEY, index), &entry)?;
        let subvol = location.type_ == ROOT_ITEM_KEY;
        self.log_dir_change(root, dir, Some((index, false)), None, subvol);
        Ok(())
    }

    /// Where a new back reference of `ino` to `name` in `dir` goes.
    pub(crate) fn ref_room(
        &mut self,
        root: u64,
        ino: u64,
        dir: u64,
        name: &[u8],
    ) -> Result<RefRoom> {
        let rkey = Key::new(ino, INODE_REF_KEY, dir);
        let add = std::mem::size_of::<InodeRef>() + name.len();
        Ok(match self.items_in_range(root, &rkey, &rkey)?.first() {
            None => RefRoom::New,
            Some((_, d)) if d.len() + add <= max_ref_item(self.nodesize()) => RefRoom::Extend,
            Some(_)
                if self.sb.incompat_flags.get()
                    & ubtrfs_format::features::INCOMPAT_EXTENDED_IREF
                    == 0 =>
            {
                RefRoom::Full
            }
            Some(_) => RefRoom::Extref,
        })
    }

    /// Refuse, before anything changes, a new name of `ino` in `dir` that has no room
    /// for its back reference (EMLINK without the extref feature). The kernel finds
    /// this after taking the directory's next index, so the index is used up here too.
    pub(crate) fn check_ref_room(
        &mut self,
        root: u64,
        ino: u64,
        dir: u64,
        name: &[u8],
    ) -> Result<()> {
        if matches!(self.ref_room(root, ino, dir, name)?, RefRoom::Full) {
            self.next_dir_index(root, dir)?;
            return Err(Error::posix_detail(
                PosixKind::TooManyLinks,
                crate::quote::name(name),
                format!("root={root} ino={ino}: its INODE_REF item for directory {dir} is full and the filesystem has no extref feature"),
            ));
        }
        Ok(())
    }

    /// Inode `ino`'s back reference to `name` in `dir` at `index`: appended to its
    /// INODE_REF for `dir`, or, once that item cannot grow (the kernel's EOVERFLOW from
    /// the leaf split), an INODE_EXTREF (`btrfs_insert_inode_ref`).
    pub(crate) fn add_inode_ref(
        &mut self,
        root: u64,
        ino: u64,
        dir: u64,
        name: &[u8],
        index: u64,
    ) -> Result<()> {
        self.log_new_name(root, ino);
        let mut r = Vec::with_capacity(10 + name.len());
        r.extend_from_slice(
            InodeRef { index: index.into(), name_len: (name.len() as u16).into() }.as_bytes(),
        );
        r.extend_from_slice(name);
        let rkey = Key::new(ino, INODE_REF_KEY, dir);
        match self.ref_room(root, ino, dir, name)? {
            RefRoom::New => self.insert_item(root, &rkey, &r)?,
            RefRoom::Extend => {
                let (leaf, slot) = self.extend_item(root, &rkey, r.len())?;
                let d = self.item_data_mut(leaf, slot);
                let l = d.len();
                d[l - r.len()..].copy_from_slice(&r);
            }
            RefRoom::Full => {
                return Err(Error::posix_detail(PosixKind::TooManyLinks, format!("root={root} ino={ino}"), "its INODE_REF item for the directory is full and the filesystem has no extref feature"));
            }
            RefRoom::Extref => {
                let mut e = Vec::with_capacity(18 + name.len());
                e.extend_from_slice(
                    InodeExtref {
                        parent_objectid: dir.into(),
                        index: index.into(),
                        name_len: (name.len() as u16).into(),
                    }
                    .as_bytes(),
                );
                e.extend_from_slice(name);
                let ekey = Key::new(ino, INODE_EXTREF_KEY, extref_hash(dir, name));
                if self.lookup_for_update(root, &ekey, e.len())?.is_some() {
                    let (leaf, slot) = self.extend_item(root, &ekey, e.len())?;
                    let d = self.item_data_mut(leaf, slot);
                    let l = d.len();
                    d[l - e.len()..].copy_from_slice(&e);
                } else {
                    self.insert_item(root, &ekey, &e)?;
                }
            }
        }
        Ok(())
    }

    /// Create a directory `name` in `dir`.
    ///
    /// # Errors
    /// As `link`.
    pub fn mkdir(&mut self, root: u64, dir: u64, name: &[u8], a: &InodeAttrs) -> Result<u64> {
        let mut a = *a;
        a.mode = S_IFDIR | (a.mode & 0o7777);
        self.check_root_writable(root)?;
        let dflags = self.check_new_name(root, dir, name)?;
        a.flags |= inherited_flags(dflags, false);
        self.transaction("mkdir", LINK_ITEMS + 3, |w| {
            let ino = w.create_inode_inner(root, &a)?;
            w.link_new_inner(root, dir, name, ino, FT_DIR)?;
            w.inherit_props(root, dir, ino)?;
            Ok(ino)
        })
    }

    /// Create an empty regular file `name` in `dir`.
    ///
    /// # Errors
    /// As `link`.
    pub fn create_file(&mut self, root: u64, dir: u64, name: &[u8], a: &InodeAttrs) -> Result<u64> {
        let mut a = *a;
        a.mode = S_IFREG | (a.mode & 0o7777);
        self.check_root_writable(root)?;
        // vfs_create: a directory without a create operation is EACCES.
        if (InodeId { root, ino: dir }).is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::PermissionDenied,
                crate::quote::name(name),
                "the directory is the empty placeholder of a subvolume this snapshot does not hold; nothing can be made in it",
            ));
        }
        let dflags = self.check_new_name(root, dir, name)?;
        a.flags |= inherited_flags(dflags, true);
        self.transaction("create_file", LINK_ITEMS + 3, |w| {
            let ino = w.create_inode_inner(root, &a)?;
            w.link_new_inner(root, dir, name, ino, FT_REG_FILE)?;
            w.inherit_props(root, dir, ino)?;
            Ok(ino)
        })
    }

    /// Create an unnamed regular file for directory `dir`, as `open(O_TMPFILE)` does
    /// (`btrfs_tmpfile`): a new inode with nlink 0 and an orphan item, its flags and
    /// compression property inherited from `dir` as a created file's are, and `dir`
    /// itself unchanged (no entry, no new times; measured on kernel 6.18). `link` gives
    /// it its first name and deletes the orphan item; its last close without one drops
    /// it (`evict_if_unlinked`), and a crash before either leaves the orphan for the next
    /// mount.
    ///
    /// # Errors
    /// `Posix`: NotDir, NotPermitted for an immutable directory (the kernel's
    /// `inode_permission` of `dir` for writing; an append-only one is allowed),
    /// NotSupported in a subvolume placeholder (its directory has no `tmpfile`
    /// operation, so `vfs_tmpfile` refuses), all three as measured on kernel 6.18;
    /// ReadOnly in a read-only subvolume; tree failures.
    pub fn tmpfile(&mut self, root: u64, dir: u64, a: &InodeAttrs) -> Result<u64> {
        let mut a = *a;
        a.mode = S_IFREG | (a.mode & 0o7777);
        self.check_root_writable(root)?;
        if (InodeId { root, ino: dir }).is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                format!("root={root} ino={dir}"),
                "the directory is the empty placeholder of a subvolume this snapshot does not hold; it makes no unnamed files",
            ));
        }
        let d = self.live().load_inode(InodeId { root, ino: dir }, Load::ITEM)?.item;
        if d.mode.get() & S_IFMT != S_IFDIR {
            return Err(Error::posix(PosixKind::NotDir, format!("root={root} ino={dir}")));
        }
        if d.flags.get() & INODE_IMMUTABLE != 0 {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                format!("root={root} ino={dir}"),
                "the directory is immutable",
            ));
        }
        a.flags |= inherited_flags(d.flags.get(), true);
        self.transaction("tmpfile", 3, |w| {
            let ino = w.create_inode_inner(root, &a)?;
            w.orphan_add(InodeId { root, ino })?;
            w.inherit_props(root, dir, ino)?;
            Ok(ino)
        })
    }

    /// Remove file extents in [start, end), trimming and splitting items at the edges
    /// (`btrfs_drop_extents`). Returns the nbytes removed.
    ///
    /// # Errors
    /// Tree modification failures.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn drop_extents(&mut self, id: InodeId, start: u64, end: u64) -> Result<u64> {
        self.check_root_writable(id.root)?;
        self.transaction("drop_extents", 0, |w| w.drop_extents_inner(id, start, end))
    }

    pub(crate) fn drop_extents_inner(&mut self, id: InodeId, start: u64, end: u64) -> Result<u64> {
        let InodeId { root, ino } = id;
        let mut removed = 0;
        for f in self.live().file_extents(id, start, end)? {
            let key = Key::new(ino, EXTENT_DATA_KEY, f.file_offset);
            let ExtentKind::Regular { disk_bytenr, disk_num_bytes, offset, num_bytes, .. } = f.kind
            else {
                self.delete_item(root, &key)?;
                removed += f.len();
                continue;
            };
            let ks = f.file_offset;
            let ke = f.end();
            let counted = disk_bytenr != 0;
            let item = self
                .items_in_range(root, &key, &key)?
                .pop()
                .map(|(_, d)| d)
                .ok_or_else(|| ino_err(id, format!("file extent {key} vanished")))?;
            // Regular items are REG_SIZE long (checked when `file_extents` parsed them).
            let set = |d: &mut Vec<u8>, off: u64, num: u64| {
                let (_, b) = ubtrfs_format::items::file_extent_reg_mut(d)
                    .expect("regular file extent item size");
                b.offset = off.into();
                b.num_bytes = num.into();
            };
            if start <= ks && ke <= end {
                self.delete_item(root, &key)?;
                if counted {
                    self.data_ref(
                        disk_bytenr,
                        disk_num_bytes,
                        root,
                        ino,
                        ks.wrapping_sub(offset),
                        -1,
                    )?;
                    removed += num_bytes;
                }
            } else if ks < start && ke <= end {
                let mut d = item;
                set(&mut d, offset, start - ks);
                self.replace_item(root, &key, &key, &d)?;
                if counted {
                    removed += ke - start;
                }
            } else if start <= ks && end < ke {
                let mut d = item;
                set(&mut d, offset + (end - ks), ke - end);
                self.replace_item(root, &key, &Key::new(ino, EXTENT_DATA_KEY, end), &d)?;
                if counted {
                    removed += end - ks;
                }
            } else {
                // Split: [ks, start) stays, [end, ke) becomes a second reference.
                let mut head = item.clone();
                set(&mut head, offset, start - ks);
                self.replace_item(root, &key, &key, &head)?;
                let mut tail = item;
                set(&mut tail, offset + (end - ks), ke - end);
                ubtrfs_format::items::file_extent_reg_mut(&mut tail)
                    .expect("regular file extent item size")
                    .0
                    .generation = self.transid.into();
                self.insert_item(root, &Key::new(ino, EXTENT_DATA_KEY, end), &tail)?;
                if counted {
                    self.data_ref(
                        disk_bytenr,
                        disk_num_bytes,
                        root,
                        ino,
                        ks.wrapping_sub(offset),
                        1,
                    )?;
                    removed += end - start;
                }
            }
        }
        Ok(removed)
    }

    /// Replace the item at `old` with `new_key` + `data`.
    pub(crate) fn replace_item(
        &mut self,
        root: u64,
        old: &Key,
        new_key: &Key,
        data: &[u8],
    ) -> Result<()> {
        if old == new_key && self.overwrite_item(root, old, data)? {
            return Ok(());
        }
        if !self.delete_item(root, old)? {
            let id = InodeId { root, ino: old.objectid };
            return Err(ino_err(id, format!("item {old} vanished")));
        }
        self.insert_item(root, new_key, data)
    }

    /// The inline extent holding all of a small file's `content` (uncompressed).
    pub(crate) fn insert_inline(&mut self, id: InodeId, content: &[u8]) -> Result<()> {
        self.insert_inline_item(id, content.len() as u64, 0, content)
    }

    /// An inline extent of `ram_bytes` file bytes stored as `data` (compressed with
    /// `compression`, or plain with 0).
    pub(crate) fn insert_inline_item(
        &mut self,
        id: InodeId,
        ram_bytes: u64,
        compression: u8,
        data: &[u8],
    ) -> Result<()> {
        let mut fe = Vec::with_capacity(FILE_EXTENT_INLINE_DATA_START + data.len());
        fe.extend_from_slice(
            FileExtentHeader {
                generation: self.transid.into(),
                ram_bytes: ram_bytes.into(),
                compression,
                encryption: 0,
                other_encoding: 0.into(),
                type_: FILE_EXTENT_INLINE,
            }
            .as_bytes(),
        );
        fe.extend_from_slice(data);
        self.insert_item(id.root, &Key::new(id.ino, EXTENT_DATA_KEY, 0), &fe)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn unlink_inner(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        ino: u64,
        ftype: u8,
        child: &InodeItem,
        in_use: bool,
    ) -> Result<()> {
        self.log_unlink(root, dir, name, ino);
        self.del_name(root, dir, name, ino)?;
        let t = self.now();
        let nlink = child.nlink.get().saturating_sub(1);
        let id = InodeId { root, ino };
        if nlink == 0 || ftype == FT_DIR {
            self.log_forget(root, dir, ino, child.generation.get());
        }
        if nlink == 0 || ftype == FT_DIR {
            self.drop_last_link(id, child, t, in_use)?;
        } else {
            self.update_inode(id, |i| {
                i.nlink = nlink.into();
                i.ctime = t;
            })?;
        }
        Ok(())
    }

    /// Remove `name` from directory `dir` (its DIR_ITEM entry, DIR_INDEX, and inode
    /// `ino`'s back reference) and update the directory's size and times; the inode's
    /// link count is the caller's (`__btrfs_unlink_inode`).
    pub(crate) fn del_name(&mut self, root: u64, dir: u64, name: &[u8], ino: u64) -> Result<()> {
        self.del_dir_item_entry(root, dir, name)?;
        // INODE_REF or INODE_EXTREF: find the index and drop the name.
        let index = self.remove_inode_ref(root, ino, dir, name)?;
        self.log_dir_change(root, dir, None, Some(ino), false);
        self.del_dir_index(root, dir, name, index)
    }

    /// Drop the DIR_INDEX `index` of `name` from directory `dir`, whose size and times
    /// change with it (the last step of removing a name).
    pub(crate) fn del_dir_index(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        index: u64,
    ) -> Result<()> {
        self.delete_item(root, &Key::new(dir, DIR_INDEX_KEY, index))?;
        self.log_dir_change(root, dir, Some((index, true)), None, false);
        let t = self.now();
        let nl = name.len() as u64;
        self.update_inode(InodeId { root, ino: dir }, |d| {
            d.size = (d.size.get().saturating_sub(2 * nl)).into();
            d.mtime = t;
            d.ctime = t;
        })
    }

    /// Drop `name`'s entry from directory `dir`'s (possibly shared) DIR_ITEM.
    pub(crate) fn del_dir_item_entry(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<()> {
        let dkey = Key::new(dir, DIR_ITEM_KEY, name_hash(name));
        let d = self
            .items_in_range(root, &dkey, &dkey)?
            .pop()
            .map(|(_, d)| d)
            .ok_or_else(|| ino_err(InodeId { root, ino: dir }, "dir item vanished".into()))?;
        let mut rest = Vec::new();
        for e in items::dir_entries(&d) {
            let e = e.expect("validated by the tree checker");
            if e.name != name {
                let di = DirItem {
                    location: e.location.to_disk(),
                    transid: e.transid.into(),
                    data_len: (e.data.len() as u16).into(),
                    name_len: (e.name.len() as u16).into(),
                    type_: e.type_,
                };
                rest.extend_from_slice(di.as_bytes());
                rest.extend_from_slice(e.name);
                rest.extend_from_slice(e.data);
            }
        }
        self.delete_item(root, &dkey)?;
        if !rest.is_empty() {
            self.insert_item(root, &dkey, &rest)?;
        }
        Ok(())
    }

    pub(crate) fn remove_inode_ref(
        &mut self,
        root: u64,
        ino: u64,
        dir: u64,
        name: &[u8],
    ) -> Result<u64> {
        let rkey = Key::new(ino, INODE_REF_KEY, dir);
        if let Some((_, d)) = self.items_in_range(root, &rkey, &rkey)?.pop() {
            let mut rest = Vec::new();
            let mut index = None;
            for r in items::inode_refs(&d, dir) {
                let r = r.expect("validated by the tree checker");
                if r.name == name && index.is_none() {
                    index = Some(r.index);
                } else {
                    rest.extend_from_slice(
                        InodeRef { index: r.index.into(), name_len: (r.name.len() as u16).into() }
                            .as_bytes(),
                    );
                    rest.extend_from_slice(r.name);
                }
            }
            if let Some(i) = index {
                self.delete_item(root, &rkey)?;
                if !rest.is_empty() {
                    self.insert_item(root, &rkey, &rest)?;
                }
                return Ok(i);
            }
        }
        let ekey = Key::new(ino, INODE_EXTREF_KEY, extref_hash(dir, name));
        if let Some((_, d)) = self.items_in_range(root, &ekey, &ekey)?.pop() {
            let mut rest = Vec::new();
            let mut index = None;
            for r in items::inode_extrefs(&d) {
                let r = r.expect("validated by the tree checker");
                if r.name == name && r.parent == dir && index.is_none() {
                    index = Some(r.index);
                } else {
                    rest.extend_from_slice(
                        InodeExtref {
                            parent_objectid: r.parent.into(),
                            index: r.index.into(),
                            name_len: (r.name.len() as u16).into(),
                        }
                        .as_bytes(),
                    );
                    rest.extend_from_slice(r.name);
                }
            }
            if let Some(i) = index {
                self.delete_item(root, &ekey)?;
                if !rest.is_empty() {
                    self.insert_item(root, &ekey, &rest)?;
                }
                return Ok(i);
            }
        }
        Err(ino_err(
            InodeId { root, ino },
            format!("no inode ref for name {:?} in dir {dir}", String::from_utf8_lossy(name)),
        ))
    }

    /// Delete inode `id` and every item it owns, dropping its data references.
    ///
    /// # Errors
    /// Tree modification failures.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn remove_inode(&mut self, id: InodeId) -> Result<()> {
        self.check_root_writable(id.root)?;
        self.transaction("remove_inode", 0, |w| w.remove_inode_inner(id))
    }

    pub(crate) fn remove_inode_inner(&mut self, id: InodeId) -> Result<()> {
        let InodeId { root, ino } = id;
        if let Some(i) = self.inodes.lookup(id) {
            i.set_attrs(None);
        }
        self.drop_extents_inner(id, 0, u64::MAX)?;
        let items =
            self.items_in_range(root, &Key::new(ino, 0, 0), &Key::new(ino, u8::MAX, u64::MAX))?;
        for (k, _) in items.iter().rev() {
            self.delete_item(root, k)?;
        }
        Ok(())
    }
}

/// A regular file extent item of `num_bytes` at `disk_bytenr` (0: a hole), written in
/// generation `transid`.
pub(crate) fn reg_extent_item(transid: u64, disk_bytenr: u64, num_bytes: u64) -> Vec<u8> {
    extent_item(transid, FILE_EXTENT_REG, disk_bytenr, num_bytes)
}

/// An uncompressed file extent item of type `type_` (REG or PREALLOC) covering the
/// whole `num_bytes` disk extent at `disk_bytenr` (0 with REG: a hole).
pub(crate) fn extent_item(transid: u64, type_: u8, disk_bytenr: u64, num_bytes: u64) -> Vec<u8> {
    let disk_num_bytes = if disk_bytenr == 0 { 0 } else { num_bytes };
    ubtrfs_format::items::file_extent_reg_item(
        &FileExtentHeader {
            generation: transid.into(),
            ram_bytes: num_bytes.into(),
            compression: 0,
            encryption: 0,
            other_encoding: 0.into(),
            type_,
        },
        &FileExtentBody {
            disk_bytenr: disk_bytenr.into(),
            disk_num_bytes: disk_num_bytes.into(),
            offset: 0.into(),
            num_bytes: num_bytes.into(),
        },
    )
}

impl FsWriter {
    /// Without no-holes, a write starting past EOF first covers the gap from the old
    /// size (rounded up to a sector) to `start` with a hole extent, as the kernel does.
    pub(crate) fn insert_hole_before(
        &mut self,
        id: InodeId,
        old_size: u64,
        start: u64,
    ) -> Result<()> {
        if self.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES != 0 {
            return Ok(());
        }
        let ss = u64::from(self.sectorsize());
        let hole_start = old_size.div_ceil(ss) * ss;
        if start <= hole_start {
            return Ok(());
        }
        // btrfs_cont_expand: every range that is not preallocated (fallocate's
        // KEEP_SIZE leaves extents past EOF) becomes a hole extent.
        let mut gaps = Vec::new();
        let mut cur = hole_start;
        for f in self.live().file_extents(id, hole_start, start)? {
            let (fs, fe) = (f.file_offset.max(hole_start), f.end().min(start));
            if fs >= fe {
                continue;
            }
            if matches!(f.kind, ExtentKind::Regular { prealloc: true, .. }) {
                if cur < fs {
                    gaps.push((cur, fs));
                }
                cur = fe;
            }
        }
        if cur < start {
            gaps.push((cur, start));
        }
        for (s, e) in gaps {
            self.drop_extents_inner(id, s, e)?;
            let fe = reg_extent_item(self.transid, 0, e - s);
            self.insert_item(id.root, &Key::new(id.ino, EXTENT_DATA_KEY, s), &fe)?;
        }
        Ok(())
    }

    /// After a write: the new size, nbytes less `removed` plus `added`, mtime and ctime
    /// (not for a writeback, `writing_back`).
    pub(crate) fn update_written_inode(
        &mut self,
        id: InodeId,
        new_size: u64,
        removed: u64,
        added: u64,
    ) -> Result<()> {
        // A writeback through the direct path leaves the times as the buffered writes
        // set them (`file_update_time` ran at each write).
        let t = (!self.writing_back).then(|| self.now());
        self.update_inode(id, |i| {
            i.size = new_size.into();
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into();
            if let Some(t) = t {
                i.mtime = t;
                i.ctime = t;
            }
        })
    }

    /// After writeback of buffered data: the new size and nbytes; the times stay as
    /// the buffered writes (or a later setattr) left them (`btrfs_finish_one_ordered`
    /// updates the inode, `file_update_time` ran at the write).
    pub(crate) fn update_written_back_inode(
        &mut self,
        id: InodeId,
        new_size: u64,
        removed: u64,
        added: u64,
        settled: u64,
    ) -> Result<()> {
        self.update_inode_settling(id, settled, |i| {
            i.size = new_size.into();
            i.nbytes = (i.nbytes.get() - removed.min(i.nbytes.get()) + added).into();
        })
    }

    /// A write's `file_update_time`: mtime and ctime become `t`; `mode`, when given,
    /// is the mode `file_remove_privs` leaves (`mode_without_privs`).
    pub(crate) fn file_update_time(
        &mut self,
        id: InodeId,
        mode: Option<u32>,
        t: Timespec,
    ) -> Result<()> {
        self.update_inode(id, |i| {
            if let Some(m) = mode {
                i.mode = m.into();
            }
            i.mtime = t;
            i.ctime = t;
        })
    }
}
