//! Ranges merged in one place: half-open byte ranges `[start, end)` for the trim's
//! discards and btrfs check's coverage maps, and inclusive key ranges for the log
//! writer's changes.

/// Merge half-open ranges, sorted or not, into disjoint sorted ones; touching ranges
/// join and empty ones go.
pub fn merge_ranges(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.retain(|r| r.0 < r.1);
    merge_overlapping(v)
}

/// Merge ranges `(start, end)` of any ordered points, sorted or not, into disjoint
/// sorted ones: a range that starts at or before the end of the one before joins it.
/// Half-open ranges join when they touch (`merge_ranges`); inclusive ones (the log
/// writer's changed key ranges) when they share a point.
pub fn merge_overlapping<T: Ord + Copy>(mut v: Vec<(T, T)>) -> Vec<(T, T)> {
    v.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(v.len());
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

    #[test]
    fn merges_inclusive_ranges_that_share_a_point() {
        assert_eq!(
            merge_overlapping(vec![(5, 5), (0, 2), (2, 3), (4, 4)]),
            vec![(0, 3), (4, 4), (5, 5)]
        );
    }
}
