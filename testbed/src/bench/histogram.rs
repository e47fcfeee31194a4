//! A fixed-size latency histogram, HdrHistogram-like: log-linear buckets
//! (64 per power of two, so a recorded value is known to within 1/64, about
//! 1.6 %), allocated once, so recording is a few integer operations and never
//! allocates. One per load-generator task, merged at the end.

use std::time::Duration;

/// Sub-buckets per power of two (2^SUB_BITS).
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Buckets for every u64: values below 64 exactly, then 64 per power of two.
const BUCKETS: usize = (64 - SUB_BITS as usize + 1) * SUB;

/// Counts of durations in nanoseconds.
#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Box<[u64]>,
    count: u64,
    min: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    pub fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            min: u64::MAX,
            max: 0,
            sum: 0,
        }
    }

    /// Records one duration (saturating at u64::MAX nanoseconds).
    pub fn record(&mut self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn record_ns(&mut self, ns: u64) {
        self.counts[bucket(ns)] += 1;
        self.count += 1;
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
        self.sum += u128::from(ns);
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts.iter()) {
            *mine += theirs;
        }
        self.count += other.count;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn min_ns(&self) -> Option<u64> {
        (self.count > 0).then_some(self.min)
    }

    pub fn max_ns(&self) -> Option<u64> {
        (self.count > 0).then_some(self.max)
    }

    pub fn mean_ns(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum as f64 / self.count as f64)
    }

    /// The nearest-rank `p`-th percentile (0 < p <= 100): the middle of the
    /// bucket holding it, clamped to the exact minimum and maximum (the
    /// exact maximum for the last rank).
    pub fn percentile_ns(&self, p: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((p / 100.0) * self.count as f64).ceil().max(1.0) as u64;
        if rank >= self.count {
            return Some(self.max);
        }
        let mut seen = 0;
        for (index, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (low, high) = bucket_range(index);
                let middle = low + (high - low) / 2;
                return Some(middle.clamp(self.min, self.max));
            }
        }
        Some(self.max)
    }
}

/// The bucket of `ns`.
fn bucket(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let exponent = 63 - ns.leading_zeros(); // >= SUB_BITS
    let shift = exponent - SUB_BITS;
    // (ns >> shift) is in [SUB, 2 * SUB).
    (shift as usize + 1) * SUB + (ns >> shift) as usize - SUB
}

/// The smallest and largest value of bucket `index`.
fn bucket_range(index: usize) -> (u64, u64) {
    if index < SUB {
        return (index as u64, index as u64);
    }
    let shift = (index / SUB - 1) as u32;
    let mantissa = (index % SUB + SUB) as u64;
    let low = mantissa << shift;
    (low, low + ((1u64 << shift) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        for ns in [0, 1, 63, 64, 65, 127, 128, 1000, 123_456_789, u64::MAX] {
            let (low, high) = bucket_range(bucket(ns));
            assert!(low <= ns && ns <= high, "{ns}: [{low}, {high}]");
            // Within 1/64 of the value.
            assert!((high - low) as f64 <= ns as f64 / 64.0 + 1.0, "{ns}");
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        for index in 1..BUCKETS {
            assert_eq!(bucket_range(index - 1).1 + 1, bucket_range(index).0);
        }
    }

    #[test]
    fn percentiles_are_nearest_rank_within_a_bucket() {
        let mut h = Histogram::new();
        assert_eq!(h.percentile_ns(50.0), None);
        for us in 1..=100u64 {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 100);
        let p50 = h.percentile_ns(50.0).unwrap() as f64;
        assert!((p50 - 50_000.0).abs() <= 50_000.0 / 64.0, "{p50}");
        let p99 = h.percentile_ns(99.0).unwrap() as f64;
        assert!((p99 - 99_000.0).abs() <= 99_000.0 / 64.0, "{p99}");
        assert_eq!(h.percentile_ns(100.0), Some(100_000));
        assert_eq!(h.min_ns(), Some(1_000));
        assert_eq!(h.mean_ns(), Some(50_500.0));
    }

    #[test]
    fn merging_adds_counts() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        a.record_ns(10);
        b.record_ns(1_000_000);
        b.record_ns(1_000_000);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!((a.min_ns(), a.max_ns()), (Some(10), Some(1_000_000)));
        assert_eq!(a.percentile_ns(33.0), Some(10));
        assert_eq!(a.percentile_ns(34.0), Some(1_000_000));
    }
}
