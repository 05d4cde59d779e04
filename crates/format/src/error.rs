//! Corruption errors, structured and printed in the kernel's grammar:
//! `corrupt leaf: root=5 block=30408704 slot=3, invalid ...`.

use crate::key::Key;
use core::fmt;

/// Which object a corruption was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorruptWhere {
    Leaf,
    Node,
    Block,
    Super,
    SysChunkArray,
    Item,
    Data,
}

impl CorruptWhere {
    fn as_str(self) -> &'static str {
        match self {
            CorruptWhere::Leaf => "leaf",
            CorruptWhere::Node => "node",
            CorruptWhere::Block => "tree block",
            CorruptWhere::Super => "superblock",
            CorruptWhere::SysChunkArray => "sys_chunk_array",
            CorruptWhere::Item => "item",
            CorruptWhere::Data => "data",
        }
    }
}

/// A validation failure of on-disk bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrupt {
    pub what: CorruptWhere,
    pub root: Option<u64>,
    pub block: Option<u64>,
    pub slot: Option<u32>,
    pub key: Option<Key>,
    /// For data: inode, file offset and logical address of the bad sector.
    pub ino: Option<u64>,
    pub file_offset: Option<u64>,
    pub logical: Option<u64>,
    pub reason: String,
}

impl Corrupt {
    pub fn new(what: CorruptWhere, reason: impl Into<String>) -> Corrupt {
        Corrupt {
            what,
            root: None,
            block: None,
            slot: None,
            key: None,
            ino: None,
            file_offset: None,
            logical: None,
            reason: reason.into(),
        }
    }
    pub fn block(mut self, bytenr: u64) -> Self {
        self.block = Some(bytenr);
        self
    }
    pub fn root(mut self, root: u64) -> Self {
        self.root = Some(root);
        self
    }
    pub fn data(mut self, ino: u64, file_offset: u64, logical: u64) -> Self {
        self.ino = Some(ino);
        self.file_offset = Some(file_offset);
        self.logical = Some(logical);
        self
    }
    pub fn slot(mut self, slot: u32, key: Key) -> Self {
        self.slot = Some(slot);
        self.key = Some(key);
        self
    }
    /// The item's key, when its slot is not known (found by search, not by walking).
    pub fn key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }
    /// The inode the damaged item belongs to (an inode item, a file extent, a backref).
    pub fn ino(mut self, ino: u64) -> Self {
        self.ino = Some(ino);
        self
    }
}

impl fmt::Display for Corrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt {}:", self.what.as_str())?;
        let sep = " ";
        if let Some(r) = self.root {
            write!(f, "{sep}root={r}")?;
        }
        if let Some(b) = self.block {
            write!(f, "{sep}block={b}")?;
        }
        if let Some(s) = self.slot {
            write!(f, "{sep}slot={s}")?;
        }
        if let Some(k) = self.key {
            write!(f, "{sep}key={k}")?;
        }
        if let Some(i) = self.ino {
            write!(f, "{sep}ino={i}")?;
        }
        if let Some(o) = self.file_offset {
            write!(f, "{sep}offset={o}")?;
        }
        if let Some(l) = self.logical {
            write!(f, "{sep}logical={l}")?;
        }
        if self.root.is_some()
            || self.block.is_some()
            || self.slot.is_some()
            || self.key.is_some()
            || self.ino.is_some()
        {
            write!(f, ",")?;
        }
        write!(f, " {}", self.reason)
    }
}

impl std::error::Error for Corrupt {}

pub type Result<T> = core::result::Result<T, Corrupt>;
