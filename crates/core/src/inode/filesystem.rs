//! The filesystem view: subvolumes, inodes, directories, xattrs and symlinks.
//!
//! An inode is named by `InodeId { root, ino }` (the subvolume tree and the objectid in
//! it). A directory entry whose location is a ROOT_ITEM crosses into that subvolume's
//! root directory, which is where the kernel shows subvolumes and snapshots.
//! `load_inode` gathers an inode's items in one pass over its key range, because
//! INODE_ITEM, refs, xattrs, dir entries and file extents of one objectid are adjacent.

use crate::disk_io::{FsInfo, OpenOptions};
use crate::error::{Error, PosixKind, Result};
use crate::tree::search::RootInfo;
use crate::tree::search::{Search, TreeView};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::FromBytes;

pub use crate::ids::InodeId;
pub use crate::mapping::file_extent::{ExtentKind, FileExtentRec};

/// The POSIX file type of an inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    CharDev,
    BlockDev,
    Socket,
}

impl FileKind {
    pub fn from_mode(mode: u32) -> Option<FileKind> {
        Some(match mode & S_IFMT {
            S_IFREG => FileKind::File,
            S_IFDIR => FileKind::Dir,
            S_IFLNK => FileKind::Symlink,
            S_IFIFO => FileKind::Fifo,
            S_IFCHR => FileKind::CharDev,
            S_IFBLK => FileKind::BlockDev,
            S_IFSOCK => FileKind::Socket,
            _ => return None,
        })
    }
    /// The letter `ls -l` shows.
    pub fn letter(self) -> char {
        match self {
            FileKind::File => '-',
            FileKind::Dir => 'd',
            FileKind::Symlink => 'l',
            FileKind::Fifo => 'p',
            FileKind::CharDev => 'c',
            FileKind::BlockDev => 'b',
            FileKind::Socket => 's',
        }
    }
}

/// A directory entry, resolved to the inode it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub target: InodeId,
    /// The entry's file type (FT_*).
    pub ftype: u8,
    pub index: u64,
    /// True if the entry is a subvolume (location is a ROOT_ITEM).
    pub is_subvol: bool,
    /// `Some(id)` when the entry names subvolume `id` but this tree does not hold it:
    /// a snapshot's copy of the entry of a subvolume nested in its source, or the entry
    /// of a deleted subvolume. The kernel shows it as an empty, read-only directory
    /// (`btrfs_lookup_dentry` finds no ROOT_REF of this tree, directory and name, and
    /// calls `new_simple_dir`); `target` is then `InodeId::placeholder(tree)`.
    pub placeholder_of: Option<u64>,
}

impl DirEntry {
    /// Whether the entry leads to a placeholder (see `placeholder_of`).
    pub fn is_placeholder(&self) -> bool {
        self.placeholder_of.is_some()
    }
}

/// An inode with the items a caller asked for.
#[derive(Clone)]
pub struct InodeView {
    pub id: InodeId,
    pub item: InodeItem,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub extents: Vec<FileExtentRec>,
    pub entries: Vec<DirEntry>,
}

impl InodeView {
    pub fn mode(&self) -> u32 {
        self.item.mode.get()
    }
    pub fn kind(&self) -> FileKind {
        FileKind::from_mode(self.mode()).expect("mode validated by the tree checker")
    }
    pub fn size(&self) -> u64 {
        self.item.size.get()
    }
    pub fn nlink(&self) -> u32 {
        self.item.nlink.get()
    }
    pub fn flags(&self) -> u64 {
        self.item.flags.get()
    }
}

/// What `load_inode` should collect besides the INODE_ITEM.
#[derive(Clone, Copy, Debug, Default)]
pub struct Load {
    pub xattrs: bool,
    pub extents: bool,
    pub entries: bool,
}

impl Load {
    pub const ALL: Load = Load { xattrs: true, extents: true, entries: true };
    pub const ITEM: Load = Load { xattrs: false, extents: false, entries: false };
}

/// Items of one inode that `load_inode_salvage` could not read.
#[derive(Debug, Default)]
pub struct LoadDamage {
    /// Key ranges lost to unreadable tree blocks, in key order.
    pub lost: Vec<LostItems>,
    /// Directory entries that could not be resolved.
    pub bad_entries: Vec<BadEntry>,
}

