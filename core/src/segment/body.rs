//! A segment's body: every array of the segment as spans of one contiguous little-endian bf16
//! buffer ([`SegmentArrays`]), owned or shared with whoever filled it (the GPU path's page-locked
//! memory, [`BodyStore`]). Framing a segment is its header plus this body as it lies.

use std::sync::Arc;

// Bodies are read and written in place as the wire's little-endian bf16.
#[cfg(not(target_endian = "little"))]
compile_error!("pd-bridge-core frames segments in place and needs a little-endian host");

use half::bf16;

use crate::error::{CoreError, Result};

/// Where a segment body's values live: a heap buffer, or page-locked memory a GPU copied into
/// (returned to its pool when the last segment sharing it is dropped).
pub trait BodyStore: Send + Sync {
    /// The values; a body uses a prefix of them.
    fn values(&self) -> &[bf16];
}

/// A body's values: owned (and mutable, copy-on-write), or shared with whoever owns them.
#[derive(Clone)]
enum Store {
    Owned(Arc<Vec<bf16>>),
    Shared(Arc<dyn BodyStore>),
}

impl Store {
    fn values(&self) -> &[bf16] {
        match self {
            Store::Owned(v) => v,
            Store::Shared(s) => s.values(),
        }
    }
}

impl BodyStore for Vec<bf16> {
    fn values(&self) -> &[bf16] {
        self
    }
}

/// A segment's arrays, in header order: spans of one contiguous bf16 body.
#[derive(Clone)]
pub struct SegmentArrays {
    store: Store,
    /// `(offset, values)` of each array; back to back from 0.
    spans: Vec<(usize, usize)>,
}

impl SegmentArrays {
    /// Arrays of `lens` values each, back to back at the start of `store`.
    pub fn from_store(store: Arc<dyn BodyStore>, lens: impl IntoIterator<Item = usize>) -> Result<Self> {
        let mut spans = Vec::new();
        let mut at = 0usize;
        for n in lens {
            spans.push((at, n));
            at = at.checked_add(n).ok_or_else(|| CoreError::wire("segment body size overflows"))?;
        }
        if at > store.values().len() {
            return Err(CoreError::wire(format!("segment body of {} values cannot hold {at}", store.values().len())));
        }
        Ok(SegmentArrays { store: Store::Shared(store), spans })
    }

    /// Arrays of `lens` values each, back to back in `body`.
    pub fn from_body(body: Vec<bf16>, lens: impl IntoIterator<Item = usize>) -> Result<Self> {
        let mut a = Self::from_store(Arc::new(Vec::new()), [])?;
        let mut at = 0usize;
        for n in lens {
            a.spans.push((at, n));
            at = at.checked_add(n).ok_or_else(|| CoreError::wire("segment body size overflows"))?;
        }
        if at > body.len() {
            return Err(CoreError::wire(format!("segment body of {} values cannot hold {at}", body.len())));
        }
        a.store = Store::Owned(Arc::new(body));
        Ok(a)
    }

    /// Array `k`, writable (tests corrupt segments this way); a shared body is copied first.
    pub fn get_mut(&mut self, k: usize) -> Option<&mut [bf16]> {
        let &(o, n) = self.spans.get(k)?;
        if let Store::Shared(s) = &self.store {
            self.store = Store::Owned(Arc::new(s.values().to_vec()));
        }
        let Store::Owned(v) = &mut self.store else { unreachable!("made owned above") };
        Some(&mut Arc::make_mut(v)[o..o + n])
    }

