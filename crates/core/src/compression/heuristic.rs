//! Whether data is worth compressing: the kernel's `btrfs_compress_heuristic`, which
//! `compress` (not `compress-force`) runs on each range before compressing it.
//!
//! It samples 16 bytes out of every 256 of the first 128 KiB, then decides, cheapest
//! test first:
//! - the sample's two halves are equal (a repeated pattern): compress;
//! - fewer than 64 distinct byte values: compress (text and the like);
//! - the most frequent values that make up 90% of the sample: 64 or fewer, compress;
//!   200 or more, do not (random-looking data);
//! - otherwise by the Shannon entropy of the sample, in percent of 8 bits per byte:
//!   below 80%, compress; else do not.
//!
//! The entropy uses the kernel's integer approximation (log2 of the fourth power,
//! rounded down), so the same data gives the same answer as the kernel's.

/// Bytes taken at each sampling point.
const SAMPLING_READ_SIZE: usize = 16;
/// Distance between sampling points.
const SAMPLING_INTERVAL: usize = 256;
/// How much of the range is sampled (BTRFS_MAX_UNCOMPRESSED).
const MAX_SAMPLED: usize = 128 * 1024;
const BYTE_SET_THRESHOLD: usize = 64;
const BYTE_CORE_SET_LOW: usize = 64;
const BYTE_CORE_SET_HIGH: usize = 200;
const ENTROPY_LVL_HIGH: u32 = 80;

/// The sample the kernel takes of `data`: per 4 KiB page, 16 bytes at every 256th
/// offset inside the page, up to the range's end.
fn sample(data: &[u8]) -> Vec<u8> {
    let data = &data[..data.len().min(MAX_SAMPLED)];
    let mut out = Vec::with_capacity(
        data.len() / SAMPLING_INTERVAL * SAMPLING_READ_SIZE + SAMPLING_READ_SIZE,
    );
    for page in data.chunks(4096) {
        // Whole 16-byte reads only: nothing is sampled past the range's end.
        let mut i = 0;
        while i + SAMPLING_READ_SIZE <= page.len() {
            out.extend_from_slice(&page[i..i + SAMPLING_READ_SIZE]);
            i += SAMPLING_INTERVAL;
        }
    }
    out
}

/// floor(log2(n^4)), the kernel's `ilog2_w` (0 for 0).
fn ilog2_w(n: u64) -> u32 {
    let p = (n as u128).pow(4);
    if p == 0 {
        0
    } else {
        127 - p.leading_zeros()
    }
}

/// Whether `data` (a range about to be written) looks compressible.
pub fn worth_compressing(data: &[u8]) -> bool {
    let s = sample(data);
    if s.is_empty() {
        return false;
    }
    let half = s.len() / 2;
    if half > 0 && s[..half] == s[half..2 * half] {
        return true;
    }
    let mut counts = [0u32; 256];
    for &b in &s {
        counts[usize::from(b)] += 1;
    }
    let distinct = counts.iter().filter(|&&c| c > 0).count();
    if distinct < BYTE_SET_THRESHOLD {
        return true;
    }
    let mut sorted = counts;
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let threshold = s.len() as u64 * 90 / 100;
    let mut sum = 0u64;
    let mut core = 0;
    while core < BYTE_CORE_SET_HIGH && (core < BYTE_CORE_SET_LOW || sorted[core] > 0) {
        sum += u64::from(sorted[core]);
        if sum > threshold {
            break;
        }
        core += 1;
    }
    if core <= BYTE_CORE_SET_LOW {
        return true;
    }
    if core >= BYTE_CORE_SET_HIGH {
        return false;
    }
    let size = s.len() as u64;
    let sz_base = ilog2_w(size);
    let entropy_max = 8 * ilog2_w(2);
    let mut acc = 0u64;
    for &c in sorted.iter().take_while(|&&c| c > 0) {
        acc += u64::from(c) * u64::from(sz_base - ilog2_w(u64::from(c)));
    }
    let entropy = (acc / size) as u32 * 100 / entropy_max;
    entropy < ENTROPY_LVL_HIGH
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, mut x: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn decisions() {
        assert!(worth_compressing(&vec![0u8; 128 << 10]), "zeros");
        assert!(worth_compressing(&b"the quick brown fox ".repeat(7000)), "text");
        assert!(!worth_compressing(&random(128 << 10, 7)), "random");
        // A repeated random block: the halves of the sample are equal.
        let block = random(64 << 10, 9);
        assert!(worth_compressing(&[block.clone(), block].concat()), "repeated");
        // Random bytes limited to 128 values: entropy near 7/8 bits, above the line.
        let half: Vec<u8> = random(128 << 10, 3).iter().map(|b| b & 0x7f).collect();
        assert!(!worth_compressing(&half));
        // Random bytes limited to 32 values: the byte set is small.
        let small: Vec<u8> = random(128 << 10, 5).iter().map(|b| b & 0x1f).collect();
        assert!(worth_compressing(&small));
        assert!(!worth_compressing(&[]));
    }

    #[test]
    fn kernel_log2_approximation() {
        assert_eq!(ilog2_w(0), 0);
        assert_eq!(ilog2_w(1), 0);
        assert_eq!(ilog2_w(2), 4);
        assert_eq!(ilog2_w(3), 6);
        assert_eq!(ilog2_w(8192), 52);
    }
}
