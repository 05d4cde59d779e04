//! `check`.
use crate::ImageArgs;

#[derive(clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub image: ImageArgs,
}

pub fn run(_a: &CheckArgs) -> ubtrfs_core::Result<()> {
    Err(ubtrfs_core::Error::posix(ubtrfs_core::PosixKind::Invalid, "check is not implemented yet"))
}
