//! Support for the ubtrfs fuzz targets: the whole-filesystem walker (`walk`) and the
//! target bodies (`targets`), kept in plain modules so `crates/core/tests/corrupt.rs`
//! can include the same files with `#[path]` and replay crashing inputs as tests.

pub mod targets;
pub mod walk;
