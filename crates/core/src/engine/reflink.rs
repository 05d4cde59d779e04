//! Clone and dedupe as the engine drives them: both files' locks (in inode order) and
//! writeback first, the tree work (`data::reflink`) in one transaction, the
//! destination's cached pages dropped after.

use crate::data::reflink::{Dedupe, MAX_DEDUPE_LEN};
use crate::engine::Engine;
use crate::error::{PosixKind, Result};
use crate::inode::filesystem::InodeId;

impl Engine {
    /// Clone `len` bytes (0: to the source's EOF) of file `src` at `src_off` into
    /// `dst` at `dst_off` (`FsWriter::clone_range`), with both files' locks held (in
    /// inode order) and both written back first; the destination's cached range is
    /// dropped after. Returns the bytes cloned.
    ///
    /// # Errors
    /// As `FsWriter::clone_range`; writeback errors.
    pub fn clone_range(
        &self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
    ) -> Result<u64> {
        self.remap_locked(
            src,
            dst,
            |e| e.write_retrying(|w| w.clone_range(src, src_off, len, dst, dst_off)),
            Some((dst_off, len)),
        )
    }

    /// copy_file_range's first try, as the kernel's `vfs_copy_file_range` asks
    /// `remap_file_range` with REMAP_FILE_CAN_SHORTEN: clone what of the `len` bytes
    /// can be cloned (to the source's EOF at most, whole blocks unless the range
    /// reaches that EOF and the destination's) and return the bytes cloned, or None
    /// when nothing can be (offsets off block boundaries, overlap in one file, one file
    /// checksummed and the other not): the caller copies then.
    ///
    /// # Errors
    /// Those of `clone_range` other than its refusals of the range.
    pub fn clone_for_copy(
        &self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
    ) -> Result<Option<u64>> {
        let bs = u64::from(self.info().sectorsize);
        let (ssize, dsize) = (self.getattr(src)?.size.get(), self.getattr(dst)?.size.get());
        if !src_off.is_multiple_of(bs) || !dst_off.is_multiple_of(bs) || src_off >= ssize {
            return Ok(None);
        }
        let mut n = len.min(ssize - src_off);
        if (src_off + n < ssize || dst_off + n < dsize) && !n.is_multiple_of(bs) {
            n = n / bs * bs;
        }
        if n == 0 {
            return Ok(None);
        }
        match self.clone_range(src, src_off, n, dst, dst_off) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.posix_kind() == Some(PosixKind::Invalid) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Dedupe: compare `len` bytes (at most `MAX_DEDUPE_LEN`) of `src` at `src_off`
    /// with `dst` at `dst_off` under both files' locks; when equal, share the source's
    /// extents into the destination (no times change) and report the bytes, else
    /// change nothing.
    ///
    /// # Errors
    /// As `FsWriter::clone_range`, with the dedupe rules for ranges at EOF (both must
    /// end at their file's end); read errors.
    pub fn dedupe_range(
        &self,
        src: InodeId,
        src_off: u64,
        len: u64,
        dst: InodeId,
        dst_off: u64,
    ) -> Result<Dedupe> {
        let len = len.min(MAX_DEDUPE_LEN);
        self.remap_locked(
            src,
            dst,
            |e| {
                let r =
                    e.write_retrying(|w| w.check_remap(src, src_off, len, dst, dst_off, true))?;
                if !e.same_bytes(src, src_off, dst, dst_off, r.len)? {
                    return Ok(Dedupe::Differs);
                }
                e.write_retrying(|w| w.remap(r, false))?;
                Ok(Dedupe::Same(r.len))
            },
            // Equal bytes stay: the destination's cached pages are still right.
            None,
        )
    }

    /// Whether `len` bytes of `a` at `ao` equal those of `b` at `bo` (both written
    /// back, their locks held): from the page cache where it holds them, as the
    /// kernel compares pages, else read (and verified) from the devices.
    fn same_bytes(&self, a: InodeId, ao: u64, b: InodeId, bo: u64, len: u64) -> Result<bool> {
        const STEP: u64 = 1 << 20;
        let (mut x, mut y) = (vec![0u8; STEP.min(len) as usize], vec![0u8; STEP.min(len) as usize]);
        let get = |id: InodeId, off: u64, buf: &mut [u8]| -> Result<bool> {
            if self.inodes().get(id).mapping.pages.lock().copy_uptodate(off, buf) {
                return Ok(true);
            }
            Ok(self.read_file(id, off, buf)? == buf.len())
        };
        let mut done = 0;
        while done < len {
            let n = (len - done).min(STEP) as usize;
            if !get(a, ao + done, &mut x[..n])?
                || !get(b, bo + done, &mut y[..n])?
                || x[..n] != y[..n]
            {
                return Ok(false);
            }
            done += n as u64;
        }
        Ok(true)
    }

    /// Run `f` with the locks of `src` and `dst` held exclusively (in inode order),
    /// after writing both back; then drop the destination's cached `changed` range
    /// (offset, length; 0 to EOF) if its content changed.
    fn remap_locked<T>(
        &self,
        src: InodeId,
        dst: InodeId,
        f: impl FnOnce(&Engine) -> Result<T>,
        changed: Option<(u64, u64)>,
    ) -> Result<T> {
        let (s, d) = (self.inodes.get(src), self.inodes.get(dst));
        let _g = crate::inode::file::write_lock_two(&s, Some(&d));
        if src != dst {
            self.before_extent_change(&s)?;
        }
        let cached = self.before_extent_change(&d)?;
        let r = f(self);
        if let (true, Some((dst_off, len))) = (cached, changed) {
            let end = if len == 0 { u64::MAX } else { dst_off.saturating_add(len) };
            self.after_extent_change(&d, dst_off, end)?;
        }
        r
    }
}
