//! Per-line msgpack encoding, byte-compatible with what msgspec produces for vLLM's structs.
//!
//! - [`encode_outputs`]: the engine's hot path, `EngineCoreOutputs` → `[payload, aux…]`;
//! - [`encode_request`], [`encode_abort`], [`encode_utility`]: what a frontend sends, for
//!   tests, the benchmark client and the record tap.
//!
//! Arrays are laid out by the target line's table, trimmed after their last non-default
//! field and never longer than the line's layout (`vllm-rs` kills its output loop on an
//! over-long array). Everything is written with rmp's low-level writer straight into one
//! buffer; no intermediate `rmpv::Value`s are built per token.

mod input;
mod output;

use bytes::Bytes;
use rmpv::Value;

pub use input::{
    encode_abort, encode_input, encode_request, encode_request_with, encode_sampling_params,
    encode_start_dp_wave, encode_utility,
};
pub use output::{OutputEncoder, encode_outputs, encode_outputs_with};

/// Why an `EngineCoreOutputs` could not be encoded. Each case is a bug in the caller: the
/// frontend would reject (or, for `vllm-rs`, die on) what would have been sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error(
        "refusing to encode an EngineCoreOutputs with nothing set (vllm-rs kills its output dispatcher on one)"
    )]
    EmptyEnvelope,
    #[error(
        "refusing to encode request outputs and a utility reply in one EngineCoreOutputs (vllm-rs kills its output dispatcher on one); send them separately"
    )]
    MixedEnvelope,
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("a length of {0} does not fit msgpack's 32-bit length fields")]
    TooLong(usize),
}

/// Knobs of the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Arrays/tensors of fewer bytes than this are inlined as msgpack ext 3; larger ones go
    /// to an aux frame referenced by index (vLLM's `VLLM_MSGPACK_ZERO_COPY_THRESHOLD`).
    pub inline_threshold: usize,
}

/// vLLM's default `VLLM_MSGPACK_ZERO_COPY_THRESHOLD`.
pub const DEFAULT_INLINE_THRESHOLD: usize = 256;

impl Default for EncodeOptions {
    fn default() -> Self {
        Self {
            inline_threshold: DEFAULT_INLINE_THRESHOLD,
        }
    }
}

/// A msgpack writer over one buffer plus the aux frames that ndarray data spilled into.
/// Writing into a `Vec` cannot fail; lengths beyond `u32` (impossible for real messages) set
/// `overflow` instead of panicking, and the caller turns that into an error.
pub(crate) struct Writer {
    pub buf: Vec<u8>,
    pub aux: Vec<Bytes>,
    pub threshold: usize,
    pub overflow: Option<usize>,
}

impl Writer {
    pub fn new(capacity: usize, threshold: usize) -> Self {
        Self {
            buf: Vec::with_capacity(capacity),
            aux: Vec::new(),
            threshold,
            overflow: None,
        }
    }

    #[inline(always)]
    fn len32(&mut self, n: usize) -> u32 {
        match u32::try_from(n) {
            Ok(n) => n,
            Err(_) => {
                self.overflow = Some(n);
                u32::MAX
            }
        }
    }

    #[inline(always)]
    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub fn bool(&mut self, b: bool) {
        self.buf.push(if b { 0xc3 } else { 0xc2 });
    }

    // Hand-written msgpack markers (the smallest form, as msgspec and rmp choose them):
    // this is the engine's per-token path, so skip rmp's `io::Write` indirection.

