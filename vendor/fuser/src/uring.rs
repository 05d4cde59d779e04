//! FUSE over io_uring (Linux 6.14+, protocol 7.42; `FUSE_OVER_IO_URING` in INIT).
//!
//! With the transport on, the kernel hands each request to a ring entry of the queue of
//! the CPU its caller runs on, and the queue's thread (pinned to that CPU) serves it
//! there: no cross-CPU wake-up per request. The requests themselves are the same bytes
//! as on /dev/fuse and go through the same parsing and dispatch; only their framing
//! differs:
//!
//! - an entry is two buffers registered once with `FUSE_IO_URING_CMD_REGISTER`: a
//!   288-byte header (`in_out`: the 40-byte `fuse_in_header` in, the 16-byte
//!   `fuse_out_header` out; `op_in`: the request's first argument, up to 128 bytes;
//!   `ent_in_out`: the commit id and the payload size) and a payload (the remaining
//!   arguments in, every reply argument out), at least `max(8192, max_write, max_pages
//!   pages)` long;
//! - `in.len = 40 + size(op_in) + payload_sz`, so the first argument's size is known
//!   without a table; the payload buffer has room before it, where the header and the
//!   first argument are copied to make the request contiguous, as /dev/fuse delivers it;
//! - a reply is committed with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH` (commit id, queue),
//!   which also arms the entry for the next request; a completion with result 0 means a
//!   request is in the entry, `-ENOTCONN` or `-ECONNABORTED` that the connection is gone.
//!
//! What stays on /dev/fuse: INIT, FORGET, BATCH_FORGET, INTERRUPT, requests queued before
//! every queue had an entry, and notifications from the filesystem. The session keeps
//! its classic reader threads for them.
//!
//! The ring needs an entry on every possible CPU's queue before it carries anything, and
//! once INIT negotiated the flag, new requests wait for that; so the rings and buffers
//! are made before the INIT reply (`prepare`), and the flag is dropped from the reply if
//! that fails. A failed REGISTER makes the kernel fall back to /dev/fuse by itself.
//!
//! A reply is collected in the entry's `Slot` and copied into the payload once the
//! handler has returned: the request's arguments live in that same buffer and a handler
//! may still hold them when it replies.

use std::io;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::Condvar;
use std::sync::Mutex;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::ll;
use crate::ll::Operation;
use crate::ll::ResponseErrno;
use crate::reply::Reply;
use crate::reply::ReplyEmpty;
use crate::reply::ReplyRaw;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: in_out (128), op_in (128), ent_in_out (32).
const HEADER_LEN: usize = 288;
const OP_IN: usize = 128;
const OP_IN_MAX: usize = 128;
const ENT_COMMIT_ID: usize = 256 + 8;
const ENT_PAYLOAD_SZ: usize = 256 + 16;
const IN_HEADER_LEN: usize = 40;
const OUT_HEADER_LEN: usize = 16;
/// Room before the payload for the in header and the first argument.
const HEADROOM: usize = 256;
/// The user data of the stop eventfd's poll.
const STOP: u64 = u64::MAX;

const _: () = assert!(HEADROOM >= IN_HEADER_LEN + OP_IN_MAX);
const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);

/// The number of queues the kernel makes: one per possible CPU
/// (`/sys/devices/system/cpu/possible`, a list such as `0-3` or `0,2-5`).
pub(crate) fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut n = 0;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("cpu list {text:?}"));
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().map_err(|_| bad())?, b.parse::<usize>().map_err(|_| bad())?),
            None => {
                let a = part.parse::<usize>().map_err(|_| bad())?;
                (a, a)
            }
        };
        if b < a {
            return Err(bad());
        }
        n += b - a + 1;
    }
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "no possible CPU"));
    }
    Ok(n)
}

/// The payload each entry needs: the kernel's `max(FUSE_MIN_READ_BUFFER, max_write,
/// max_pages * PAGE_SIZE)`, in whole pages.
pub(crate) fn payload_len(max_write: u32, max_pages: u16) -> usize {
    let page = page_size::get();
    let n = 8192usize.max(max_write as usize).max(usize::from(max_pages) * page);
    n.div_ceil(page) * page
}

/// A zeroed buffer at a fixed address for the kernel to write into; only ever accessed
/// through its raw pointer (the kernel writes it between our accesses).
struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by one queue; the pointer moves with it.
unsafe impl Send for RawBuf {}

impl RawBuf {
    fn new(len: usize) -> RawBuf {
        let b: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        RawBuf { ptr: Box::into_raw(b).cast::<u8>(), len }
    }

