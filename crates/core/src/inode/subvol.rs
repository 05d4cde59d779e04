//! Subvolumes: creating one (the kernel's `create_subvol` in ioctl.c), snapshotting one
//! (`create_pending_snapshot` in transaction.c) and choosing the default (`btrfs
//! subvolume set-default`).
//!
//! A new subvolume is a new fs tree: a leaf holding its top directory (inode 256, with
//! an INODE_REF ".." to itself), a ROOT_ITEM with a fresh UUID and the creation times,
//! ROOT_REF and ROOT_BACKREF items tying it to the directory that names it, that
//! directory's DIR_ITEM and DIR_INDEX pointing at the ROOT_ITEM (not at an inode), an
//! entry in the UUID tree (made if the filesystem has none yet, as the kernel makes it
//! at mount), and with quotas on, its level-0 qgroup. The top directory takes neither
//! inode flags nor properties from the parent (checked on the 6.18 kernel: a subvolume
//! made in a `chattr +C` directory with compression=zstd has neither).

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId};
use crate::inode::write::InodeAttrs;
use crate::inode::writer::FsWriter;
use crate::tree::search::TreeView;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{items, Corrupt, CorruptWhere, Key};
use zerocopy::{FromZeros, IntoBytes};

/// Items a subvolume creation changes (the tree, its root item, the two refs, the
/// parent's entries and inode, the UUID item, the new top directory and its ref, a
/// qgroup's two items).
const SUBVOL_ITEMS: u64 = 12;

/// Items a snapshot changes (its root item and the source's, the two refs, the
/// parent's entries and inode, the UUID item).
const SNAPSHOT_ITEMS: u64 = 10;

/// The UUID tree key of subvolume uuid `u` with type `ty` (`btrfs_uuid_to_key`).
pub fn uuid_key(u: &[u8; 16], ty: u8) -> Key {
    Key::new(
        u64::from_le_bytes(u[..8].try_into().expect("8 bytes")),
        ty,
        u64::from_le_bytes(u[8..].try_into().expect("8 bytes")),
    )
}

impl FsWriter {
    /// Create subvolume `name` in directory `dir` of tree `root`, its top directory
    /// with `a`'s mode (permission bits), owner and times. Returns the new tree's id.
    ///
    /// # Errors
    /// As `mkdir` for the name (Exists, NameTooLong, NotDir, NotPermitted); `NoSpace`
    /// when the root tree has no free ids; tree failures.
    pub fn create_subvol(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        a: &InodeAttrs,
    ) -> Result<u64> {
        self.check_root_writable(root)?;
        self.check_new_name(root, dir, name)?;
        self.transaction("create_subvol", SUBVOL_ITEMS, |w| {
            w.create_subvol_inner(root, dir, name, a)
        })
    }

