//! The one seam to storage: `BlockDevice`. Files, block devices and in-memory images
//! implement it; tests wrap it to inject faults. Reads are exact: a read past the end
//! is an error naming the device and range, never a short buffer.
//!
//! `FileDevice::open` settles who else uses the device first (`device_lock`): a writer
//! holds an exclusive lock until the device is dropped and is refused when another
//! ubtrfs process or the kernel uses it; a reader holds a shared lock, or goes on
//! without one and reports why (`in_use`). `MemDevice` needs no lock.

use crate::error::{Error, PosixKind, Result};
use crate::volumes::device_lock::InUse;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub trait BlockDevice: Send + Sync {
    /// Fill `buf` from byte `offset`.
    ///
    /// # Errors
    /// I/O errors, including reads past the end of the device.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    /// Write `buf` at byte `offset`.
    ///
    /// # Errors
    /// I/O errors, including writes past the end of the device.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Make every completed write durable.
    ///
    /// # Errors
    /// I/O errors from the flush.
    fn flush(&self) -> Result<()>;
    fn size(&self) -> u64;
    /// A name for messages (the path).
    fn name(&self) -> &str;
    /// Start writing back `[offset, offset + len)` now without waiting, so a later
    /// `flush` finds less to do (the kernel writes back while the writer goes on).
    /// A hint only, which a device may gather with later ones (a file starts its
    /// buffered data in batches); the default does nothing.
    fn start_writeback(&self, _offset: u64, _len: u64) {}
    /// Write bulk data, bypassing the host page cache where the device allows it
    /// (buffer, length and offset 4 KiB aligned); otherwise a plain `write_at`.
    ///
    /// # Errors
    /// As `write_at`.
    fn write_data_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write_at(buf, offset)
    }
    /// Make `[offset, offset + len)` read as zeros. The default writes zeros; an image
    /// file punches a hole instead, so the range takes no space on the host.
    ///
    /// # Errors
    /// As `write_at`.
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        write_zeros(self, offset, len)
    }
    /// Settle the device before a long-lived holder's last commit (a mount's, at its
    /// unmount): hold it against new opens until it is dropped where it can, and say
    /// whether the kernel uses it now (then nothing may be written). The default, for
    /// devices nobody else can open, finds nothing.
    fn claim_for_last_commit(&self) -> LastCommitClaim {
        LastCommitClaim::default()
    }
    /// Give up the hold `claim_for_last_commit` took, when it was not the last commit
    /// after all (the mount is still there): others' opens go on at once again.
    fn release_claim(&self) {}
    /// Whether the device takes discards, and the smallest range one frees (the
    /// kernel's `bdev_max_discard_sectors` and `bdev_discard_granularity`); None when
    /// it takes none. The default takes none.
    fn discard_granularity(&self) -> Option<u64> {
        None
    }
    /// Tell the device that nothing in `[offset, offset + len)` will be read again
    /// before it is written (the kernel's `blkdev_issue_discard`): an image file
    /// punches a hole there, so the host takes the space back, and a block device gets
    /// BLKDISCARD. What the range reads afterwards is the device's choice (zeros, or
    /// the old bytes). The caller (`space::trim`) discards only free space, never a
    /// superblock copy.
    ///
    /// # Errors
    /// `Posix(NotSupported)` when the device takes no discards; `Posix(ReadOnly)` for
    /// a device opened read-only; I/O errors, including ranges past the end.
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let _ = (offset, len);
        Err(Error::posix_detail(
            PosixKind::NotSupported,
            self.name().to_string(),
            "the device takes no discards",
        ))
    }
}

/// What `BlockDevice::claim_for_last_commit` found.
#[derive(Debug, Default)]
pub struct LastCommitClaim {
    /// Why new opens of the device do not wait for its release (None: they do).
    pub not_held: Option<String>,
    /// The kernel's uses of the device now (a loop device over the image, mounted).
    pub kernel: Vec<InUse>,
}