/// A directory entry whose target could not be resolved (e.g. a subvolume without a
/// root item).
#[derive(Debug)]
pub struct BadEntry {
    pub name: Vec<u8>,
    /// The entry's file type (FT_*).
    pub ftype: u8,
    pub error: Error,
}

/// The keys `[from, to)` were in a tree block no copy of which could be read (`to`
/// None: up to the end of the inode's items). Some of them may belong to other inodes.
#[derive(Debug)]
pub struct LostItems {
    pub from: Key,
    pub to: Option<Key>,
    pub error: Error,
}

impl LoadDamage {
    pub fn is_empty(&self) -> bool {
        self.lost.is_empty() && self.bad_entries.is_empty()
    }

    /// The first loss that may hold items of inode `ino` with key type `type_`.
    pub fn lost_type(&self, ino: u64, type_: u8) -> Option<&LostItems> {
        self.lost.iter().find(|l| l.overlaps(ino, type_))
    }
}

impl LostItems {
    /// Whether the lost keys may include items of inode `ino` with key type `type_`.
    pub fn overlaps(&self, ino: u64, type_: u8) -> bool {
        let lo = Key::new(ino, type_, 0);
        let hi = Key::new(ino, type_, u64::MAX);
        self.from <= hi && self.to.is_none_or(|t| t > lo)
    }
}

/// A readable btrfs filesystem.
pub struct Filesystem {
    pub info: Arc<FsInfo>,
    /// The generation this view reads: the committed superblock when it was made.
    pub sb: Arc<Superblock>,
    roots: Mutex<HashMap<u64, (RootInfo, RootItem)>>,
    default_subvol: u64,
}

fn corrupt_inode(id: InodeId, reason: impl Into<String>) -> Error {
    let mut c = Corrupt::new(CorruptWhere::Item, reason).root(id.root);
    c.ino = Some(id.ino);
    c.into()
}

impl Filesystem {
    /// Open the image(s) named in `opts` for reading, a log tree replayed in memory
    /// unless `opts.no_log_replay` (`tree_log::open_with_log_replay`).
    ///
    /// # Errors
    /// As `open_with_log_replay`, plus a corrupt root tree directory.
    pub fn open(opts: &OpenOptions) -> Result<Filesystem> {
        Filesystem::from_info(crate::inode::tree_log::open_with_log_replay(opts)?)
    }

    /// Wrap an open `FsInfo`.
    ///
    /// # Errors
    /// `Corrupt`/`Io` reading the default subvolume entry.
    pub fn from_info(info: FsInfo) -> Result<Filesystem> {
        Filesystem::committed(Arc::new(info))
    }

    /// The generation committed in `info` now, as a view that stays on it (a later
    /// commit through a writer of the same `FsInfo` does not change what it reads).
    ///
    /// # Errors
    /// As `from_info`.
    pub fn committed(info: Arc<FsInfo>) -> Result<Filesystem> {
        let sb = info.super_copy();
        Filesystem::at(info, sb)
    }

    /// The generation superblock `sb` (committed in `info`) points at.
    ///
    /// # Errors
    /// As `from_info`.
    pub fn at(info: Arc<FsInfo>, sb: Arc<Superblock>) -> Result<Filesystem> {
        let mut fs = Filesystem {
            info,
            sb,
            roots: Mutex::new(HashMap::new()),
            default_subvol: FS_TREE_OBJECTID,
        };
        fs.default_subvol = crate::tree::search::find_default_subvol(&fs)?;
        Ok(fs)
    }
}

/// The committed view, with the roots it has looked up remembered (they cannot change
/// while it lives).
impl TreeView for Filesystem {
    type Node = std::sync::Arc<crate::disk_io::ExtentBuffer>;
    fn read_node(&self, bytenr: u64, expect: &crate::disk_io::Expect) -> Result<Self::Node> {
        self.info.read_tree_block(bytenr, expect)
    }
    fn tree_root(&self) -> RootInfo {
        crate::disk_io::super_tree_root(&self.sb)
    }
    fn chunk_root(&self) -> RootInfo {
        crate::disk_io::super_chunk_root(&self.sb)
    }
    fn read_root(&self, id: u64) -> Result<(RootInfo, RootItem)> {
        if let Some(r) = self.roots.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            return Ok(*r);
        }
        let r = crate::tree::search::root_from_root_tree(self, id)?;
        self.roots.lock().unwrap_or_else(|p| p.into_inner()).insert(id, r);
        Ok(r)
    }
}

