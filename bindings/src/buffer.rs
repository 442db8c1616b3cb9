//! Zero-copy access to Python buffers, for both wheels. The vLLM wheel targets the 3.10 stable
//! ABI, whose limited API lacks the buffer protocol (pyo3's `PyBuffer` needs 3.11), so the two
//! calls are declared here: `PyObject_GetBuffer` and `PyBuffer_Release` are exported by every
//! CPython 3, and `Py_buffer`'s layout, unchanged since 3.3, is the one 3.11 made part of the
//! stable ABI.

use std::ffi::{c_char, c_int, c_void};

use half::bf16;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::InputError;

#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_RECORDS_RO`: strides and format, read-only is fine.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

/// A C-contiguous buffer held for the lifetime of the view (released on drop, under the
/// interpreter: the view only lives inside a method that holds `Python`).
pub struct ByteView {
    raw: RawBuffer,
}

impl ByteView {
    /// `obj`'s bytes, C-contiguous; `what` names the argument in the errors.
    pub fn get(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let mut raw = RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        };
        // SAFETY: `obj` is a live object and the interpreter is attached (`Bound`).
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut raw, PYBUF_RECORDS_RO) } != 0 {
            let why = PyErr::take(obj.py()).map_or_else(String::new, |e| format!(" ({e})"));
            let ty = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
            return Err(InputError::new_err(format!("{what}: a {ty} is not a buffer{why}; pass bytes, bytearray, memoryview or a numpy array")));
        }
        let view = ByteView { raw };
        if !view.c_contiguous() {
            return Err(InputError::new_err(format!("{what}: buffer is not C-contiguous; pass a contiguous copy (numpy.ascontiguousarray)")));
        }
        Ok(view)
    }

    /// `obj` as bf16 bit patterns (for [`with_bf16`]): raw bytes or 2-byte items, a whole
    /// number of values.
    pub fn bf16(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let view = Self::get(obj, what)?;
        let itemsize = view.raw.itemsize;
        if itemsize != 1 && itemsize != 2 {
            return Err(InputError::new_err(format!("{what}: buffer items are {itemsize} bytes; expected raw bytes or 2-byte bf16 bit patterns")));
        }
        if view.bytes().len() % 2 != 0 {
            return Err(InputError::new_err(format!("{what}: {} bytes is not a whole number of bf16 values", view.bytes().len())));
        }
        Ok(view)
    }

    fn c_contiguous(&self) -> bool {
        let r = &self.raw;
        if !r.suboffsets.is_null() {
            return false;
        }
        if r.strides.is_null() || r.ndim <= 0 {
            return true;
        }
        // SAFETY: with PyBUF_STRIDES the exporter provides `ndim` shape and stride entries.
        let (shape, strides) = unsafe {
            (std::slice::from_raw_parts(r.shape, r.ndim as usize), std::slice::from_raw_parts(r.strides, r.ndim as usize))
        };
        let mut want = r.itemsize;
        for (&n, &st) in shape.iter().zip(strides).rev() {
            if n > 1 && st != want {
                return false;
            }
            want *= n;
        }
        true
    }

    pub fn bytes(&self) -> &[u8] {
        if self.raw.len <= 0 || self.raw.buf.is_null() {
            return &[];
        }
        // SAFETY: a contiguous buffer of `len` bytes at `buf`, alive until released.
        unsafe { std::slice::from_raw_parts(self.raw.buf as *const u8, self.raw.len as usize) }
    }
}

impl Drop for ByteView {
    fn drop(&mut self) {
        // SAFETY: obtained from PyObject_GetBuffer; views are dropped inside the method
        // that took them, with the interpreter attached.
        unsafe { PyBuffer_Release(&mut self.raw) }
    }
}

/// Run `f` on `data` (an even number of bytes, as [`ByteView::bf16`] checks) as little-endian bf16: in place when aligned
/// (bf16 is a plain 2-byte value and the host little-endian), else from a copy.
pub fn with_bf16<T>(data: &[u8], f: impl FnOnce(&[bf16]) -> T) -> T {
    debug_assert!(data.len() % 2 == 0);
    if cfg!(target_endian = "little") && (data.as_ptr() as usize) % std::mem::align_of::<bf16>() == 0 {
        // SAFETY: aligned, `len / 2` whole values, borrowed for the call only.
        f(unsafe { std::slice::from_raw_parts(data.as_ptr() as *const bf16, data.len() / 2) })
    } else {
        let x: Vec<bf16> = data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
        f(&x)
    }
}