/// Write zeros over `[offset, offset + len)`, a MiB at a time.
fn write_zeros<D: BlockDevice + ?Sized>(dev: &D, offset: u64, len: u64) -> Result<()> {
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut at = offset;
    while at < offset + len {
        let n = (offset + len - at).min(zeros.len() as u64) as usize;
        dev.write_at(&zeros[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Data writes from this size on bypass the host's page cache (O_DIRECT).
pub const DIRECT_IO_MIN: usize = 256 << 10;

/// Buffered data bytes gathered before their writeback is started: one
/// `sync_file_range` per small write would submit each block as its own request.
pub const WRITEBACK_BATCH: u64 = 8 << 20;

/// Alignment O_DIRECT writes need (buffer address, length and offset).
pub const DIRECT_IO_ALIGN: usize = 4096;

/// Largest data write buffer a thread keeps between writes (`with_io_buf`).
pub const IO_BUF_KEEP: usize = 8 << 20;

thread_local! {
    static IO_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Run `f` on a buffer of `len` bytes aligned for O_DIRECT, whose bytes are left from
/// earlier use: `f` writes every byte it hands on. Up to `IO_BUF_KEEP` bytes it is the
/// calling thread's own buffer, kept between calls: a fresh allocation per write
/// costs a page fault per 4 KiB page touched, more than the copy into it. (A call
/// from inside `f` gets a buffer of its own.)
pub fn with_io_buf<T>(len: usize, f: impl FnOnce(&mut [u8]) -> T) -> T {
    let keep = len <= IO_BUF_KEEP;
    let mut raw = if keep { IO_BUF.with(std::cell::Cell::take) } else { Vec::new() };
    if raw.len() < len + DIRECT_IO_ALIGN {
        raw.resize(len + DIRECT_IO_ALIGN, 0);
    }
    let skew = raw.as_ptr().align_offset(DIRECT_IO_ALIGN).min(DIRECT_IO_ALIGN);
    let r = f(&mut raw[skew..skew + len]);
    if keep {
        IO_BUF.with(|c| {
            let held = c.take();
            c.set(if held.len() >= raw.len() { held } else { raw });
        });
    }
    r
}

/// A regular file or block device opened with positional I/O.
pub struct FileDevice {
    file: File,
    size: u64,
    name: String,
    writable: bool,
    /// A second descriptor with O_DIRECT for bulk data, opened on first use; None when
    /// the host filesystem refuses it (tmpfs), which falls back to buffered writes, or
    /// once `claim_for_last_commit` closed it (a lease wants a single open).
    direct: RwLock<Option<Option<File>>>,
    /// `claim_for_last_commit` holds a lease on `file`.
    leased: std::sync::atomic::AtomicBool,
    /// Buffered data written since writeback was last started, and the range it
    /// spans: writeback starts once a batch has gathered (`WRITEBACK_BATCH`).
    unstarted: std::sync::Mutex<(u64, u64, u64)>,
    /// Files kept open only for their flock locks (a loop device's backing file).
    _lock_files: Vec<File>,
    in_use: Vec<InUse>,
    warnings: Vec<String>,
}

impl FileDevice {
    /// Open `path` read-only (or read-write), locked against other ubtrfs processes
    /// (shared for reading, exclusive for writing) until the device is dropped.
    ///
    /// # Errors
    /// I/O errors naming the path; for writing, `Posix(Busy)` when another ubtrfs
    /// process has it open, the kernel has it mounted or another program holds it
    /// exclusively.
    pub fn open(path: &Path, writable: bool) -> Result<FileDevice> {
        let c = crate::volumes::device_lock::open(path, writable)?;
        let file = c.file;
        // Block devices report size 0 in metadata; seeking to the end works for both.
        let size = {
            use std::io::Seek;
            let mut f = &file;
            f.seek(std::io::SeekFrom::End(0))
                .map_err(|e| Error::io(format!("cannot size {}", path.display()), e))?
        };
        Ok(FileDevice {
            file,
            size,
            name: path.display().to_string(),
            writable,
            direct: RwLock::new(None),
            leased: std::sync::atomic::AtomicBool::new(false),
            unstarted: std::sync::Mutex::new((0, u64::MAX, 0)),
            _lock_files: c.lock_files,
            in_use: c.in_use,
            warnings: c.warnings,
        })
    }
    /// Who else was using the device when a reader opened it (a writer is refused instead).
    pub fn in_use(&self) -> &[InUse] {
        &self.in_use
    }
    /// Warnings from the open for the user, besides `in_use` (each of which the caller
    /// reports with `InUse::reader_warning`).
    pub fn open_warnings(&self) -> &[String] {
        &self.warnings
    }
    pub fn path(&self) -> PathBuf {
        PathBuf::from(&self.name)
    }
}

fn check_range(name: &str, offset: u64, len: usize, size: u64) -> Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::io(
            format!("{name}: access [{offset}, +{len}) beyond end of device ({size} bytes)"),
            std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
        )),
    }
}

impl BlockDevice for FileDevice {
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(&self.name, offset, len as usize, self.size)?;
        use std::os::unix::io::AsRawFd;
        let regular = self.file.metadata().map(|m| m.is_file()).unwrap_or(false);
        if regular {
            // SAFETY: fallocate on a descriptor this device owns, within its size.
            let r = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r == 0 {
                return Ok(());
            }
            // A host filesystem without hole punching: write the zeros.
        }
        write_zeros(self, offset, len)
    }
    fn discard_granularity(&self) -> Option<u64> {
        use std::os::unix::fs::FileTypeExt;
        let md = self.file.metadata().ok()?;
        if md.file_type().is_block_device() {
            return blockdev_discard_granularity(&md);
        }
        if !md.is_file() {
            return None;
        }
        // A regular file discards by punching holes, as the kernel's loop driver
        // does; its granularity is the host filesystem's block (loop's
        // `loop_config_discard`). Whether the host punches holes at all is asked
        // with a punch past the end of the file, which frees nothing; a device
        // opened read-only cannot ask, and discards nothing anyway.
        use std::os::unix::io::AsRawFd;
        let fd = self.file.as_raw_fd();
        if self.writable {
            // SAFETY: fallocate on a descriptor this device owns, past its end, with
            // KEEP_SIZE: no byte of the file changes.
            let r = unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    md.len() as libc::off_t,
                    4096,
                )
            };
            if r != 0 {
                return None;
            }
        }
        // SAFETY: fstatfs fills the struct it is given, on a descriptor we own.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let bsize =
            if unsafe { libc::fstatfs(fd, &mut st) } == 0 { st.f_bsize as u64 } else { 4096 };
        Some(bsize.max(512))
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        use std::os::unix::fs::FileTypeExt;
        use std::os::unix::io::AsRawFd;
        let l = usize::try_from(len).map_err(|_| {
            Error::posix_detail(
                PosixKind::Invalid,
                self.name.clone(),
                format!("discard of {len} bytes at {offset}"),
            )
        })?;
        check_range(&self.name, offset, l, self.size)?;
        if !self.writable {
            return Err(Error::posix_detail(
                PosixKind::ReadOnly,
                self.name.clone(),
                "opened read-only",
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let md =
            self.file.metadata().map_err(|e| Error::io(format!("{}: discard", self.name), e))?;
        let fd = self.file.as_raw_fd();
        let r = if md.file_type().is_block_device() {
            let range: [u64; 2] = [offset, len];
            // SAFETY: BLKDISCARD reads two u64 (start, length) from the pointer given.
            unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) }
        } else if md.is_file() {
            // SAFETY: fallocate on a descriptor this device owns, within its size.
            unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            }
        } else {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                self.name.clone(),
                "the device takes no discards",
            ));
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => Err(Error::posix_detail(
                PosixKind::NotSupported,
                self.name.clone(),
                "the device takes no discards",
            )),
            _ => Err(Error::io(format!("{}: discard of {len} bytes at {offset}", self.name), e)),
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(&self.name, offset, buf.len(), self.size)?;
        self.file.read_exact_at(buf, offset).map_err(|e| {
            Error::io(format!("{}: read of {} bytes at {offset}", self.name, buf.len()), e)
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.name, offset, buf.len(), self.size)?;
        self.file.write_all_at(buf, offset).map_err(|e| {
            Error::io(format!("{}: write of {} bytes at {offset}", self.name, buf.len()), e)
        })
    }
    fn flush(&self) -> Result<()> {
        *self.unstarted.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            (0, u64::MAX, 0);
        self.file.sync_data().map_err(|e| Error::io(format!("{}: flush", self.name), e))
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn write_data_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.name, offset, buf.len(), self.size)?;
        let aligned = (buf.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN)
            && buf.len().is_multiple_of(DIRECT_IO_ALIGN)
            && offset.is_multiple_of(DIRECT_IO_ALIGN as u64);
        // Small writes go through the host's page cache: a synchronous O_DIRECT write
        // per 4 KiB block costs a device round trip each, and the commit's flush makes
        // buffered data durable all the same.
        if aligned && self.writable && buf.len() >= DIRECT_IO_MIN {
            if self.direct.read().unwrap_or_else(std::sync::PoisonError::into_inner).is_none() {
                let mut d = self.direct.write().unwrap_or_else(std::sync::PoisonError::into_inner);
                if d.is_none() {
                    use std::os::unix::fs::OpenOptionsExt;
                    *d = Some(
                        std::fs::OpenOptions::new()
                            .write(true)
                            .custom_flags(libc::O_DIRECT)
                            .open(&self.name)
                            .ok(),
                    );
                }
            }
            let direct = self.direct.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(Some(f)) = direct.as_ref() {
                match f.write_all_at(buf, offset) {
                    // Nothing of it waits in the page cache.
                    Ok(()) => return Ok(()),
                    // Some hosts accept O_DIRECT at open and refuse the write.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!(
                                "{}: direct write of {} bytes at {offset}",
                                self.name,
                                buf.len()
                            ),
                            e,
                        ))
                    }
                }
            }
        }
        self.write_at(buf, offset)?;
        let mut u = self.unstarted.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        u.0 += buf.len() as u64;
        u.1 = u.1.min(offset);
        u.2 = u.2.max(offset + buf.len() as u64);
        Ok(())
    }

    fn claim_for_last_commit(&self) -> LastCommitClaim {
        let mut c = LastCommitClaim::default();
        // A block device is opened O_EXCL by a writer: the kernel cannot mount it.
        let md = match self.file.metadata() {
            Ok(md) if md.is_file() && self.writable => md,
            Ok(_) => return c,
            Err(e) => {
                c.not_held = Some(format!("cannot look at {}: {e}", self.name));
                return c;
            }
        };
        // The lease wants our descriptor to be the file's only open; bulk data goes
        // through the buffered one while it is held. (Taken again over a lease that an
        // opener is breaking, it would fail: the opener counts as an open already.)
        *self.direct.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(None);
        if !self.leased.load(std::sync::atomic::Ordering::Acquire) {
            match crate::volumes::device_lock::hold_opens(&self.file) {
                Ok(()) => self.leased.store(true, std::sync::atomic::Ordering::Release),
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    c.not_held = Some("another process has it open".into())
                }
                Err(e) => c.not_held = Some(e.to_string()),
            }
        }
        c.kernel = crate::volumes::device_lock::kernel_use_of_file(&self.name, &md, true);
        c
    }

    fn release_claim(&self) {
        if self.leased.swap(false, std::sync::atomic::Ordering::AcqRel) {
            crate::volumes::device_lock::release_opens(&self.file);
        }
        let mut d = self.direct.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if matches!(*d, Some(None)) {
            // Opened again on the next bulk write (None there: not tried yet).
            *d = None;
        }
    }

    fn start_writeback(&self, _offset: u64, _len: u64) {
        use std::os::fd::AsRawFd;
        let (from, to) = {
            let mut u = self.unstarted.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if u.0 < WRITEBACK_BATCH {
                return;
            }
            let r = (u.1, u.2);
            *u = (0, u64::MAX, 0);
            r
        };
        // SAFETY: plain syscall on an open descriptor; failure only loses the hint.
        unsafe {
            libc::sync_file_range(
                self.file.as_raw_fd(),
                from as libc::off64_t,
                (to - from) as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
}

/// BLKDISCARD, `_IO(0x12, 119)`: discard a byte range (start, length) of a block
/// device.
const BLKDISCARD: libc::c_ulong = 0x1277;

/// A block device's discard granularity from sysfs (`queue/discard_granularity`), or
/// None when its `queue/discard_max_bytes` is 0 (no discard). A partition's queue is
/// its disk's, one directory up.
fn blockdev_discard_granularity(md: &std::fs::Metadata) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let rdev = md.rdev();
    let dir = format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev));
    let read = |name: &str| -> Option<u64> {
        [format!("{dir}/queue/{name}"), format!("{dir}/../queue/{name}")]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse().ok())
    };
    match read("discard_max_bytes")? {
        0 => None,
        _ => Some(read("discard_granularity").unwrap_or(512).max(512)),
    }
}