impl FsRead for Filesystem {
    fn info(&self) -> &FsInfo {
        &self.info
    }
    fn default_subvol(&self) -> u64 {
        self.default_subvol
    }
}

/// The filesystem read API over a view: subvolumes, inodes, directories, symlinks and
/// (in `data::read`) file data. The same code reads a committed generation
/// (`Filesystem`) and the writer's running transaction (`FsWriter::live`), which sees
/// every change made through the writer.
pub trait FsRead: TreeView + Sized {
    /// The filesystem the view belongs to (devices, sizes, warnings).
    fn info(&self) -> &FsInfo;

    /// The subvolume mounted by default (`btrfs subvolume get-default`).
    fn default_subvol(&self) -> u64;

    /// Where subvolume tree `id` is rooted.
    ///
    /// # Errors
    /// `Posix(NotFound)` for an unknown tree.
    fn fs_root(&self, id: u64) -> Result<RootInfo> {
        Ok(self.read_root(id)?.0)
    }

    /// The root directory of the default subvolume.
    fn root_dir(&self) -> InodeId {
        InodeId { root: self.default_subvol(), ino: FIRST_FREE_OBJECTID }
    }

    /// Read an inode and, as asked, its xattrs, file extents and directory entries.
    ///
    /// # Errors
    /// `Posix(NotFound)` if there is no INODE_ITEM; `Corrupt`/`Io` otherwise.
    fn load_inode(&self, id: InodeId, load: Load) -> Result<InodeView> {
        load_inode_with(self, id, load, None)
    }

    /// `load_inode` for salvage: an unreadable tree block after the INODE_ITEM is
    /// stepped over and recorded in the returned `LoadDamage` instead of failing the
    /// whole inode, and so is a directory entry that cannot be resolved. The view holds
    /// every item that could be read.
    ///
    /// # Errors
    /// As `load_inode` when the INODE_ITEM itself cannot be read.
    fn load_inode_salvage(&self, id: InodeId, load: Load) -> Result<(InodeView, LoadDamage)> {
        let mut damage = LoadDamage::default();
        let v = load_inode_with(self, id, load, Some(&mut damage))?;
        Ok((v, damage))
    }

    /// List a directory in DIR_INDEX order.
    ///
    /// # Errors
    /// `Posix(NotDir)` for a non-directory.
    fn readdir(&self, dir: InodeId) -> Result<Vec<DirEntry>> {
        let v = self.load_inode(dir, Load { entries: true, ..Load::ITEM })?;
        if v.kind() != FileKind::Dir {
            return Err(Error::posix(PosixKind::NotDir, format!("inode {dir}")));
        }
        Ok(v.entries)
    }

    /// Look `name` up in directory `dir` via its DIR_ITEM hash.
    ///
    /// # Errors
    /// `Corrupt`/`Io` from the search.
    fn lookup(&self, dir: InodeId, name: &[u8]) -> Result<Option<DirEntry>> {
        let root = self.fs_root(dir.root)?;
        let key = Key::new(dir.ino, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(name));
        let Search::Found(path) = self.search_slot(&root, &key)? else {
            return Ok(None);
        };
        let item = path.item().expect("found slot is in the leaf");
        for e in items::dir_entries(item.data()) {
            let e = e.expect("validated by the tree checker");
            if e.name == name {
                return Ok(Some(dir_entry(self, dir, &e, 0)?));
            }
        }
        Ok(None)
    }

