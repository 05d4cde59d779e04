//! `check`: run the read-only checker and print one line per finding, then a summary.
//! Exits non-zero (through the returned error) when anything is found.

use crate::ImageArgs;
use std::io::Write;
use ubtrfs_core::{Error, PosixKind};
use ubtrfs_format::{Corrupt, CorruptWhere};
use ubtrfs_tools::check::{check, CheckOptions};

#[derive(clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Also read every checksummed data sector (every copy) and verify it.
    #[arg(long)]
    pub check_data_csum: bool,
    /// Record at most this many findings (the count still covers all).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub max_findings: usize,
    /// Check even while the kernel has the image mounted or a ubtrfs writer holds it
    /// (the findings may be false: the image changes while it is read).
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: &CheckArgs) -> ubtrfs_core::Result<()> {
    let mut out = std::io::stdout().lock();
    let w = |e| Error::io("stdout", e);
    let fs = a.image.open_quiet()?;
    // Like `btrfs check`, refuse an image that changes under the checker unless forced
    // (then the in-use warnings are printed with the others).
    if let Some(u) = fs.in_use.first().filter(|_| !a.force) {
        return Err(Error::posix_detail(
            PosixKind::Busy,
            u.to_string(),
            "its check may report false problems; use --force to check anyway",
        ));
    }
    crate::print_warnings(&fs);
    let opts = CheckOptions { check_data_csum: a.check_data_csum, max_findings: a.max_findings };
    let report = check(&fs, &opts)?;
    crate::print_warnings(&fs);
    print_report(&mut out, &report, "").map_err(w)?;
    let mut n = report.problems();
    // A log tree: the filesystem a mount would see after replaying it is checked too,
    // replayed in memory (the image is not written). A log that cannot be replayed is
    // a problem of the image.
    if fs.log_root().is_some() && !a.image.no_log_replay {
        let p = "after log replay: ";
        match a.image.open_replayed_quiet() {
            Ok(replayed) => {
                let _ = replayed.take_warnings();
                let r = check(&replayed, &opts)?;
                print_report(&mut out, &r, p).map_err(w)?;
                n += r.problems();
            }
            Err(e) => {
                writeln!(out, "{p}{e}").map_err(w)?;
                n += 1;
            }
        }
    }
    out.flush().map_err(w)?;
    if n == 0 {
        Ok(())
    } else {
        Err(Corrupt::new(
            CorruptWhere::Item,
            format!(
                "{}: {n} problem{} found",
                a.image.image.display(),
                if n == 1 { "" } else { "s" }
            ),
        )
        .into())
    }
}

/// The notes, findings and summary of one report, each line after `prefix`.
fn print_report(
    out: &mut impl Write,
    report: &ubtrfs_tools::check::CheckReport,
    prefix: &str,
) -> std::io::Result<()> {
    for n in &report.notes {
        writeln!(out, "{prefix}note: {n}")?;
    }
    for f in &report.findings {
        writeln!(out, "{prefix}{f}")?;
    }
    if report.dropped > 0 {
        writeln!(out, "{prefix}... {} more findings not shown", report.dropped)?;
    }
    writeln!(out, "{prefix}{}", report.summary())
}