    #[inline(always)]
    pub fn uint(&mut self, v: u64) {
        let b = &mut self.buf;
        if v < 128 {
            b.push(v as u8);
        } else if v < 256 {
            b.extend_from_slice(&[0xcc, v as u8]);
        } else if v < 65536 {
            b.push(0xcd);
            b.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v < (1 << 32) {
            b.push(0xce);
            b.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            b.push(0xcf);
            b.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Signed int in msgspec's form (unsigned markers for non-negative values).
    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            return self.uint(v as u64);
        }
        let b = &mut self.buf;
        if v >= -32 {
            b.push(v as i8 as u8);
        } else if v >= -128 {
            b.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= -32768 {
            b.push(0xd1);
            b.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= -(1 << 31) {
            b.push(0xd2);
            b.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            b.push(0xd3);
            b.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    pub fn f32(&mut self, v: f32) {
        self.buf.push(0xca);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    /// A length header: `fix` form below `fix_max`, else the 8-bit form (when `m8` is
    /// given), else the 16- and 32-bit forms.
    #[inline(always)]
    fn header(&mut self, n: usize, fix: u8, fix_max: usize, m8: Option<u8>, m16: u8, m32: u8) {
        let n32 = self.len32(n);
        let b = &mut self.buf;
        if n < fix_max {
            b.push(fix | n as u8);
        } else if let (Some(m), true) = (m8, n < 256) {
            b.extend_from_slice(&[m, n as u8]);
        } else if n < 65536 {
            b.push(m16);
            b.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            b.push(m32);
            b.extend_from_slice(&n32.to_be_bytes());
        }
    }

    #[inline(always)]
    pub fn str(&mut self, s: &str) {
        self.header(s.len(), 0xa0, 32, Some(0xd9), 0xda, 0xdb);
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    #[inline(always)]
    pub fn array(&mut self, n: usize) {
        self.header(n, 0x90, 16, None, 0xdc, 0xdd);
    }

    #[inline(always)]
    pub fn map(&mut self, n: usize) {
        self.header(n, 0x80, 16, None, 0xde, 0xdf);
    }

    /// msgpack ext type 3 (`fixext` when the length is 1, 2, 4, 8 or 16, as msgspec does).
    pub fn ext3(&mut self, data: &[u8]) {
        let n = data.len();
        let n32 = self.len32(n);
        let b = &mut self.buf;
        match n {
            1 => b.push(0xd4),
            2 => b.push(0xd5),
            4 => b.push(0xd6),
            8 => b.push(0xd7),
            16 => b.push(0xd8),
            _ if n < 256 => b.extend_from_slice(&[0xc7, n as u8]),
            _ if n < 65536 => {
                b.push(0xc8);
                b.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                b.push(0xc9);
                b.extend_from_slice(&n32.to_be_bytes());
            }
        }
        b.push(3);
        b.extend_from_slice(data);
    }

    pub fn value(&mut self, v: &Value) {
        let _ = rmpv::encode::write_value(&mut self.buf, v);
    }

    pub fn opt_value(&mut self, v: Option<&Value>) {
        match v {
            Some(v) => self.value(v),
            None => self.nil(),
        }
    }

    pub fn uint_list(&mut self, xs: impl ExactSizeIterator<Item = u64>) {
        self.array(xs.len());
        for x in xs {
            self.uint(x);
        }
    }

    pub fn int_list(&mut self, xs: &[i64]) {
        self.array(xs.len());
        for x in xs {
            self.int(*x);
        }
    }

    /// An ndarray/tensor triple `[dtype, shape, data]`: data inline (ext 3) below the
    /// threshold, else an aux frame referenced by index (index 1 = first aux frame).
    pub fn ndarray(&mut self, dtype: &str, shape: &[u64], data: Vec<u8>) {
        self.array(3);
        self.str(dtype);
        self.uint_list(shape.iter().copied());
        if data.len() < self.threshold {
            self.ext3(&data);
        } else {
            self.aux.push(Bytes::from(data));
            let idx = self.aux.len() as u64;
            self.uint(idx);
        }
    }

    /// Frames `[payload, aux…]`.
    pub fn into_frames(self) -> Vec<Bytes> {
        let mut frames = Vec::with_capacity(1 + self.aux.len());
        frames.push(Bytes::from(self.buf));
        frames.extend(self.aux);
        frames
    }
}
