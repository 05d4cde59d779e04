//! Streaming a whole file in order with its reads, checksum checks and decompression
//! spread over worker threads (the userspace counterpart of the kernel's readahead
//! plus its parallel end-io workers).
//!
//! Worker i reads chunks i, i+T, i+2T, ... into its own bounded channel; the caller's
//! thread takes chunk k from worker k mod T, so output order is the file's order and
//! memory is bounded by T × (DEPTH + 1) chunks whatever the file size.

use crate::data::read::DecompressCache;
use crate::data::read::FileRead;
use crate::error::Result;
use crate::inode::filesystem::{Filesystem, InodeView};
use std::sync::mpsc::sync_channel;

/// Chunks each worker may have ready ahead of the consumer.
const DEPTH: usize = 2;

impl Filesystem {
    /// Feed the file's contents to `sink` in order, `chunk` bytes at a time, using
    /// `threads` readers (1 = read in the caller's thread).
    ///
    /// # Errors
    /// The first read error in file order, or the sink's error.
    pub fn stream_file(
        &self,
        inode: &InodeView,
        threads: usize,
        chunk: usize,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        assert!(chunk > 0, "chunk size 0");
        let size = inode.size();
        let nchunks = size.div_ceil(chunk as u64);
        if threads <= 1 || nchunks <= 1 {
            let mut buf = vec![0u8; chunk.min(size as usize).max(1)];
            let mut cache = DecompressCache::default();
            let mut pos = 0u64;
            while pos < size {
                let n = self.read_at_cached(inode, pos, &mut buf, &mut cache)?;
                if n == 0 {
                    break;
                }
                sink(&buf[..n])?;
                pos += n as u64;
            }
            return Ok(());
        }
        let threads = threads.min(nchunks as usize);
        std::thread::scope(|s| {
            let mut rxs = Vec::with_capacity(threads);
            let mut backs = Vec::with_capacity(threads);
            for t in 0..threads {
                let (tx, rx) = sync_channel::<Result<Vec<u8>>>(DEPTH);
                // Spent buffers go back to their worker, so chunks are not re-zeroed.
                let (back_tx, back_rx) = sync_channel::<Vec<u8>>(DEPTH + 1);
                rxs.push(rx);
                backs.push(back_tx);
                s.spawn(move || {
                    let mut cache = DecompressCache::default();
                    let mut k = t as u64;
                    while k < nchunks {
                        let pos = k * chunk as u64;
                        let len = (size - pos).min(chunk as u64) as usize;
                        // read_at_cached writes every byte it returns, so a reused
                        // buffer needs no clearing.
                        let mut buf = back_rx.try_recv().unwrap_or_default();
                        buf.resize(len, 0);
                        let r = self.read_at_cached(inode, pos, &mut buf, &mut cache).map(|n| {
                            buf.truncate(n);
                            buf
                        });
                        let failed = r.is_err();
                        // The consumer stops at the first error or when the sink fails;
                        // a closed channel ends this worker.
                        if tx.send(r).is_err() || failed {
                            return;
                        }
                        k += threads as u64;
                    }
                });
            }
            for k in 0..nchunks {
                let t = (k % threads as u64) as usize;
                let data =
                    rxs[t].recv().expect("worker sends every chunk it owns until an error")?;
                sink(&data)?;
                let _ = backs[t].try_send(data);
            }
            Ok(())
        })
    }
}
