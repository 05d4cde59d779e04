//! Changes to a filesystem's chunks and devices, and the deleted subvolumes waiting for
//! the cleaner, through the engine: what mkfs does to the filesystem it bootstraps
//! (the profiles and sizes of new chunks, its first real chunks, the removal of the
//! bootstrap chunk, `--shrink`'s device sizes) and what `subvolume list --deleted` and
//! `subvolume sync` ask. Each is one call that takes the engine's lock and, where it
//! changes trees, runs its own transaction handle; none writes file data.
//!
//! The rules are the transaction's (`space::chunk_alloc`, `space::chunk_remove`,
//! `extent::drop_snapshot`). Neighbours: `engine::subvol` (the cleaner itself).

use crate::engine::Engine;
use crate::error::Result;
use crate::space::{chunk_alloc, chunk_remove};
use crate::transaction::Transaction;

/// A deleted subvolume whose tree waits for the cleaner (`Engine::dead_roots`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadRoot {
    /// The tree's id.
    pub id: u64,
    /// The generation of its root.
    pub generation: u64,
}

impl Engine {
    /// Give new chunks of type `ty` (DATA, METADATA or SYSTEM) the profile `profile`
    /// from now on (`Transaction::set_alloc_profile`).
    ///
    /// # Errors
    /// As `Transaction::set_alloc_profile`; `Posix(ReadOnly)` after a panic in a writer.
    pub fn set_alloc_profile(&self, ty: u64, profile: u64) -> Result<()> {
        self.write(|w| w.set_alloc_profile(ty, profile))
    }

    /// Make new chunks of type `ty` at most `bytes` long (`Transaction::set_max_chunk_size`);
    /// `None` for every type gives the kernel's sizes back.
    ///
    /// # Errors
    /// As `Transaction::set_max_chunk_size`; `Posix(ReadOnly)` after a panic in a writer.
    pub fn set_max_chunk_size(&self, cap: Option<(u64, u64)>) -> Result<()> {
        self.write(|w| match cap {
            Some((ty, bytes)) => w.set_max_chunk_size(ty, bytes),
            None => {
                w.clear_max_chunk_sizes();
                Ok(())
            }
        })
    }

    /// Allocate one chunk of each type in `types`, then move every tree's root leaf out
    /// of the chunk at `from` (`chunk_remove::relocate_root_leaves`), in one handle
    /// with no reservation: the metadata chunk it makes is where its blocks go (mkfs's
    /// first chunks, out of its bootstrap chunk). Returns how many trees moved.
    ///
    /// # Errors
    /// As `chunk_alloc::alloc_chunk` and `relocate_root_leaves` (a failure aborts).
    pub fn alloc_chunks_moving_roots(&self, types: &[u64], from: u64) -> Result<usize> {
        self.write(|w| {
            let mut h = Transaction::start_transaction(w, "mkfs: chunks", 0)?;
            let r = (|| {
                for &ty in types {
                    chunk_alloc::alloc_chunk(&mut h, ty)?;
                }
                chunk_remove::relocate_root_leaves(&mut h, from)
            })();
            h.end_with(r)
        })
    }

    /// Remove the empty chunk at `start` (`chunk_remove::remove_chunk`) in a handle of
    /// its own.
    ///
    /// # Errors
    /// As `remove_chunk` (its refusals come before anything changes).
    pub fn remove_chunk(&self, start: u64) -> Result<()> {
        self.write(|w| {
            let mut h = w.start_transaction("mkfs: remove the bootstrap chunk", 0)?;
            let r = chunk_remove::remove_chunk(&mut h, start);
            h.end_with(r)
        })
    }

    /// Cut every device to the end of its last dev extent, rounded up to a sector
    /// (`Transaction::set_device_size`, nothing relocated): `mkfs --shrink`. Returns
    /// each device's id and new size, in device order.
    ///
    /// # Errors
    /// As `Transaction::device_used_end` and `set_device_size`.
    pub fn shrink_devices(&self) -> Result<Vec<(u64, u64)>> {
        let devids: Vec<u64> = self.info.devices.by_id.keys().copied().collect();
        let ss = u64::from(self.info.sectorsize);
        self.write(|w| {
            let mut out = Vec::with_capacity(devids.len());
            for &d in &devids {
                let end = w.device_used_end(d)?.div_ceil(ss) * ss;
                w.set_device_size(d, end)?;
                out.push((d, end));
            }
            Ok(out)
        })
    }

    /// List the deleted subvolumes whose trees wait for the cleaner (`clean_dead_roots`),
    /// in id order, with their roots' generations.
    ///
    /// # Errors
    /// Read failures; `Posix(ReadOnly)` after a panic in a writer.
    pub fn dead_roots(&self) -> Result<Vec<DeadRoot>> {
        self.write(|w| {
            let ids = w.dead_roots()?;
            ids.into_iter()
                .map(|id| Ok(DeadRoot { id, generation: w.root(id)?.generation }))
                .collect()
        })
    }
}