    fn read_u32(&self, at: usize) -> u32 {
        assert!(at + 4 <= self.len);
        let mut b = [0u8; 4];
        // SAFETY: in bounds (asserted); the kernel does not write while we read.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), b.as_mut_ptr(), 4) };
        u32::from_ne_bytes(b)
    }

    fn read_u64(&self, at: usize) -> u64 {
        assert!(at + 8 <= self.len);
        let mut b = [0u8; 8];
        // SAFETY: as `read_u32`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), b.as_mut_ptr(), 8) };
        u64::from_ne_bytes(b)
    }

    fn write(&self, at: usize, data: &[u8]) {
        assert!(at + data.len() <= self.len);
        // SAFETY: in bounds; the entry is ours (not armed) while we write.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(at), data.len()) };
    }

    /// Copy `len` bytes at `from` of `src` to `at` here.
    fn copy_from(&self, at: usize, src: &RawBuf, from: usize, len: usize) {
        assert!(at + len <= self.len && from + len <= src.len);
        // SAFETY: both in bounds; distinct buffers.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr.add(from), self.ptr.add(at), len) };
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` of a slice of this length in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// Where a handler's reply goes: the bytes (out header first) and whether it came.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    reply: Mutex<(bool, Vec<u8>)>,
    sent: Condvar,
}

impl Slot {
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let mut r = self.reply.lock().unwrap_or_else(|e| e.into_inner());
        if r.0 {
            return Err(io::Error::other("a second reply to one ring request"));
        }
        r.1.clear();
        for d in data {
            r.1.extend_from_slice(d);
        }
        r.0 = true;
        self.sent.notify_all();
        Ok(())
    }

    fn reset(&self) {
        let mut r = self.reply.lock().unwrap_or_else(|e| e.into_inner());
        r.0 = false;
        r.1.clear();
    }
}

/// One ring entry: its buffers (kept at fixed addresses for the kernel), the iovec array
/// that registered them, and its reply slot.
struct Entry {
    header: RawBuf,
    /// `HEADROOM` bytes, then the payload the kernel knows.
    payload: RawBuf,
    iov: Box<[libc::iovec; 2]>,
    slot: Arc<Slot>,
    /// The last command armed, to repeat after `-EAGAIN` or `-EINTR`.
    last: (u32, u64),
    alive: bool,
}

/// A queue ready to serve: its ring, entries and stop eventfd, made before the INIT
/// reply.
pub(crate) struct Queue {
    qid: u16,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    entries: Vec<Entry>,
    payload_len: usize,
    stop: Arc<OwnedFd>,
}

// SAFETY: the raw pointers in a queue (its buffers, and the iovecs naming them) point
// into memory the queue owns; it moves to its thread whole and is used there alone.
unsafe impl Send for Queue {}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Queue({}, {} entries)", self.qid, self.entries.len())
    }
}

/// Make `nr_queues` queues of `depth` entries with `payload_len`-byte payloads.
pub(crate) fn prepare(nr_queues: usize, depth: usize, payload_len: usize) -> io::Result<Vec<Queue>> {
    assert!(depth > 0);
    let mut queues = Vec::with_capacity(nr_queues);
    for qid in 0..nr_queues {
        let qid = u16::try_from(qid).map_err(|_| io::Error::other("too many CPUs for FUSE queues"))?;
        let slots = u32::try_from(depth + 1).map_err(|_| io::Error::other("queue depth"))?;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_cqsize(2 * slots)
            .build(slots)?;
        // SAFETY: plain syscall; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor we own.
        let stop = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let entries = (0..depth)
            .map(|_| {
                let header = RawBuf::new(HEADER_LEN);
                let payload = RawBuf::new(HEADROOM + payload_len);
                let iov = Box::new([
                    libc::iovec { iov_base: header.ptr.cast(), iov_len: HEADER_LEN },
                    // SAFETY: HEADROOM is inside the buffer.
                    libc::iovec { iov_base: unsafe { payload.ptr.add(HEADROOM) }.cast(), iov_len: payload_len },
                ]);
                Entry { header, payload, iov, slot: Arc::default(), last: (CMD_REGISTER, 0), alive: true }
            })
            .collect();
        queues.push(Queue { qid, ring, entries, payload_len, stop });
    }
    Ok(queues)
}

impl Queue {
    /// The eventfd that makes `serve` return once written.
    pub(crate) fn stopper(&self) -> Arc<OwnedFd> {
        self.stop.clone()
    }

    fn command(&self, fd: RawFd, index: usize, op: u32, commit_id: u64) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        let e = &self.entries[index];
        let mut sqe = opcode::UringCmd80::new(types::Fd(fd), op).cmd(cmd);
        if op == CMD_REGISTER {
            sqe = sqe.addr(Some(e.iov.as_ptr() as u64));
        }
        let sqe = sqe
            .build()
            .user_data(index as u64);
        if op != CMD_REGISTER {
            return sqe;
        }
        // The crate has no setter for the length, which REGISTER needs: the two iovecs
        // (`sqe->len`, bytes 24..28 of the submission entry).
        // SAFETY: `Entry128` is `repr(C)`, 128 bytes (asserted above), plain data.
        let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
        // SAFETY: as above; only the length field changed.
        unsafe { std::mem::transmute(raw) }
    }

    fn push(&mut self, sqe: &squeue::Entry128) -> io::Result<()> {
        // SAFETY: the buffers a command names (the iovecs, the entry's buffers) live as
        // long as the queue, which outlives the ring's use of them (`serve` returns
        // only when every entry is dead or the stop came, and the ring is dropped first).
        while unsafe { self.ring.submission().push(sqe) }.is_err() {
            self.ring.submit()?;
        }
        Ok(())
    }

    /// Serve requests until the connection ends or the stop eventfd is written.
    pub(crate) fn serve<FS: Filesystem>(mut self, fd: RawFd, se: &SessionEventLoop<FS>) -> io::Result<()> {
        pin_to_cpu(usize::from(self.qid));
        let poll = opcode::PollAdd::new(types::Fd(self.stop.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(STOP);
        self.push(&squeue::Entry128::from(poll))?;
        for i in 0..self.entries.len() {
            let sqe = self.command(fd, i, CMD_REGISTER, 0);
            self.push(&sqe)?;
        }
        let mut done: Vec<(u64, i32)> = Vec::new();
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
            done.clear();
            done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for &(ud, res) in &done {
                if ud == STOP {
                    return Ok(());
                }
                let i = ud as usize;
                if i >= self.entries.len() || !self.entries[i].alive {
                    continue;
                }
                if res == 0 {
                    let commit_id = self.handle(i, se);
                    self.entries[i].last = (CMD_COMMIT_AND_FETCH, commit_id);
                    let sqe = self.command(fd, i, CMD_COMMIT_AND_FETCH, commit_id);
                    self.push(&sqe)?;
                } else if res == -libc::EAGAIN || res == -libc::EINTR {
                    let (op, id) = self.entries[i].last;
                    let sqe = self.command(fd, i, op, id);
                    self.push(&sqe)?;
                } else {
                    self.entries[i].alive = false;
                    if ![libc::ENOTCONN, libc::ECONNABORTED, libc::ECANCELED].contains(&-res) {
                        error!(
                            "FUSE ring queue {} entry {i}: {}",
                            self.qid,
                            io::Error::from_raw_os_error(-res)
                        );
                    }
                    if self.entries.iter().all(|e| !e.alive) {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Serve the request in entry `i` and put its reply there; returns the commit id.
    fn handle<FS: Filesystem>(&self, i: usize, se: &SessionEventLoop<FS>) -> u64 {
        let e = &self.entries[i];
        let commit_id = e.header.read_u64(ENT_COMMIT_ID);
        let payload_sz = e.header.read_u32(ENT_PAYLOAD_SZ) as usize;
        let len = e.header.read_u32(0) as usize;
        let unique = e.header.read_u64(8);
        let op_in = len.checked_sub(IN_HEADER_LEN + payload_sz);
        let (Some(op_in), true) = (op_in, payload_sz <= self.payload_len) else {
            error!("FUSE ring request {unique}: sizes do not add up (len {len}, payload {payload_sz})");
            self.put_reply(e, unique, -libc::EIO, &[]);
            return commit_id;
        };
        if op_in > OP_IN_MAX {
            error!("FUSE ring request {unique}: first argument of {op_in} bytes");
            self.put_reply(e, unique, -libc::EIO, &[]);
            return commit_id;
        }
        // Make the request contiguous in front of its payload: header, first argument.
        let start = HEADROOM - op_in - IN_HEADER_LEN;
        e.payload.copy_from(start, &e.header, 0, IN_HEADER_LEN);
        e.payload.copy_from(HEADROOM - op_in, &e.header, OP_IN, op_in);
        e.slot.reset();
        let needs_reply;
        {
            // SAFETY: in bounds (`len` <= HEADROOM + payload_len by the checks above); the
            // kernel does not write the entry until it is committed, after this scope.
            let data = unsafe { std::slice::from_raw_parts(e.payload.ptr.add(start), len) };
            let sender = ReplySender::Ring(e.slot.clone());
            match RequestWithSender::new(sender, data) {
                Some(req) => {
                    needs_reply = !matches!(
                        req.request.operation(),
                        Ok(Operation::Forget(_) | Operation::BatchForget(_) | Operation::NotifyReply(_))
                    );
                    if let Ok(Operation::Destroy(_)) = req.request.operation() {
                        req.reply::<ReplyEmpty>().ok();
                    } else {
                        req.dispatch(se);
                    }
                }
                None => {
                    needs_reply = true;
                    <ReplyRaw as Reply>::new(ll::RequestId(unique), ReplySender::Ring(e.slot.clone()))
                        .send_ll(&ResponseErrno(ll::Errno::EIO));
                }
            }
        }
        if !needs_reply {
            self.put_reply(e, unique, 0, &[]);
            return commit_id;
        }
        // A handler may reply from another thread later; wait for it.
        let mut r = e.slot.reply.lock().unwrap_or_else(|p| p.into_inner());
        while !r.0 {
            r = e.slot.sent.wait(r).unwrap_or_else(|p| p.into_inner());
        }
        let bytes = &r.1;
        if bytes.len() < OUT_HEADER_LEN {
            warn!("FUSE ring request {unique}: a reply without its header");
            self.put_reply(e, unique, -libc::EIO, &[]);
            return commit_id;
        }
        let error = i32::from_ne_bytes(bytes[4..8].try_into().unwrap_or_default());
        let body = &bytes[OUT_HEADER_LEN..];
        if body.len() > self.payload_len {
            error!("FUSE ring request {unique}: a reply of {} bytes", body.len());
            self.put_reply(e, unique, -libc::EIO, &[]);
            return commit_id;
        }
        self.put_reply(e, unique, error, body);
        commit_id
    }

    fn put_reply(&self, e: &Entry, unique: u64, error: i32, body: &[u8]) {
        let len = u32::try_from(OUT_HEADER_LEN + body.len()).unwrap_or(u32::MAX);
        let mut h = [0u8; OUT_HEADER_LEN];
        h[0..4].copy_from_slice(&len.to_ne_bytes());
        h[4..8].copy_from_slice(&error.to_ne_bytes());
        h[8..16].copy_from_slice(&unique.to_ne_bytes());
        e.header.write(0, &h);
        e.payload.write(HEADROOM, body);
        let sz = u32::try_from(body.len()).unwrap_or(u32::MAX);
        e.header.write(ENT_PAYLOAD_SZ, &sz.to_ne_bytes());
    }
}

/// Run this thread on `cpu` only: the kernel queues a request on its caller's CPU, and
/// serving it there is what saves the wake-up of another CPU. Best effort (a cpuset may
/// forbid it; the queue then still works, from wherever it runs).
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays in bounds for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            return;
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            warn!("FUSE ring queue {cpu}: {}", io::Error::last_os_error());
        }
    }
}

/// Make every queue's `serve` return (after the session's end).
pub(crate) fn stop(stoppers: &[Arc<OwnedFd>]) {
    for s in stoppers {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to an eventfd we own.
        unsafe { libc::write(s.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn payload_is_at_least_the_kernels_bound_in_pages() {
        let page = page_size::get();
        assert_eq!(payload_len(4096, 1), 8192usize.div_ceil(page) * page);
        assert_eq!(payload_len(1 << 20, 256), (1 << 20usize).max(256 * page));
        assert_eq!(payload_len(131_072, 32), (131_072usize).max(32 * page));
        assert_eq!(payload_len(5000, 0) % page, 0);
    }

    #[test]
    fn reply_slot_takes_one_reply() {
        let s = Slot::default();
        s.send(&[IoSlice::new(&[1, 2]), IoSlice::new(&[3])]).unwrap();
        assert_eq!(s.reply.lock().unwrap().1, vec![1, 2, 3]);
        assert!(s.send(&[IoSlice::new(&[4])]).is_err());
        s.reset();
        s.send(&[IoSlice::new(&[4])]).unwrap();
        assert_eq!(s.reply.lock().unwrap().1, vec![4]);
    }

    #[test]
    fn possible_cpus_reads_sysfs() {
        if let Ok(n) = possible_cpus() {
            assert!(n >= 1);
        }
    }
}
