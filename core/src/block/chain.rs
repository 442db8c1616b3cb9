//! oMLX's block chain hash: block `i` covers tokens `[i·B, (i+1)·B)` and its key is
//! `sha256(model_name ‖ parent_digest or b"omlx-root" ‖ str(tuple(token_ids)))`, where
//! `str(tuple(...))` is Python's rendering (`"(1, 2, 3)"`, `"(5,)"`). Only full blocks are keyed.

use sha2::{Digest, Sha256};

/// A block's 32-byte key; its hex form names the block file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChainHash(pub [u8; 32]);

impl ChainHash {
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(ChainHash(out))
    }
}

impl std::fmt::Debug for ChainHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChainHash({})", self.hex())
    }
}

/// Python's `str(tuple(ids))` for a list of ints.
fn python_tuple(ids: &[u32]) -> String {
    match ids {
        [] => "()".to_string(),
        [one] => format!("({one},)"),
        _ => {
            let mut s = String::with_capacity(ids.len() * 7 + 2);
            s.push('(');
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                s.push_str(&id.to_string());
            }
            s.push(')');
            s
        }
    }
}

/// The key of one block given its parent's key (None for the first block).
pub fn block_hash(model_name: &str, parent: Option<&ChainHash>, tokens: &[u32]) -> ChainHash {
    let mut h = Sha256::new();
    h.update(model_name.as_bytes());
    match parent {
        Some(p) => h.update(p.0),
        None => h.update(b"omlx-root"),
    }
    h.update(python_tuple(tokens).as_bytes());
    ChainHash(h.finalize().into())
}

/// Keys of every full block of `tokens`, in chain order.
pub fn chain(model_name: &str, tokens: &[u32], block_size: usize) -> Vec<ChainHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut parent: Option<ChainHash> = None;
    for block in tokens.chunks_exact(block_size.max(1)) {
        let h = block_hash(model_name, parent.as_ref(), block);
        out.push(h);
        parent = Some(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_tuple_rendering() {
        assert_eq!(python_tuple(&[]), "()");
        assert_eq!(python_tuple(&[5]), "(5,)");
        assert_eq!(python_tuple(&[1, 22, 333]), "(1, 22, 333)");
    }

    #[test]
    fn chain_links_parents_and_skips_partial_blocks() {
        let toks: Vec<u32> = (0..10).collect();
        let c = chain("m", &toks, 4);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0], block_hash("m", None, &toks[..4]));
        assert_eq!(c[1], block_hash("m", Some(&c[0]), &toks[4..8]));
        assert_ne!(chain("n", &toks, 4)[0], c[0]);
        assert_eq!(ChainHash::from_hex(&c[1].hex()), Some(c[1]));
        // sha256(b"m" + b"omlx-root" + b"(0, 1, 2, 3)"), computed with Python's hashlib.
        assert_eq!(c[0].hex(), "4e16d356a2bd76ce5742f97a3b24e41aac34996105a29ece0dbbcd9cb787140b");
    }
}