    /// The directory that holds directory `dir`, as `btrfs_get_parent` finds it: the
    /// parent its INODE_REF names, or, for a subvolume's top directory, the directory
    /// its ROOT_BACKREF names in the parent tree. None for the top-level tree's top
    /// directory (nothing holds it) and for a subvolume whose back reference is gone
    /// (deleted); a directory has one INODE_REF, the last one is taken as the kernel
    /// takes it.
    ///
    /// # Errors
    /// `Posix(NotFound)` for an unknown tree; `Corrupt`/`Io` from the searches.
    fn lookup_parent(&self, dir: InodeId) -> Result<Option<InodeId>> {
        let (tree, key) = if dir.ino == FIRST_FREE_OBJECTID {
            if dir.root == FS_TREE_OBJECTID {
                return Ok(None);
            }
            (self.tree_root(), Key::new(dir.root, ROOT_BACKREF_KEY, u64::MAX))
        } else {
            (self.fs_root(dir.root)?, Key::new(dir.ino, INODE_REF_KEY, u64::MAX))
        };
        let Some(item) = self.search_le(&tree, &key)? else { return Ok(None) };
        let k = item.key();
        if k.objectid != key.objectid || k.type_ != key.type_ {
            return Ok(None);
        }
        if k.type_ == ROOT_BACKREF_KEY {
            let r = items::root_ref(item.data()).expect("validated by the tree checker");
            return Ok(Some(InodeId { root: k.offset, ino: r.dirid }));
        }
        Ok(Some(InodeId { root: dir.root, ino: k.offset }))
    }

    /// Read a symlink's target, from the inline extent btrfs keeps it in
    /// (`btrfs_symlink` writes one; a compressed one is decoded), up to the symlink's
    /// size and at most 4096 bytes (PATH_MAX).
    ///
    /// # Errors
    /// `Posix(Invalid)` for a non-symlink; `Corrupt` if the target is not one inline
    /// extent at offset 0, or does not decompress.
    fn readlink(&self, id: InodeId) -> Result<Vec<u8>> {
        let v = self.load_inode(id, Load { extents: true, ..Load::ITEM })?;
        if v.kind() != FileKind::Symlink {
            return Err(Error::posix(PosixKind::Invalid, format!("inode {id} is not a symlink")));
        }
        let mut buf = vec![0u8; usize::try_from(v.size()).unwrap_or(usize::MAX).min(4096)];
        if buf.is_empty() {
            return Ok(buf);
        }
        let corrupt = |r: String| -> Error {
            Corrupt::new(CorruptWhere::Data, r).root(id.root).data(id.ino, 0, 0).into()
        };
        let Some(FileExtentRec {
            file_offset: 0,
            kind: ExtentKind::Inline { ram_bytes, compression, data },
            ..
        }) = v.extents.first()
        else {
            return Err(corrupt("the symlink's target is not an inline extent at offset 0".into()));
        };
        let plain = if *compression == 0 {
            std::borrow::Cow::Borrowed(data.as_slice())
        } else {
            let mut out = Vec::new();
            crate::compression::decompress_item(
                *compression,
                data,
                usize::try_from(*ram_bytes).unwrap_or(usize::MAX),
                self.info().sectorsize as usize,
                &mut out,
            )
            .map_err(corrupt)?;
            std::borrow::Cow::Owned(out)
        };
        let n = plain.len().min(buf.len());
        buf[..n].copy_from_slice(&plain[..n]);
        Ok(buf)
    }

    /// Resolve `path` (absolute or relative to the default subvolume's root; `/` splits).
    /// Symlinks in the middle are followed, relative to the directory holding them or to
    /// the image root when absolute; the last component is followed only if `follow`.
    ///
    /// # Errors
    /// `Posix` NotFound/NotDir/Loop naming the path.
    fn resolve(&self, path: &str, follow: bool) -> Result<InodeView> {
        let id = self.resolve_id(path, follow)?;
        self.load_inode(id, Load::ALL)
    }

    /// Split `path` into (parent directory, last name); the parent must exist and be a
    /// directory (symlinks on the way are followed, the last name is not): where a
    /// change to `path` (a create, a remove) happens.
    ///
    /// # Errors
    /// `Posix` Invalid for the top itself, NotFound / NotDir for the parent.
    fn resolve_parent(&self, path: &str) -> Result<(InodeId, Vec<u8>)> {
        let trimmed = path.trim_end_matches('/');
        let (dir, name) = match trimmed.rfind('/') {
            Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
            None => ("", trimmed),
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(Error::posix(
                PosixKind::Invalid,
                format!("{}: needs a name inside a directory", crate::quote::name(path.as_bytes())),
            ));
        }
        let parent = self.resolve_id(dir, true)?;
        if self.load_inode(parent, Load::ITEM)?.kind() != FileKind::Dir {
            return Err(Error::posix(PosixKind::NotDir, crate::quote::name(dir.as_bytes())));
        }
        Ok((parent, name.as_bytes().to_vec()))
    }

