//! One capture over several streams ("lanes"), so that sealing and opening its records runs on
//! several cores at each end: one encrypted stream tops out at what one core seals (1.6–1.8 GB/s
//! on the H200 host), below a 25–100 GbE link.
//!
//! The decode host opens `count` connections for one capture, each naming its lane in the hello
//! (bound into that lane's handshake, so a lane cannot be passed off as another). Lane `k`
//! carries the segments whose index is `k` modulo `count`, in order, then the seal; every lane
//! ends with the same seal. The decode host reads the lanes in parallel and takes segment `i`
//! from lane `i % count` ([`LaneMerge`] checks the merged stream), so blocks are still written in
//! chain order and the memory held is bounded per lane. One lane is the plain stream of wire
//! versions before lanes.

use crate::error::{CoreError, Result};

use super::seal::Seal;

/// Lanes one capture may use at most.
pub const MAX_LANES: u8 = 16;

/// Which lane of how many a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    pub index: u8,
    pub count: u8,
}

impl Lane {
    /// The whole capture on one stream.
    pub const SINGLE: Lane = Lane { index: 0, count: 1 };

    /// Lane `index` of `count`, checked.
    pub fn new(index: u8, count: u8) -> Result<Lane> {
        if count == 0 || count > MAX_LANES {
            return Err(CoreError::config("lanes", format!("must be 1 to {MAX_LANES}, got {count}")));
        }
        if index >= count {
            return Err(CoreError::config("lane", format!("lane {index} of {count} does not exist (lanes are numbered from 0)")));
        }
        Ok(Lane { index, count })
    }

    /// Every lane of a capture pulled over `count` streams.
    pub fn all(count: u8) -> Result<Vec<Lane>> {
        (0..count.max(1)).map(|i| Lane::new(i, count)).collect()
    }

    /// Whether this lane carries segment `index`.
    pub fn carries(&self, index: u32) -> bool {
        index % self.count as u32 == self.index as u32
    }

    /// The first segment index at or after `index` this lane carries.
    pub fn first_from(&self, index: u32) -> u32 {
        let c = self.count as u32;
        let k = self.index as u32;
        index + (k + c - index % c) % c
    }
}

/// The decode host's check of the merged lanes: segments come back in index order and token
/// positions follow on, and every lane's seal is the same one.
pub struct LaneMerge {
    next_index: u32,
    next_start: u64,
    seal: Option<Seal>,
}

impl LaneMerge {
    /// Expect segment `index` at token `start` first (a capture resumed at a block boundary).
    pub fn starting_at(index: u32, start: u64) -> Self {
        LaneMerge { next_index: index, next_start: start, seal: None }
    }

    /// The index of the next segment, which [`Lane::carries`] tells the lane of.
    pub fn next_index(&self) -> u32 {
        self.next_index
    }

    /// A segment taken from its lane: it must be the next in order.
    pub fn segment(&mut self, index: u32, start: u64, end: u64) -> Result<()> {
        if index != self.next_index || start != self.next_start {
            return Err(CoreError::wire(format!("segment {index} at token {start} out of order across lanes: expected segment {} at token {}", self.next_index, self.next_start)));
        }
        self.next_index += 1;
        self.next_start = end;
        Ok(())
    }

    /// A lane's seal; once every lane has sealed, the seal (which each lane checked against the
    /// segments it carried) must be the same on all and count exactly the segments merged.
    pub fn seal(&mut self, seal: Seal) -> Result<()> {
        match &self.seal {
            Some(first) if *first != seal => Err(CoreError::wire(format!("the lanes' seals differ: {first:?} and {seal:?}"))),
            _ => {
                self.seal = Some(seal);
                Ok(())
            }
        }
    }

    /// The seal, once every lane has sent it and the merged segments add up to it.
    pub fn finish(self) -> Result<Seal> {
        let seal = self.seal.ok_or_else(|| CoreError::wire("no lane sent a seal"))?;
        let blocks = seal.blocks();
        if blocks != self.next_index {
            return Err(CoreError::wire(format!("seal claims {blocks} blocks, {} arrived across the lanes", self.next_index)));
        }
        Ok(seal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(blocks: u32) -> Seal {
        Seal::Complete { blocks, tokens: 4 * blocks as u64 }
    }

    #[test]
    fn lanes_carry_every_index_once() {
        for count in 1..=MAX_LANES {
            let lanes = Lane::all(count).unwrap();
            for i in 0..100u32 {
                assert_eq!(lanes.iter().filter(|l| l.carries(i)).count(), 1);
                for l in &lanes {
                    let f = l.first_from(i);
                    assert!(f >= i && f < i + count as u32 && l.carries(f), "lane {l:?} from {i}: {f}");
                }
            }
        }
        assert!(Lane::new(0, 0).is_err() && Lane::new(2, 2).is_err() && Lane::new(0, MAX_LANES + 1).is_err());
    }

    #[test]
    fn the_merge_takes_segments_in_order_and_one_seal() {
        let mut m = LaneMerge::starting_at(2, 8);
        m.segment(2, 8, 12).unwrap();
        assert!(m.segment(4, 16, 20).unwrap_err().to_string().contains("out of order across lanes"));
        assert!(m.segment(3, 13, 16).is_err(), "a gap in token positions");
        m.segment(3, 12, 16).unwrap();
        m.seal(complete(4)).unwrap();
        m.seal(complete(4)).unwrap();
        assert!(m.seal(complete(5)).unwrap_err().to_string().contains("seals differ"));
        assert_eq!(m.finish().unwrap(), complete(4));
        let mut short = LaneMerge::starting_at(0, 0);
        short.segment(0, 0, 4).unwrap();
        short.seal(complete(2)).unwrap();
        assert!(short.finish().unwrap_err().to_string().contains("seal claims 2 blocks, 1 arrived"));
        assert!(LaneMerge::starting_at(0, 0).finish().is_err());
    }
}