/// An in-memory device (tests, fuzzing). It takes discards (granularity 4 KiB, as a
/// loop device over a file on a 4 KiB-block filesystem): the range reads as zeros
/// afterwards, and the device keeps the list of ranges discarded (`discarded`).
#[cfg(any(test, feature = "test-hooks"))]
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    name: String,
    discards: std::sync::Mutex<Vec<(u64, u64)>>,
}

#[cfg(any(test, feature = "test-hooks"))]
impl MemDevice {
    pub fn new(data: Vec<u8>, name: impl Into<String>) -> MemDevice {
        MemDevice {
            data: RwLock::new(data),
            name: name.into(),
            discards: std::sync::Mutex::new(Vec::new()),
        }
    }
    /// Every range discarded so far (offset, length), in the order discarded.
    pub fn discarded(&self) -> Vec<(u64, u64)> {
        self.discards.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn into_inner(self) -> Vec<u8> {
        self.data.into_inner().unwrap_or_else(|p| p.into_inner())
    }
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl BlockDevice for MemDevice {
    fn discard_granularity(&self) -> Option<u64> {
        Some(4096)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let mut d = self.data.write().unwrap_or_else(|p| p.into_inner());
        let l = usize::try_from(len).map_err(|_| {
            Error::posix_detail(
                PosixKind::Invalid,
                self.name.clone(),
                format!("discard of {len} bytes at {offset}"),
            )
        })?;
        check_range(&self.name, offset, l, d.len() as u64)?;
        let o = offset as usize;
        d[o..o + l].fill(0);
        self.discards.lock().unwrap_or_else(|p| p.into_inner()).push((offset, len));
        Ok(())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let d = self.data.read().unwrap_or_else(|p| p.into_inner());
        check_range(&self.name, offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let mut d = self.data.write().unwrap_or_else(|p| p.into_inner());
        check_range(&self.name, offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        d[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.data.read().unwrap_or_else(|p| p.into_inner()).len() as u64
    }
    fn name(&self) -> &str {
        &self.name
    }
}

/// A device whose writes stay in memory over a device opened read-only: reads see
/// them, the device below never does. A read-only open of an image with a log tree
/// replays the log through it (`inode::tree_log`), so readers see what a kernel mount
/// would show while the image stays byte for byte as it was. Writes are kept in 4 KiB
/// pages; the replay of a log writes a few tree paths, so the pages stay few.
pub struct OverlayDevice {
    below: Arc<dyn BlockDevice>,
    pages: RwLock<std::collections::BTreeMap<u64, Box<[u8]>>>,
}

/// The page size of `OverlayDevice`.
const OVERLAY_PAGE: u64 = 4096;

impl OverlayDevice {
    pub fn new(below: Arc<dyn BlockDevice>) -> OverlayDevice {
        OverlayDevice { below, pages: RwLock::new(Default::default()) }
    }
}

impl BlockDevice for OverlayDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self.below.name(), offset, buf.len(), self.below.size())?;
        let pages = self.pages.read().unwrap_or_else(|p| p.into_inner());
        let end = offset + buf.len() as u64;
        // Runs of pages not written here come from below in one read each.
        let mut at = offset;
        while at < end {
            let page = at - at % OVERLAY_PAGE;
            let in_page = (at - page) as usize;
            let n = ((page + OVERLAY_PAGE).min(end) - at) as usize;
            let b = (at - offset) as usize;
            if let Some(p) = pages.get(&page) {
                buf[b..b + n].copy_from_slice(&p[in_page..in_page + n]);
                at += n as u64;
                continue;
            }
            let mut run_end = (page + OVERLAY_PAGE).min(end);
            while run_end < end && !pages.contains_key(&run_end) {
                run_end = (run_end + OVERLAY_PAGE).min(end);
            }
            let l = (run_end - at) as usize;
            self.below.read_at(&mut buf[b..b + l], at)?;
            at = run_end;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(self.below.name(), offset, buf.len(), self.below.size())?;
        let mut pages = self.pages.write().unwrap_or_else(|p| p.into_inner());
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            let page = at - at % OVERLAY_PAGE;
            let in_page = (at - page) as usize;
            let n = ((page + OVERLAY_PAGE).min(end) - at) as usize;
            let p = match pages.entry(page) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let mut p = vec![0u8; OVERLAY_PAGE as usize].into_boxed_slice();
                    if n < OVERLAY_PAGE as usize {
                        let len = (self.below.size() - page).min(OVERLAY_PAGE) as usize;
                        self.below.read_at(&mut p[..len], page)?;
                    }
                    e.insert(p)
                }
            };
            let b = (at - offset) as usize;
            p[in_page..in_page + n].copy_from_slice(&buf[b..b + n]);
            at += n as u64;
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.below.size()
    }
    fn name(&self) -> &str {
        self.below.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes through an overlay read back at any offset and length, across pages and
    /// runs of pages not written, and the device below keeps its bytes.
    #[test]
    fn overlay_reads_its_writes_and_leaves_the_device_below() {
        let base: Vec<u8> = (0..40_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let below = Arc::new(MemDevice::new(base.clone(), "below"));
        let o = OverlayDevice::new(below.clone());
        let mut model = base.clone();
        for (off, len, fill) in
            [(5000u64, 100usize, 1u8), (8190, 9000, 2), (0, 1, 3), (39_990, 10, 4)]
        {
            let data = vec![fill; len];
            o.write_at(&data, off).expect("write");
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        for (off, len) in
            [(0u64, 40_000usize), (4000, 5000), (8191, 3), (12_000, 20_000), (39_999, 1)]
        {
            let mut buf = vec![0u8; len];
            o.read_at(&mut buf, off).expect("read");
            assert_eq!(buf, model[off as usize..off as usize + len], "read {off} +{len}");
        }
        assert_eq!(below.snapshot(), base, "the device below was written");
        let mut b = [0u8; 2];
        assert!(o.read_at(&mut b, 39_999).is_err(), "a read past the end succeeded");
        assert!(o.write_at(&b, 39_999).is_err(), "a write past the end succeeded");
    }
}
