//! Deterministic test data: byte streams that the receiving side regenerates to check every
//! byte it got, and the checksum two processes compare instead of the bytes.

/// Marsaglia's xorshift64 generator (shifts 13, 7, 17): cheap, deterministic, and its bytes
/// look random enough that a misplaced, stale or duplicated piece of a stream shows.
///
/// The seed must not be zero (zero is a fixed point: every step would yield zero).
#[derive(Clone, Debug)]
pub struct XorShift64 {
    state: u64,
}

impl XorShift64 {
    /// The generator whose first step is taken from `seed`.
    pub const fn new(seed: u64) -> XorShift64 {
        XorShift64 { state: seed }
    }

    /// The next state.
    pub fn next_u64(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }

    /// Fills `out` with the low byte of one step per byte.
    pub fn fill_low_bytes(&mut self, out: &mut [u8]) {
        for byte in out {
            *byte = self.next_u64() as u8;
        }
    }

    /// The next `len` bytes as [`Self::fill_low_bytes`] makes them.
    pub fn low_bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        self.fill_low_bytes(&mut out);
        out
    }
}

/// FNV-1a over the bytes of `data`: order-sensitive, so a reordered, lost or duplicated
/// chunk changes it.
pub fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams written by one build are checked by another (and by tests that regenerate
    /// them): the sequence is fixed.
    #[test]
    fn the_sequence_is_xorshift64_13_7_17() {
        let mut generator = XorShift64::new(0x9e37_79b9_7f4a_7c15);
        assert_eq!(generator.next_u64(), 0xdc1b_77ae_0bf3_4dad);
        assert_eq!(generator.next_u64(), 0x64f0_eeb9_026e_6076);
        assert_eq!(generator.next_u64(), 0x7b07_ce91_e590_6136);
        assert_eq!(
            XorShift64::new(0x9e37_79b9_7f4a_7c15).low_bytes(8),
            [173, 118, 54, 116, 236, 121, 207, 234]
        );
    }

    #[test]
    fn bytes_continue_where_the_last_call_stopped() {
        let whole = XorShift64::new(7).low_bytes(100);
        let mut generator = XorShift64::new(7);
        let mut pieces = generator.low_bytes(33);
        pieces.extend(generator.low_bytes(67));
        assert_eq!(pieces, whole);
    }

    #[test]
    fn fnv1a_matches_its_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(
            fnv1a(&XorShift64::new(0x9e37_79b9_7f4a_7c15).low_bytes(1000)),
            0xab06_f176_b84e_76d3
        );
    }
}