    fn create_subvol_inner(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        a: &InodeAttrs,
    ) -> Result<u64> {
        let id = self.alloc_objectid(ROOT_TREE_OBJECTID)?;
        if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                crate::quote::name(name),
                "the root tree has no free subvolume ids",
            ));
        }
        let t = self.now();
        let uuid = self.info.sources.uuids.new_uuid();
        // The tree and its ROOT_ITEM, then what the kernel's create_subvol fills in.
        self.create_tree_inner(id)?;
        {
            let nodesize = self.info.nodesize;
            let st = self.roots.get_mut(&id).expect("create_tree_inner registered the root");
            let item = st.item.as_mut().expect("a new tree has its root item");
            item.root_dirid = FIRST_FREE_OBJECTID.into();
            item.uuid = uuid;
            item.ctime = t;
            item.otime = t;
            item.bytes_used = u64::from(nodesize).into();
            // As the kernel's create_subvol: a root item of the current format, whose
            // flags (a later `ro`) the kernel keeps.
            item.inode.flags = INODE_ROOT_ITEM_INIT.into();
        }
        // Its top directory, inode 256, its own parent.
        let mut ii = InodeItem::new_zeroed();
        ii.generation = self.transid.into();
        ii.transid = self.transid.into();
        ii.mode = (S_IFDIR | (a.mode & 0o7777)).into();
        ii.uid = a.uid.into();
        ii.gid = a.gid.into();
        ii.nlink = 1.into();
        ii.atime = Self::time_or(a.atime, t);
        ii.mtime = Self::time_or(a.mtime, t);
        ii.ctime = t;
        ii.otime = t;
        self.insert_item(id, &Key::new(FIRST_FREE_OBJECTID, INODE_ITEM_KEY, 0), ii.as_bytes())?;
        let mut r = InodeRef { index: 0.into(), name_len: 2.into() }.as_bytes().to_vec();
        r.extend_from_slice(b"..");
        self.insert_item(
            id,
            &Key::new(FIRST_FREE_OBJECTID, INODE_REF_KEY, FIRST_FREE_OBJECTID),
            &r,
        )?;
        self.link_subvol(root, dir, name, id, 0, &uuid)?;
        Ok(id)
    }

    /// Name new subvolume `id` in directory `dir` of tree `root`: the entries pointing
    /// at its ROOT_ITEM (key offset `location_offset`), ROOT_REF and ROOT_BACKREF, its
    /// UUID-tree item and, with quotas on, its qgroup.
    fn link_subvol(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        id: u64,
        location_offset: u64,
        uuid: &[u8; 16],
    ) -> Result<()> {
        let index = self.next_dir_index(root, dir)?;
        self.add_dir_entries_to(
            root,
            dir,
            name,
            Key::new(id, ROOT_ITEM_KEY, location_offset),
            FT_DIR,
            index,
        )?;
        let mut rr = RootRef {
            dirid: dir.into(),
            sequence: index.into(),
            name_len: (name.len() as u16).into(),
        }
        .as_bytes()
        .to_vec();
        rr.extend_from_slice(name);
        self.insert_item(ROOT_TREE_OBJECTID, &Key::new(root, ROOT_REF_KEY, id), &rr)?;
        self.insert_item(ROOT_TREE_OBJECTID, &Key::new(id, ROOT_BACKREF_KEY, root), &rr)?;
        self.add_uuid_item(uuid, UUID_KEY_SUBVOL, id)?;
        if self.quotas {
            self.add_subvol_qgroup(id)?;
        }
        Ok(())
    }

    /// Snapshot subvolume `src` as `name` in directory `dir` of tree `root`
    /// (`btrfs subvolume snapshot [-r]`), committing first when the source has changes
    /// in the running transaction (a snapshot shares only committed blocks, see
    /// `create_snapshot_of_committed`). Returns the snapshot's id.
    ///
    /// # Errors
    /// As `create_snapshot_of_committed`; commit failures.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn create_snapshot(
        &mut self,
        src: u64,
        root: u64,
        dir: u64,
        name: &[u8],
        readonly: bool,
    ) -> Result<u64> {
        if self.snapshot_needs_commit(src)? {
            self.commit()?;
        }
        self.create_snapshot_of_committed(src, root, dir, name, readonly)?.ok_or_else(|| {
            Error::posix_detail(
                PosixKind::Busy,
                format!("subvolume {src}"),
                "it changed again before its snapshot",
            )
        })
    }

    /// Whether subvolume `src` has changes in the running transaction, which a
    /// snapshot must not share: a commit comes first.
    ///
    /// # Errors
    /// `Posix(NotFound)` for a tree that does not exist.
    pub fn snapshot_needs_commit(&mut self, src: u64) -> Result<bool> {
        Ok(self.root(src)?.generation >= self.transid)
    }

    /// Snapshot subvolume `src` as `name` in directory `dir` of tree `root`, read-only
    /// if `readonly`; None (nothing changed) when the source has changes in the running
    /// transaction (commit, then ask again).
    ///
    /// The snapshot's tree is a copy of the source's root block whose children gain a
    /// reference from the new tree (`btrfs_copy_root` and `btrfs_inc_ref`); every
    /// block below is shared, and the first change on either side COWs its path with
    /// the backref rules of `update_ref_for_cow` (the source's `last_snapshot` says
    /// its older blocks may be shared). The ROOT_ITEM is the source's with a new UUID,
    /// the source's as parent UUID, no received UUID, this transaction as ctransid and
    /// otransid (its key offset too), and RDONLY as asked; then the refs, the entries
    /// in `dir` and the UUID-tree item, as for a new subvolume. Only committed blocks
    /// are shared: a block of the running transaction would still be changed in place.
    ///
    /// # Errors
    /// `Posix(Invalid)` for a tree that is not a subvolume; `Posix(NotFound)`; the name
    /// errors of `mkdir`; tree failures. With quotas on, the snapshot gets its qgroup
    /// and the commit recounts every qgroup (a full walk of the subvolume trees).
    pub fn create_snapshot_of_committed(
        &mut self,
        src: u64,
        root: u64,
        dir: u64,
        name: &[u8],
        readonly: bool,
    ) -> Result<Option<u64>> {
        if src != FS_TREE_OBJECTID && !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&src) {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("tree {src}"),
                "only subvolumes are snapshotted",
            ));
        }
        self.root(src).map_err(|e| {
            if e.posix_kind() == Some(PosixKind::NotFound) {
                Error::posix_detail(
                    PosixKind::NotFound,
                    format!("subvolume {src}"),
                    "no such subvolume",
                )
            } else {
                e
            }
        })?;
        self.check_root_writable(root)?;
        self.check_new_name(root, dir, name)?;
        if self.snapshot_needs_commit(src)? {
            return Ok(None);
        }
        self.transaction("create_snapshot", SNAPSHOT_ITEMS, |w| {
            w.create_snapshot_inner(src, root, dir, name, readonly)
        })
        .map(Some)
    }

    fn create_snapshot_inner(
        &mut self,
        src: u64,
        root: u64,
        dir: u64,
        name: &[u8],
        readonly: bool,
    ) -> Result<u64> {
        let id = self.alloc_objectid(ROOT_TREE_OBJECTID)?;
        if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                crate::quote::name(name),
                "the root tree has no free subvolume ids",
            ));
        }
        let t = self.now();
        let uuid = self.info.sources.uuids.new_uuid();
        let transid = self.transid;
        let si = self.root(src)?;
        let src_item = self.roots.get(&src).and_then(|s| s.item).ok_or_else(|| {
            Error::posix(PosixKind::NotFound, format!("subvolume {src}: no root item"))
        })?;
        // The source's root block, copied for the new tree; its children (or, for a
        // one-leaf tree, its file extents) gain the new tree's references.
        let old = self.read_block(
            si.bytenr,
            &crate::tree::extent_buffer::Expect {
                level: Some(si.level),
                generation: Some(si.generation),
                owner: Some(src),
                first_key: None,
            },
        )?;
        let first_key = {
            let n = self.node(&old);
            if n.nritems() > 0 {
                n.key(0)
            } else {
                Key::MIN
            }
        };
        let new = self.alloc_tree_block(id, si.level, first_key)?;
        self.copy_block(&old, new, id)?;
        self.mod_refs(&crate::transaction::Blk::Dirty(new), id, false, 1)?;
        // Its older blocks are shared from now on.
        {
            let st = self.roots.get_mut(&src).expect("loaded above");
            let it = st.item.as_mut().expect("a subvolume has its root item");
            it.last_snapshot = transid.into();
            st.dirty = true;
        }
        let mut item = src_item;
        item.bytenr = new.into();
        item.level = si.level;
        item.generation = transid.into();
        item.generation_v2 = transid.into();
        item.last_snapshot = transid.into();
        item.refs = 1.into();
        item.drop_progress = Key::MIN.to_disk();
        item.drop_level = 0;
        item.uuid = uuid;
        item.parent_uuid = src_item.uuid;
        item.received_uuid = [0; 16];
        item.ctransid = transid.into();
        item.otransid = transid.into();
        item.stransid = 0.into();
        item.rtransid = 0.into();
        item.ctime = t;
        item.otime = t;
        item.stime = Timespec::new_zeroed();
        item.rtime = Timespec::new_zeroed();
        // A root item whose inode lacks ROOT_ITEM_INIT is one of the old format, whose
        // flags the kernel clears when it loads it (`btrfs_check_and_init_root_item`):
        // without it a read-only snapshot would come up writable.
        item.inode.flags = (item.inode.flags.get() | INODE_ROOT_ITEM_INIT).into();
        let flags = item.flags.get() & !ROOT_SUBVOL_RDONLY;
        item.flags = (if readonly { flags | ROOT_SUBVOL_RDONLY } else { flags }).into();
        self.insert_item(
            ROOT_TREE_OBJECTID,
            &Key::new(id, ROOT_ITEM_KEY, transid),
            item.as_bytes(),
        )?;
        self.roots.insert(
            id,
            crate::transaction::RootState {
                info: crate::tree::search::RootInfo {
                    id,
                    bytenr: new,
                    level: si.level,
                    generation: transid,
                },
                item: Some(item),
                item_offset: transid,
                dirty: true,
            },
        );
        self.link_subvol(root, dir, name, id, u64::MAX, &uuid)?;
        if self.quotas {
            // The new tree reaches every extent of the source without a reference of
            // its own changing, so the commit recounts (the kernel's
            // `btrfs_qgroup_inherit` sets the same numbers directly).
            self.qgroup.needs_rescan("a snapshot shares a whole tree");
        }
        Ok(id)
    }

    /// The QGROUP_INFO and QGROUP_LIMIT items of new subvolume `id`'s qgroup 0/id.
    fn add_subvol_qgroup(&mut self, id: u64) -> Result<()> {
        let info = QgroupInfoItem {
            generation: self.transid.into(),
            rfer: 0.into(),
            rfer_cmpr: 0.into(),
            excl: 0.into(),
            excl_cmpr: 0.into(),
        };
        self.insert_item(QUOTA_TREE_OBJECTID, &Key::new(0, QGROUP_INFO_KEY, id), info.as_bytes())?;
        self.insert_item(
            QUOTA_TREE_OBJECTID,
            &Key::new(0, QGROUP_LIMIT_KEY, id),
            QgroupLimitItem::new_zeroed().as_bytes(),
        )
    }

    /// Delete subvolume `name` of directory `dir` in tree `root` (`btrfs subvolume
    /// delete`, the kernel's `btrfs_delete_subvolume`): its name, its ROOT_REF and
    /// ROOT_BACKREF and its UUID-tree entries go, its ROOT_ITEM keeps refs 0 and the
    /// SUBVOL_DEAD flag, and an ORPHAN_ITEM marks it for the cleaner, which drops its
    /// tree later across transactions (`drop_subvol_step`, `Engine::clean_dead_roots`;
    /// the kernel's cleaner does the same with what we leave). Returns its id.
    ///
    /// # Errors
    /// `Posix`: NotFound for the name; Invalid for a name that is not a subvolume;
    /// NotPermitted for the default subvolume (as the kernel); NotEmpty when
    /// subvolumes are nested in it; ReadOnly for a read-only parent; tree failures.
    /// With quotas on, its qgroup keeps counting what its tree holds until the drop
    /// (the kernel's accounting); the drop's commits recount.
    pub fn delete_subvol(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<u64> {
        self.check_root_writable(root)?;
        let entry = self
            .live()
            .lookup(InodeId { root, ino: dir }, name)?
            .ok_or_else(|| Error::posix(PosixKind::NotFound, crate::quote::name(name)))?;
        if !entry.is_subvol {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                crate::quote::name(name),
                "not a subvolume",
            ));
        }
        if let Some(id) = entry.placeholder_of {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                crate::quote::name(name),
                format!("not a subvolume: the empty placeholder of subvolume {id}, which this tree does not hold (rmdir removes it)"),
            ));
        }
        let id = entry.target.root;
        let what = || format!("subvolume {} (id {id})", crate::quote::name(name));
        if id == self.default_subvol {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                what(),
                "it is the default subvolume; set another default first",
            ));
        }
        let nested = self.items_in_range(
            ROOT_TREE_OBJECTID,
            &Key::new(id, ROOT_REF_KEY, 0),
            &Key::new(id, ROOT_REF_KEY, u64::MAX),
        )?;
        if let Some((k, _)) = nested.first() {
            return Err(Error::posix_detail(
                PosixKind::NotEmpty,
                what(),
                format!("subvolume {} is nested in it; delete that first", k.offset),
            ));
        }
        let rkey = Key::new(root, ROOT_REF_KEY, id);
        let rr = self.items_in_range(ROOT_TREE_OBJECTID, &rkey, &rkey)?.pop().map(|(_, d)| d);
        let index = match rr.as_deref().map(items::root_ref) {
            Some(Ok(r)) if r.dirid == dir && r.name == name => r.sequence,
            _ => {
                return Err(Corrupt::new(
                    CorruptWhere::Item,
                    format!("{}: no ROOT_REF {rkey} naming it in directory {dir}", what()),
                )
                .root(ROOT_TREE_OBJECTID)
                .into())
            }
        };
        self.root(id)?;
        self.transaction("delete_subvol", SNAPSHOT_ITEMS, |w| {
            w.delete_subvol_inner(root, dir, name, id, index)
        })?;
        Ok(id)
    }

    fn delete_subvol_inner(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        id: u64,
        index: u64,
    ) -> Result<()> {
        self.del_dir_item_entry(root, dir, name)?;
        self.log_dir_change(root, dir, None, None, true);
        self.del_dir_index(root, dir, name, index)?;
        self.delete_item(ROOT_TREE_OBJECTID, &Key::new(root, ROOT_REF_KEY, id))?;
        self.delete_item(ROOT_TREE_OBJECTID, &Key::new(id, ROOT_BACKREF_KEY, root))?;
        let item = {
            let st = self.roots.get_mut(&id).expect("loaded by delete_subvol");
            let it = st.item.as_mut().expect("a subvolume has its ROOT_ITEM");
            it.refs = 0.into();
            it.flags = (it.flags.get() | ROOT_SUBVOL_DEAD).into();
            it.drop_progress = Key::MIN.to_disk();
            it.drop_level = 0;
            st.dirty = true;
            *it
        };
        self.insert_item(
            ROOT_TREE_OBJECTID,
            &crate::extent::drop_snapshot::dead_root_key(id),
            &[],
        )?;
        self.del_uuid_item(&item.uuid, UUID_KEY_SUBVOL, id)?;
        if item.received_uuid != [0; 16] {
            self.del_uuid_item(&item.received_uuid, UUID_KEY_RECEIVED_SUBVOL, id)?;
        }
        Ok(())
    }

    /// Drop `id` from the UUID-tree item of `uuid` (`btrfs_uuid_tree_remove`); the item
    /// goes with its last id. A missing entry is not an error (the kernel's neither).
    fn del_uuid_item(&mut self, uuid: &[u8; 16], ty: u8, id: u64) -> Result<()> {
        if self.root(UUID_TREE_OBJECTID).is_err() {
            return Ok(());
        }
        let key = uuid_key(uuid, ty);
        let Some((_, d)) = self.items_in_range(UUID_TREE_OBJECTID, &key, &key)?.pop() else {
            return Ok(());
        };
        let rest: Vec<u8> =
            d.chunks_exact(8).filter(|c| *c != id.to_le_bytes()).flatten().copied().collect();
        if rest.len() == d.len() {
            return Ok(());
        }
        self.delete_item(UUID_TREE_OBJECTID, &key)?;
        if !rest.is_empty() {
            self.insert_item(UUID_TREE_OBJECTID, &key, &rest)?;
        }
        Ok(())
    }

    /// Record `id` under `uuid` in the UUID tree (`btrfs_uuid_tree_add`), making the
    /// tree if the filesystem has none.
    pub(crate) fn add_uuid_item(&mut self, uuid: &[u8; 16], ty: u8, id: u64) -> Result<()> {
        if self.root(UUID_TREE_OBJECTID).is_err() {
            self.create_tree_inner(UUID_TREE_OBJECTID)?;
        }
        let key = uuid_key(uuid, ty);
        let have = self.items_in_range(UUID_TREE_OBJECTID, &key, &key)?;
        match have.first() {
            Some((_, d)) if d.chunks_exact(8).any(|c| c == id.to_le_bytes()) => Ok(()),
            Some(_) => {
                let (leaf, slot) = self.extend_item(UUID_TREE_OBJECTID, &key, 8)?;
                let d = self.item_data_mut(leaf, slot);
                let l = d.len();
                d[l - 8..].copy_from_slice(&id.to_le_bytes());
                Ok(())
            }
            None => self.insert_item(UUID_TREE_OBJECTID, &key, &id.to_le_bytes()),
        }
    }

    /// Make subvolume `id` the default, the tree a mount without subvol= shows (the
    /// "default" DIR_ITEM of the root tree directory).
    ///
    /// # Errors
    /// `Posix(NotFound)` for an id that is not a subvolume; tree failures.
    pub fn set_default_subvol(&mut self, id: u64) -> Result<()> {
        self.check_writable()?;
        if id != FS_TREE_OBJECTID && !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            return Err(Error::posix_detail(
                PosixKind::NotFound,
                format!("subvolume {id}"),
                "not a subvolume id",
            ));
        }
        self.live().read_root(id).map_err(|e| {
            if e.posix_kind() == Some(PosixKind::NotFound) {
                Error::posix_detail(
                    PosixKind::NotFound,
                    format!("subvolume {id}"),
                    "no such subvolume",
                )
            } else {
                e
            }
        })?;
        self.transaction("set_default_subvol", 1, |w| w.set_default_subvol_inner(id))
    }

    fn set_default_subvol_inner(&mut self, id: u64) -> Result<()> {
        let name = b"default";
        let key =
            Key::new(ROOT_TREE_DIR_OBJECTID, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(name));
        let mut entry = DirItem {
            location: Key::new(id, ROOT_ITEM_KEY, u64::MAX).to_disk(),
            transid: self.transid.into(),
            data_len: 0.into(),
            name_len: (name.len() as u16).into(),
            type_: FT_DIR,
        }
        .as_bytes()
        .to_vec();
        entry.extend_from_slice(name);
        if self.items_in_range(ROOT_TREE_OBJECTID, &key, &key)?.is_empty() {
            self.insert_item(ROOT_TREE_OBJECTID, &key, &entry)?;
        } else {
            self.replace_item(ROOT_TREE_OBJECTID, &key, &key, &entry)?;
        }
        // The superblock's flag saying a default subvolume may be set.
        let f = self.sb.incompat_flags.get() | ubtrfs_format::features::INCOMPAT_DEFAULT_SUBVOL;
        self.sb.incompat_flags = f.into();
        self.default_subvol = id;
        Ok(())
    }
}

/// The subvolume's top directory is inode 256 of its own tree.
pub fn subvol_top(id: u64) -> InodeId {
    InodeId { root: id, ino: FIRST_FREE_OBJECTID }
}