    /// `resolve` without loading the inode it ends at.
    ///
    /// # Errors
    /// As `resolve`.
    fn resolve_id(&self, path: &str, follow: bool) -> Result<InodeId> {
        let mut stack: Vec<InodeId> = vec![self.root_dir()];
        let mut pending: Vec<Vec<u8>> = split(path.as_bytes());
        pending.reverse();
        let mut links = 0;
        while let Some(comp) = pending.pop() {
            let cur = *stack.last().expect("stack holds the root");
            if comp == b"." {
                continue;
            }
            if comp == b".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            let Some(e) = self.lookup(cur, &comp)? else {
                return Err(Error::posix(PosixKind::NotFound, crate::quote::name(path.as_bytes())));
            };
            let is_last = pending.is_empty();
            if e.ftype == FT_SYMLINK && (!is_last || follow) {
                links += 1;
                if links > 40 {
                    return Err(Error::posix(PosixKind::Loop, crate::quote::name(path.as_bytes())));
                }
                let target = self.readlink(e.target)?;
                if target.first() == Some(&b'/') {
                    stack.truncate(1);
                }
                let mut parts = split(&target);
                parts.reverse();
                pending.extend(parts);
                continue;
            }
            if !is_last && e.ftype != FT_DIR {
                return Err(Error::posix(PosixKind::NotDir, crate::quote::name(path.as_bytes())));
            }
            stack.push(e.target);
        }
        Ok(*stack.last().expect("stack holds the root"))
    }

    /// The path of directory `ino` of tree `root` from that tree's top directory
    /// (empty for the top), following each directory's INODE_REF to its parent.
    ///
    /// # Errors
    /// `Corrupt` for a directory without a back reference, or a chain longer than any
    /// path can be (a loop); read failures.
    fn dir_path(&self, root: u64, ino: u64) -> Result<Vec<u8>> {
        let tree = self.fs_root(root)?;
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut cur = ino;
        // A path is at most PATH_MAX (4096) bytes, so at most 2048 components.
        for _ in 0..2048 {
            if cur == FIRST_FREE_OBJECTID {
                parts.reverse();
                return Ok(parts.join(&b'/'));
            }
            let item = self.iter(&tree, Key::new(cur, INODE_REF_KEY, 0))?.next_item()?;
            let Some(item) =
                item.filter(|i| i.key().objectid == cur && i.key().type_ == INODE_REF_KEY)
            else {
                return Err(Corrupt::new(
                    CorruptWhere::Item,
                    format!("directory {cur} has no INODE_REF"),
                )
                .root(root)
                .into());
            };
            let parent = item.key().offset;
            let first = items::inode_refs(item.data(), parent)
                .next()
                .expect("validated by the tree checker: at least one ref")
                .expect("validated by the tree checker");
            parts.push(first.name.to_vec());
            cur = parent;
        }
        Err(Corrupt::new(
            CorruptWhere::Item,
            format!("directory {ino}: its INODE_REF chain does not reach the top"),
        )
        .root(root)
        .into())
    }

    /// Every subvolume: (id, parent id, dirid in parent, name, path from the top).
    ///
    /// # Errors
    /// `Corrupt`/`Io` reading the root tree.
    fn subvolumes(&self) -> Result<Vec<SubvolInfo>> {
        let root = self.tree_root();
        let mut out = Vec::new();
        let mut it = self.iter(&root, Key::new(FIRST_FREE_OBJECTID, 0, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid > LAST_FREE_OBJECTID {
                break;
            }
            if k.type_ == ROOT_BACKREF_KEY {
                let r = items::root_ref(item.data()).expect("validated by the tree checker");
                out.push(SubvolInfo {
                    id: k.objectid,
                    parent: k.offset,
                    dirid: r.dirid,
                    name: r.name.to_vec(),
                });
            }
        }
        Ok(out)
    }

    /// The file extents of inode `id` that overlap `[from, to)`, in file order (an
    /// extent starting before `from` that reaches into the range included).
    ///
    /// # Errors
    /// `Corrupt` for a malformed or overlapping extent item; read failures.
    fn file_extents(&self, id: InodeId, from: u64, to: u64) -> Result<Vec<FileExtentRec>> {
        let root = self.fs_root(id.root)?;
        let mut start = Key::new(id.ino, EXTENT_DATA_KEY, from);
        if let Some(item) = self.search_le(&root, &start)? {
            let k = item.key();
            if k.objectid == id.ino && k.type_ == EXTENT_DATA_KEY {
                start = k;
            }
        }
        let mut out: Vec<FileExtentRec> = Vec::new();
        let mut it = self.iter(&root, start)?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid != id.ino || k.type_ != EXTENT_DATA_KEY || k.offset >= to {
                break;
            }
            let fe = items::file_extent(item.data()).map_err(|e| corrupt_inode(id, e))?;
            let rec = FileExtentRec::new(k.offset, &fe);
            if let Some(prev) = out.last() {
                if prev.end() > rec.file_offset {
                    return Err(corrupt_inode(
                        id,
                        format!(
                            "file extent at {} overlaps the previous one ending at {}",
                            rec.file_offset,
                            prev.end()
                        ),
                    ));
                }
            }
            if rec.end() > from {
                out.push(rec);
            }
        }
        Ok(out)
    }
}

