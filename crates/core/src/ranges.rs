//! Half-open byte ranges `[start, end)`: the one place they are merged, for the trim's
//! discards and btrfs check's coverage maps alike.

/// Merge half-open ranges, sorted or not, into disjoint sorted ones; touching ranges
/// join and empty ones go.
pub fn merge_ranges(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.retain(|r| r.0 < r.1);
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_touching_and_overlapping_ranges() {
        assert_eq!(
            merge_ranges(vec![(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]),
            vec![(0, 3), (5, 9)]
        );
        assert_eq!(
            merge_ranges(vec![(0, 10), (10, 15), (12, 22), (30, 31)]),
            vec![(0, 22), (30, 31)]
        );
    }
}
