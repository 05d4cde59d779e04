//! File extents as owned records (`FileExtentRec`): what the read view returns for the
//! EXTENT_DATA items of a range, what extent maps are built from and turned back into,
//! and what writeback and the page cache reason about (holes, inline, prealloc).

use ubtrfs_format::items::FileExtent;

/// One file extent item, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtentKind {
    Inline {
        ram_bytes: u64,
        compression: u8,
        data: Vec<u8>,
    },
    /// `disk_bytenr == 0` is an explicit hole.
    Regular {
        disk_bytenr: u64,
        disk_num_bytes: u64,
        offset: u64,
        num_bytes: u64,
        ram_bytes: u64,
        compression: u8,
        prealloc: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileExtentRec {
    pub file_offset: u64,
    /// Transaction that wrote the item.
    pub generation: u64,
    pub kind: ExtentKind,
}

impl FileExtentRec {
    /// The record of a parsed EXTENT_DATA item at file offset `file_offset`.
    pub fn new(file_offset: u64, fe: &FileExtent<'_>) -> FileExtentRec {
        let (generation, kind) = match *fe {
            FileExtent::Inline { generation, ram_bytes, compression, data } => {
                (generation, ExtentKind::Inline { ram_bytes, compression, data: data.to_vec() })
            }
            FileExtent::Regular {
                generation,
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
                ram_bytes,
                compression,
                prealloc,
            } => (
                generation,
                ExtentKind::Regular {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                    ram_bytes,
                    compression,
                    prealloc,
                },
            ),
        };
        FileExtentRec { file_offset, generation, kind }
    }
    /// Bytes of file this extent covers.
    pub fn len(&self) -> u64 {
        match &self.kind {
            ExtentKind::Inline { ram_bytes, .. } => *ram_bytes,
            ExtentKind::Regular { num_bytes, .. } => *num_bytes,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn end(&self) -> u64 {
        self.file_offset.saturating_add(self.len())
    }
    /// True if reading it yields zeros without touching the disk.
    pub fn is_hole_like(&self) -> bool {
        matches!(
            self.kind,
            ExtentKind::Regular { disk_bytenr: 0, .. } | ExtentKind::Regular { prealloc: true, .. }
        )
    }
}
