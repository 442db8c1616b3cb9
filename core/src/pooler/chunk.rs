//! Which rows of a fed chunk a layer's state takes: the rule every cache builder applies before
//! its family's math (whole rows only, in order, and after a resume only the rows from the resume
//! point on). The pooler's [`super::CacheBuilder`] and DeepSeek-V4.1's builder share it.

use half::bf16;

use crate::error::{CoreError, Result};

/// The part of chunk `x` (`[rows, hidden]` bf16, its first row at token `start`) that layer
/// `layer` folds in next, with the token its first row is at; the layer has processed `processed`
/// tokens and was resumed at `origin` (0: built from the first token). `None`: every row lies
/// before `origin` (the carry state holds them; the prefill engine may recompute from further
/// back). Refused, naming the layer, when the chunk is not whole rows or does not continue the
/// state.
pub(crate) fn admit(layer: usize, hidden: usize, origin: usize, processed: usize, start: usize, x: &[bf16]) -> Result<Option<(usize, &[bf16])>> {
    if x.is_empty() || x.len() % hidden != 0 {
        return Err(CoreError::input(layer, format!("{} values is not a positive whole number of rows of width {hidden}", x.len())));
    }
    let (start, x) = if start < origin {
        let skip = (origin - start).min(x.len() / hidden);
        if skip * hidden == x.len() {
            return Ok(None);
        }
        (origin, &x[skip * hidden..])
    } else {
        (start, x)
    };
    if start != processed {
        let why = if processed == origin && origin > 0 {
            format!("chunk starts at token {start} but the state resumed at {origin}: rows [{origin}, {start}) were never fed (a resumed capture needs every row from its resume point on)")
        } else {
            format!("chunk starts at token {start} but {processed} tokens are processed")
        };
        return Err(CoreError::input(layer, why));
    }
    Ok(Some((start, x)))
}