/// The inode the kernel shows for a placeholder (`new_simple_dir`): a directory, mode
/// 0755, owned by root, one link, empty, no xattrs and no flags. The kernel stamps it
/// with the time of the lookup; we give it the time its tree was made (the snapshot's
/// otime, else its ctime), which is the same on every read.
fn placeholder_view<V: FsRead>(fs: &V, id: InodeId) -> Result<InodeView> {
    let (_, ri) = fs.read_root(id.root)?;
    let t = if ri.otime.sec.get() != 0 { ri.otime } else { ri.ctime };
    let mut ii = <InodeItem as zerocopy::FromZeros>::new_zeroed();
    ii.mode = (S_IFDIR | 0o755).into();
    ii.nlink = 1.into();
    ii.atime = t;
    ii.mtime = t;
    ii.ctime = t;
    ii.otime = t;
    Ok(InodeView { id, item: ii, xattrs: Vec::new(), extents: Vec::new(), entries: Vec::new() })
}

fn load_inode_with<V: FsRead>(
    fs: &V,
    id: InodeId,
    load: Load,
    mut damage: Option<&mut LoadDamage>,
) -> Result<InodeView> {
    if id.is_placeholder() {
        return placeholder_view(fs, id);
    }
    let root = fs.fs_root(id.root)?;
    let mut it = fs.iter(&root, Key::new(id.ino, INODE_ITEM_KEY, 0))?;
    let mut view: Option<InodeView> = None;
    loop {
        let item = match it.next_item() {
            Ok(Some(item)) => item,
            Ok(None) => break,
            Err(e) => {
                // Without the INODE_ITEM there is nothing to salvage.
                let (Some(d), Some(_)) = (damage.as_deref_mut(), view.as_ref()) else {
                    return Err(e);
                };
                match it.skip_unreadable() {
                    // The block starts past this inode: nothing of it was lost.
                    Some(from) if from.objectid > id.ino => break,
                    Some(from) => {
                        // Two bad blocks in a row: the first loss ends where the second begins.
                        if let Some(prev) = d.lost.last_mut() {
                            prev.to.get_or_insert(from);
                        }
                        d.lost.push(LostItems { from, to: None, error: e });
                        continue;
                    }
                    None => {
                        let from = Key::new(id.ino, INODE_ITEM_KEY, 0);
                        d.lost.push(LostItems { from, to: None, error: e });
                        break;
                    }
                }
            }
        };
        let k = item.key();
        if let Some(last) = damage.as_deref_mut().and_then(|d| d.lost.last_mut()) {
            last.to.get_or_insert(k);
        }
        if k.objectid != id.ino {
            break;
        }
        let Some(v) = view.as_mut() else {
            if k.type_ != INODE_ITEM_KEY {
                break;
            }
            let ii = InodeItem::read_from_bytes(item.data())
                .expect("size validated by the tree checker");
            view = Some(InodeView {
                id,
                item: ii,
                xattrs: Vec::new(),
                extents: Vec::new(),
                entries: Vec::new(),
            });
            if !(load.xattrs || load.extents || load.entries) {
                break;
            }
            continue;
        };
        match k.type_ {
            XATTR_ITEM_KEY if load.xattrs => {
                for e in items::dir_entries(item.data()) {
                    let e = e.expect("validated by the tree checker");
                    v.xattrs.push((e.name.to_vec(), e.data.to_vec()));
                }
            }
            DIR_INDEX_KEY if load.entries => {
                for e in items::dir_entries(item.data()) {
                    let e = e.expect("validated by the tree checker");
                    match (dir_entry(fs, id, &e, k.offset), damage.as_deref_mut()) {
                        (Ok(de), _) => v.entries.push(de),
                        (Err(error), Some(d)) => d.bad_entries.push(BadEntry {
                            name: e.name.to_vec(),
                            ftype: e.type_,
                            error,
                        }),
                        (Err(err), None) => return Err(err),
                    }
                }
            }
            EXTENT_DATA_KEY if load.extents => {
                let fe = items::file_extent(item.data()).expect("validated by the tree checker");
                let rec = FileExtentRec::new(k.offset, &fe);
                if let Some(prev) = v.extents.last() {
                    if prev.end() > rec.file_offset {
                        return Err(corrupt_inode(
                            id,
                            format!(
                                "file extent at {} overlaps the previous one ending at {}",
                                rec.file_offset,
                                prev.end()
                            ),
                        ));
                    }
                }
                v.extents.push(rec);
            }
            // Items past the extents cannot be ones we want.
            t if t > EXTENT_DATA_KEY => break,
            _ => {}
        }
    }
    view.ok_or_else(|| Error::posix(PosixKind::NotFound, format!("inode {id}")))
}