    /// Arrays of `lens` values read from little-endian bf16 bytes (one bulk copy); `bytes` must
    /// hold exactly their sum.
    pub fn from_le_bytes(bytes: &[u8], lens: &[usize]) -> Result<Self> {
        let total: usize = lens.iter().sum();
        if bytes.len() != total * 2 {
            return Err(CoreError::wire(format!("{} body bytes for {total} values", bytes.len())));
        }
        let mut body = vec![bf16::ZERO; total];
        as_bytes_mut(&mut body).copy_from_slice(bytes);
        Self::from_body(body, lens.iter().copied())
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    pub fn get(&self, k: usize) -> Option<&[bf16]> {
        let &(o, n) = self.spans.get(k)?;
        Some(&self.store.values()[o..o + n])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[bf16]> + '_ {
        let v = self.store.values();
        self.spans.iter().map(move |&(o, n)| &v[o..o + n])
    }

    /// Drop the last array (tests build malformed segments this way).
    pub fn pop(&mut self) -> Option<Vec<bf16>> {
        let a = self.get(self.len().checked_sub(1)?)?.to_vec();
        self.spans.pop();
        Some(a)
    }

    /// Keep the first `n` arrays.
    pub fn truncate(&mut self, n: usize) {
        self.spans.truncate(n);
    }

    /// Every array back to back: the segment's body.
    pub fn body(&self) -> &[bf16] {
        let end = self.spans.last().map_or(0, |&(o, n)| o + n);
        &self.store.values()[..end]
    }

    /// The body as the wire carries it (little-endian bf16: the host's order, see below).
    pub fn body_bytes(&self) -> &[u8] {
        as_bytes(self.body())
    }

    /// Values in all arrays.
    pub fn values(&self) -> usize {
        self.spans.last().map_or(0, |&(o, n)| o + n)
    }
}

impl From<Vec<Vec<bf16>>> for SegmentArrays {
    fn from(arrays: Vec<Vec<bf16>>) -> Self {
        let lens: Vec<usize> = arrays.iter().map(Vec::len).collect();
        Self::from_body(arrays.concat(), lens).expect("the body holds every array")
    }
}

impl PartialEq for SegmentArrays {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}

impl std::fmt::Debug for SegmentArrays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.spans.iter().map(|&(_, n)| format!("[{n} values]"))).finish()
    }
}

impl std::ops::Index<usize> for SegmentArrays {
    type Output = [bf16];
    fn index(&self, k: usize) -> &[bf16] {
        self.get(k).expect("array index in range")
    }
}

impl std::ops::IndexMut<usize> for SegmentArrays {
    fn index_mut(&mut self, k: usize) -> &mut [bf16] {
        self.get_mut(k).expect("array index in range")
    }
}

impl<'a> IntoIterator for &'a SegmentArrays {
    type Item = &'a [bf16];
    type IntoIter = Box<dyn ExactSizeIterator<Item = &'a [bf16]> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

pub(crate) fn as_bytes(v: &[bf16]) -> &[u8] {
    // SAFETY: bf16 is a plain 2-byte value with no padding; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [bf16]) -> &mut [u8] {
    // SAFETY: as for `as_bytes`; every bit pattern is a valid bf16.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_spans_of_one_body() {
        let a = SegmentArrays::from(vec![vec![bf16::ONE; 3], vec![], vec![bf16::ZERO; 2]]);
        assert_eq!((a.len(), a.values(), a.get(1).unwrap().len(), a[2].len()), (3, 5, 0, 2));
        assert_eq!(a.body_bytes().len(), 10);
        let b = SegmentArrays::from_le_bytes(a.body_bytes(), &[3, 0, 2]).unwrap();
        assert_eq!(a, b);
        assert!(SegmentArrays::from_le_bytes(a.body_bytes(), &[3, 0, 3]).is_err());
        let mut c = b.clone();
        assert_eq!(c.pop().unwrap().len(), 2);
        assert!(c != b && c.values() == 3);
        // Writes copy a shared body, never touching the other segment's.
        let shared = SegmentArrays::from_store(Arc::new(vec![bf16::ONE; 4]), [2, 2]).unwrap();
        let mut d = shared.clone();
        d[1][0] = bf16::ZERO;
        assert_eq!((shared[1][0], d[1][0], d[0][0]), (bf16::ONE, bf16::ZERO, bf16::ONE));
    }
}
