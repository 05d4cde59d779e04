//! The seed 004 benchmark in tiny form (4 MiB per case, one round), through the same
//! code the `seed004` binary runs, so it never rots. Asserts what must hold whatever
//! the timings: both modes time every folio of every case and build the same bios,
//! and a fragmented layout needs more bios than a contiguous one. Timings are not
//! asserted.

#[allow(dead_code)]
#[path = "../src/bin/seed004.rs"]
mod seed004;

#[test]
fn seed004_tiny_modes_agree() {
    let mut bios = Vec::new();
    for case in seed004::cases(16) {
        let r = seed004::run_case(case, 4 << 20, 1).unwrap_or_else(|e| panic!("{e}"));
        let folios = ((4u64 << 20) / case.folio) as usize;
        assert_eq!(r.extent.len(), folios, "{}: extent mode timed every folio", case.name);
        assert_eq!(r.block.len(), folios, "{}: block mode timed every folio", case.name);
        bios.push((case.name, r.bios));
    }
    // 128 MiB extents: one bio for the whole file; 16 KiB ones: one per extent.
    assert_eq!(bios[0].1, 1, "{bios:?}");
    assert_eq!(bios[1].1, (4 << 20) / (16 << 10), "{bios:?}");
}
