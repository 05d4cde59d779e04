//! The seed 001 benchmark in tiny form (2,000 inodes without maps, 20 with), through
//! the same code the `seed001` binary runs, so it never rots. Asserts what must hold
//! whatever the timings: both variants free every map in every round, the kernel-style
//! scan walks every inode without maps while the registry visits only the inodes with
//! maps, and the shrinker's invariants hold. Timings are not asserted.

#[allow(dead_code)]
#[path = "../src/bin/seed001.rs"]
mod seed001;

#[test]
fn seed001_tiny_both_variants_free_everything() {
    let s = seed001::Setup::new(2000, 20, 16);
    for readers in [0, 2] {
        let c = seed001::compare(&s, 3, readers);
        assert_eq!((c.kernel.len(), c.patched.len(), c.ubtrfs.len()), (3, 3, 3));
        for p in &c.patched {
            assert!(p.walked >= 2000, "the patched scan still walks every inode: {p:?}");
            if readers == 0 {
                assert_eq!(p.freed, 320, "patched scan: {p:?}");
                assert!(p.trylocks <= 40, "the peek skips the trylock of empty inodes: {p:?}");
            }
        }
        for (k, u) in c.kernel.iter().zip(&c.ubtrfs) {
            if readers == 0 {
                assert_eq!(k.freed, 320, "kernel scan: {k:?}");
                assert_eq!(u.freed, 320, "registry: {u:?}");
                assert_eq!(u.walked, 20, "the registry visits only the inodes with maps: {u:?}");
            }
            assert!(k.walked >= 2000, "the kernel scan walks the empty inodes first: {k:?}");
            assert!(u.walked <= 40, "registry: {u:?}");
        }
        assert_eq!(s.shrinker.evictable(), 0);
    }
}
