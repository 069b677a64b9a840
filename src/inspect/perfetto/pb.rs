//! A small protocol-buffers encoder: just what the Perfetto writer needs (varints,
//! fixed 64-bit doubles, length-delimited strings and nested messages), written into one
//! growable buffer.
//!
//! Wire format facts used here: a field is a key `(field_number << 3) | wire_type` as a
//! varint, then its value; wire type 0 is a varint (7 bits a byte, least significant group
//! first, the high bit set on every byte but the last), 1 a little-endian 64-bit value,
//! 2 a varint length and that many bytes. A negative `int32`/`int64` is the varint of its
//! 64-bit two's complement (10 bytes).
//!
//! A nested message's length comes before its bytes but is only known after them: one byte
//! is reserved for it, and the rare message of 128 bytes or more is shifted right to make
//! room for a longer length, so small messages (nearly all of a trace) cost no copy.

const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;

/// Bytes of a protobuf message under construction.
#[derive(Debug, Default)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The encoded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn clear(&mut self) {
        self.buf.clear();
    }

    /// A bare varint (no key).
    pub fn raw_varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    fn key(&mut self, field: u32, wire_type: u32) {
        self.raw_varint(u64::from((field << 3) | wire_type));
    }

    /// `uint32`, `uint64`, `bool` and enum fields.
    pub fn uint(&mut self, field: u32, v: u64) {
        self.key(field, VARINT);
        self.raw_varint(v);
    }

    /// `int32` and `int64` fields (negative values take 10 bytes, as the format says).
    pub fn int(&mut self, field: u32, v: i64) {
        self.uint(field, v as u64);
    }

    pub fn bool(&mut self, field: u32, v: bool) {
        self.uint(field, u64::from(v));
    }

    /// `double` fields.
    pub fn double(&mut self, field: u32, v: f64) {
        self.key(field, FIXED64);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// `bytes` fields and embedded messages already encoded.
    pub fn bytes_field(&mut self, field: u32, v: &[u8]) {
        self.key(field, LEN);
        self.raw_varint(v.len() as u64);
        self.buf.extend_from_slice(v);
    }

    /// Whole fields written in place by `write` into `N` bytes of room at the end, of which
    /// it returns how many it used (the rest is dropped). Built on the stack and copied
    /// instead, the copy's wide loads of bytes just stored one at a time stalled on store
    /// forwarding: a third of the Perfetto writer's slices.
    pub fn write_in_place<const N: usize>(&mut self, write: impl FnOnce(&mut [u8; N]) -> usize) {
        let len = self.buf.len();
        self.buf.resize(len + N, 0);
        let room: &mut [u8; N] = (&mut self.buf[len..len + N])
            .try_into()
            .expect("N bytes of room");
        let used = write(room);
        self.buf.truncate(len + used.min(N));
    }

    /// `string` fields.
    pub fn string(&mut self, field: u32, v: &str) {
        self.bytes_field(field, v.as_bytes());
    }

    /// Bytes encoded so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// An embedded message, written by `f` in place.
    pub fn message(&mut self, field: u32, f: impl FnOnce(&mut Encoder)) {
        let at = self.begin_message(field);
        f(self);
        self.end_message(at);
    }

    /// Start an embedded message whose fields the caller writes next; returns where its
    /// length goes, for [`end_message`](Self::end_message) (for messages built across
    /// several calls, such as a trace packet).
    pub fn begin_message(&mut self, field: u32) -> usize {
        self.key(field, LEN);
        let at = self.buf.len();
        self.buf.push(0);
        at
    }

    /// End the message begun at `at`: write its length.
    pub fn end_message(&mut self, at: usize) {
        let len = self.buf.len() - at - 1;
        if len < 0x80 {
            self.buf[at] = len as u8;
            return;
        }
        let mut prefix = [0u8; 10];
        let mut n = 0;
        let mut v = len as u64;
        while v >= 0x80 {
            prefix[n] = (v as u8) | 0x80;
            v >>= 7;
            n += 1;
        }
        prefix[n] = v as u8;
        n += 1;
        // make room: the body moves right by the extra length bytes
        self.buf.splice(at..at + 1, prefix[..n].iter().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(v: u64) -> Vec<u8> {
        let mut e = Encoder::new();
        e.raw_varint(v);
        e.bytes().to_vec()
    }

    #[test]
    fn varints_are_seven_bits_a_byte_low_group_first() {
        assert_eq!(varint(0), [0x00]);
        assert_eq!(varint(1), [0x01]);
        assert_eq!(varint(127), [0x7f]);
        assert_eq!(varint(128), [0x80, 0x01]);
        assert_eq!(varint(300), [0xac, 0x02]);
        assert_eq!(varint(16_383), [0xff, 0x7f]);
        assert_eq!(varint(16_384), [0x80, 0x80, 0x01]);
        assert_eq!(varint(u64::from(u32::MAX)), [0xff, 0xff, 0xff, 0xff, 0x0f]);
        let mut max = vec![0xff; 9];
        max.push(0x01);
        assert_eq!(varint(u64::MAX), max);
    }

    #[test]
    fn fields_carry_their_number_and_wire_type() {
        let mut e = Encoder::new();
        e.uint(1, 150);
        assert_eq!(e.bytes(), [0x08, 0x96, 0x01]);

        // a field number past 15 takes a two-byte key: 60 << 3 | 2 = 482
        let mut e = Encoder::new();
        e.string(60, "ab");
        assert_eq!(e.bytes(), [0xe2, 0x03, 0x02, b'a', b'b']);

        let mut e = Encoder::new();
        e.string(2, "");
        assert_eq!(e.bytes(), [0x12, 0x00]);

        // negative int64: ten bytes of two's complement
        let mut e = Encoder::new();
        e.int(4, -1);
        assert_eq!(
            e.bytes(),
            [
                0x20, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
            ]
        );

        let mut e = Encoder::new();
        e.bool(2, true);
        e.bool(2, false);
        assert_eq!(e.bytes(), [0x10, 0x01, 0x10, 0x00]);

        // double: key 44 << 3 | 1 = 353, then 1.5 little-endian (0x3ff8000000000000)
        let mut e = Encoder::new();
        e.double(44, 1.5);
        assert_eq!(e.bytes(), [0xe1, 0x02, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f]);
    }

    #[test]
    fn nested_messages_get_their_length_before_them() {
        let mut e = Encoder::new();
        e.message(1, |m| {
            m.uint(8, 1000);
            m.message(11, |t| t.uint(9, 1));
        });
        assert_eq!(
            e.bytes(),
            [0x0a, 0x07, 0x40, 0xe8, 0x07, 0x5a, 0x02, 0x48, 0x01]
        );

        // an empty message is a key and a zero length
        let mut e = Encoder::new();
        e.message(8, |_| {});
        assert_eq!(e.bytes(), [0x42, 0x00]);
    }

    #[test]
    fn a_long_nested_message_moves_over_for_a_longer_length() {
        for len in [127usize, 128, 300, 20_000] {
            let body = "x".repeat(len);
            let mut e = Encoder::new();
            e.uint(1, 7);
            e.message(2, |m| m.string(3, &body));
            // inner: key 0x1a, varint(len), body
            let mut inner = vec![0x1a];
            inner.extend(varint(len as u64));
            inner.extend(body.as_bytes());
            let mut want = vec![0x08, 0x07, 0x12];
            want.extend(varint(inner.len() as u64));
            want.extend(&inner);
            assert_eq!(e.bytes(), &want[..], "body of {len} bytes");
        }
    }
}