fn dir_entry<V: FsRead>(
    fs: &V,
    dir: InodeId,
    e: &items::DirEntry<'_>,
    index: u64,
) -> Result<DirEntry> {
    let (target, is_subvol, placeholder_of) = match e.location.type_ {
        INODE_ITEM_KEY => (InodeId { root: dir.root, ino: e.location.objectid }, false, None),
        ROOT_ITEM_KEY => {
            let id = e.location.objectid;
            match subvol_root_dir(fs, dir, e.name, id)? {
                Some(ino) => (InodeId { root: id, ino }, true, None),
                None => (InodeId::placeholder(dir.root), true, Some(id)),
            }
        }
        _ => return Err(corrupt_inode(dir, format!("dir entry location {}", e.location))),
    };
    Ok(DirEntry { name: e.name.to_vec(), target, ftype: e.type_, index, is_subvol, placeholder_of })
}

/// The root directory of subvolume `id` when entry `name` of directory `dir` really
/// holds it, or None for a placeholder, as `btrfs_lookup_dentry` decides
/// (`fixup_tree_root_location`): the root tree must have the ROOT_REF of `dir`'s tree
/// to `id` naming this directory and name, and the subvolume's ROOT_ITEM must exist.
/// A snapshot copies its source's entries of nested subvolumes but gets no ROOT_REF
/// for them; a deleted subvolume's ROOT_REF goes with it.
///
/// # Errors
/// Read failures of the root tree.
fn subvol_root_dir<V: FsRead>(fs: &V, dir: InodeId, name: &[u8], id: u64) -> Result<Option<u64>> {
    let key = Key::new(dir.root, ROOT_REF_KEY, id);
    let Search::Found(path) = fs.search_slot(&fs.tree_root(), &key)? else {
        return Ok(None);
    };
    let item = path.item().expect("found slot is in the leaf");
    let r = items::root_ref(item.data()).expect("validated by the tree checker");
    if r.dirid != dir.ino || r.name != name {
        return Ok(None);
    }
    match fs.read_root(id) {
        Ok((_, v)) => Ok(Some(v.root_dirid.get())),
        Err(err) if err.posix_kind() == Some(PosixKind::NotFound) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A subvolume's place in the tree (from its ROOT_BACKREF).
#[derive(Clone, Debug)]
pub struct SubvolInfo {
    pub id: u64,
    pub parent: u64,
    pub dirid: u64,
    pub name: Vec<u8>,
}

fn split(p: &[u8]) -> Vec<Vec<u8>> {
    p.split(|&b| b == b'/').filter(|c| !c.is_empty()).map(|c| c.to_vec()).collect()
}

impl FsRead for crate::transaction::Live<'_> {
    fn info(&self) -> &FsInfo {
        self.fs_info()
    }
    fn default_subvol(&self) -> u64 {
        crate::transaction::Live::default_subvol(self)
    }
}
