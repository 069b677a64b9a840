//! A fast path for reading one JSON document into a serde type, in front of serde_json.
//!
//! A trace line is mostly arrays of short decimal numbers (a gen-demo record has ~160 of
//! them), and serde_json spends ~25 ns on each. This reader parses the structure itself
//! (objects, arrays, `true`, `false`, `null`) and the common tokens: strings without escapes
//! (borrowed, as serde_json gives them) and non-negative numbers whose value it can compute
//! exactly as serde_json does (an integer of at most 19 digits, or a decimal whose digits
//! make an integer up to 2^53 with at most 22 of them after the point: that integer divided
//! by the power of ten, one correctly rounded division, which is serde_json's own
//! computation for such numbers and also the correctly rounded value). Any other number or
//! string (a negative number, an exponent, an escape) is handed, that token alone, to
//! serde_json, which visits the target type exactly as it would inside the document.
//!
//! Anything else — a syntax error, or any error the target type raises (a wrong type, a
//! duplicate or missing field) — abandons the fast path, and the document is read again by
//! `serde_json::from_slice`. So the value, and every error with its message, is exactly
//! serde_json's; the fast path only accepts documents serde_json accepts, with the same
//! visits of the target type's visitor.

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};
use std::fmt;

/// `serde_json::from_slice`, with the fast path first (see the module docs).
pub fn from_slice<T: DeserializeOwned>(input: &[u8]) -> Result<T, serde_json::Error> {
    match fast(input) {
        Some(v) => Ok(v),
        None => serde_json::from_slice(input),
    }
}

/// The document read by the fast path alone; `None` when it cannot (then serde_json must).
pub fn fast<T: DeserializeOwned>(input: &[u8]) -> Option<T> {
    let mut de = Fast {
        s: input,
        i: 0,
        depth: 0,
    };
    let v = T::deserialize(&mut de).ok()?;
    de.ws();
    (de.i == input.len()).then_some(v)
}

/// The fast path gave up; nothing more is needed, serde_json reports the real error.
#[derive(Debug)]
pub struct Bail;

impl fmt::Display for Bail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not on the fast path")
    }
}

impl std::error::Error for Bail {}

impl de::Error for Bail {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Bail
    }
}

type R<T> = Result<T, Bail>;

/// serde_json nests at most 128 levels; stay well inside that.
const MAX_DEPTH: u32 = 100;

/// Exact powers of ten as f64 (10^0 ..= 10^22).
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

enum Num {
    U64(u64),
    F64(f64),
}

struct Fast<'de> {
    s: &'de [u8],
    i: usize,
    depth: u32,
}

impl<'de> Fast<'de> {
    #[inline]
    fn ws(&mut self) {
        while let Some(&c) = self.s.get(self.i) {
            if matches!(c, b' ' | b'\n' | b'\t' | b'\r') {
                self.i += 1;
            } else {
                break;
            }
        }
    }

    /// The next non-blank byte, not consumed.
    #[inline]
    fn peek(&mut self) -> R<u8> {
        self.ws();
        self.s.get(self.i).copied().ok_or(Bail)
    }

    #[inline]
    fn expect(&mut self, c: u8) -> R<()> {
        if self.peek()? == c {
            self.i += 1;
            Ok(())
        } else {
            Err(Bail)
        }
    }

    /// Digits from `self.i`: their value (meaningful up to 19 of them) and count.
    #[inline]
    fn digits(&mut self) -> (u64, usize) {
        let start = self.i;
        let mut v = 0u64;
        while let Some(&c) = self.s.get(self.i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            v = v.wrapping_mul(10).wrapping_add(u64::from(d));
            self.i += 1;
        }
        (v, self.i - start)
    }

    /// The number at `self.i` if it is one computed here (see the module docs); `None`
    /// when serde_json must read it (then where `self.i` is left is unspecified).
    #[inline]
    fn fast_number(&mut self) -> Option<Num> {
        let first = *self.s.get(self.i)?;
        let (int, n) = self.digits();
        if n == 0 || n > 19 || (first == b'0' && n > 1) {
            return None;
        }
        match self.s.get(self.i) {
            Some(b'.') => {
                self.i += 1;
                let (frac, m) = self.digits();
                if m == 0 || m > 22 || n + m > 19 {
                    return None;
                }
                let sig = int * 10u64.pow(m as u32) + frac;
                if sig > 1 << 53 || matches!(self.s.get(self.i), Some(b'e' | b'E')) {
                    return None;
                }
                Some(Num::F64(sig as f64 / POW10[m]))
            }
            Some(b'e' | b'E') => None,
            _ => Some(Num::U64(int)),
        }
    }

    /// Skip a number: a plain one (digits, maybe a fraction) is only scanned, like serde_json
    /// ignores one; any other is checked by serde_json.
    #[inline]
    fn skip_number(&mut self) -> R<()> {
        let start = self.i;
        let first = self.s.get(self.i).copied();
        let n = self.scan_digits();
        let mut plain = n > 0 && !(first == Some(b'0') && n > 1);
        if plain && self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            plain = self.scan_digits() > 0;
        }
        if plain && !matches!(self.s.get(self.i), Some(b'e' | b'E' | b'.' | b'+' | b'-')) {
            return Ok(());
        }
        self.i = start;
        self.visit_number(de::IgnoredAny).map(drop)
    }

    /// Digits from `self.i`, skipped; their count.
    #[inline]
    fn scan_digits(&mut self) -> usize {
        let start = self.i;
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - start
    }

    /// The bytes from `start` up to the end of a number-like token (serde_json checks them).
    fn number_token(&mut self, start: usize) -> &'de [u8] {
        self.i = start;
        while let Some(c) = self.s.get(self.i) {
            if !matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E') {
                break;
            }
            self.i += 1;
        }
        &self.s[start..self.i]
    }

    /// A number visited as serde_json visits it: computed here when it can be, else by
    /// serde_json from the token alone.
    #[inline]
    fn visit_number<V: Visitor<'de>>(&mut self, visitor: V) -> R<V::Value> {
        self.ws();
        let start = self.i;
        match self.fast_number() {
            Some(Num::U64(v)) => visitor.visit_u64(v),
            Some(Num::F64(v)) => visitor.visit_f64(v),
            None => {
                let token = self.number_token(start);
                if token.is_empty() {
                    return Err(Bail);
                }
                let mut de = serde_json::Deserializer::from_slice(token);
                let v = de::Deserializer::deserialize_any(&mut de, visitor).map_err(|_| Bail)?;
                de.end().map_err(|_| Bail)?;
                Ok(v)
            }
        }
    }

    /// A string token: borrowed from the input when it has no escapes (nor control
    /// characters: serde_json refuses them), else the whole token read by serde_json.
    #[inline]
    fn visit_string<V: Visitor<'de>>(&mut self, visitor: V) -> R<V::Value> {
        self.expect(b'"')?;
        let start = self.i;
        let rest = &self.s[start..];
        let len = memchr::memchr2(b'"', b'\\', rest).ok_or(Bail)?;
        if rest[len] == b'"' && !rest[..len].iter().any(|&c| c < 0x20) {
            self.i = start + len + 1;
            let s = std::str::from_utf8(&rest[..len]).map_err(|_| Bail)?;
            return visitor.visit_borrowed_str(s);
        }
        // the token's end: the first quote not escaped
        let mut j = start;
        loop {
            j += memchr::memchr2(b'"', b'\\', &self.s[j..]).ok_or(Bail)?;
            if self.s[j] == b'"' {
                break;
            }
            j += 2;
            if j > self.s.len() {
                return Err(Bail);
            }
        }
        self.i = j + 1;
        let mut de = serde_json::Deserializer::from_slice(&self.s[start - 1..self.i]);
        let v = de::Deserializer::deserialize_str(&mut de, visitor).map_err(|_| Bail)?;
        de.end().map_err(|_| Bail)?;
        Ok(v)
    }

    fn literal(&mut self, word: &[u8]) -> R<()> {
        if self.s[self.i..].starts_with(word) {
            self.i += word.len();
            Ok(())
        } else {
            Err(Bail)
        }
    }

    /// Skip one value, as strictly as serde_json checks an ignored one (or more strictly).
    fn skip(&mut self) -> R<()> {
        match self.peek()? {
            b'"' => self.visit_string(de::IgnoredAny).map(drop),
            b'{' | b'[' => {
                let close = if self.s[self.i] == b'{' { b'}' } else { b']' };
                let object = close == b'}';
                self.enter()?;
                self.i += 1;
                if self.peek()? == close {
                    self.i += 1;
                } else {
                    loop {
                        if object {
                            self.visit_string(de::IgnoredAny)?;
                            self.expect(b':')?;
                        }
                        self.skip()?;
                        match self.peek()? {
                            b',' => self.i += 1,
                            c if c == close => {
                                self.i += 1;
                                break;
                            }
                            _ => return Err(Bail),
                        }
                    }
                }
                self.depth -= 1;
                Ok(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.skip_number(),
        }
    }

    fn enter(&mut self) -> R<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Bail);
        }
        Ok(())
    }

    fn seq<V: Visitor<'de>>(&mut self, visitor: V) -> R<V::Value> {
        self.expect(b'[')?;
        self.enter()?;
        let v = visitor.visit_seq(Seq {
            de: &mut *self,
            first: true,
        })?;
        self.depth -= 1;
        self.expect(b']')?;
        Ok(v)
    }

    fn map<V: Visitor<'de>>(&mut self, visitor: V) -> R<V::Value> {
        self.expect(b'{')?;
        self.enter()?;
        let v = visitor.visit_map(Map {
            de: &mut *self,
            first: true,
        })?;
        self.depth -= 1;
        self.expect(b'}')?;
        Ok(v)
    }
}

macro_rules! numbers {
    ($($name:ident)*) => {$(
        #[inline]
        fn $name<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
            self.visit_number(visitor)
        }
    )*};
}

macro_rules! bail {
    ($($name:ident)*) => {$(
        fn $name<V: Visitor<'de>>(self, _: V) -> R<V::Value> {
            Err(Bail)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for &mut Fast<'de> {
    type Error = Bail;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        match self.peek()? {
            b'"' => self.visit_string(visitor),
            b'[' => self.seq(visitor),
            b'{' => self.map(visitor),
            b't' => {
                self.literal(b"true")?;
                visitor.visit_bool(true)
            }
            b'f' => {
                self.literal(b"false")?;
                visitor.visit_bool(false)
            }
            b'n' => {
                self.literal(b"null")?;
                visitor.visit_unit()
            }
            _ => self.visit_number(visitor),
        }
    }

    numbers!(deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_f32 deserialize_f64);

    bail!(deserialize_char deserialize_bytes deserialize_byte_buf);

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        match self.peek()? {
            b't' | b'f' => self.deserialize_any(visitor),
            _ => Err(Bail),
        }
    }

    #[inline]
    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.visit_string(visitor)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            visitor.visit_none()
        } else {
            visitor.visit_some(self)
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.peek()?;
        self.literal(b"null")?;
        visitor.visit_unit()
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, v: V) -> R<V::Value> {
        self.deserialize_unit(v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> R<V::Value> {
        // serde_json's raw values go by a private name: leave them to it
        if name.starts_with('$') {
            return Err(Bail);
        }
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.seq(visitor)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, visitor: V) -> R<V::Value> {
        self.seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        visitor: V,
    ) -> R<V::Value> {
        self.seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.map(visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> R<V::Value> {
        // (serde_json also takes a struct as an array; that is left to it)
        self.map(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> R<V::Value> {
        // unit variants only (a plain string); the rest is left to serde_json
        let s = self.visit_string(Borrowed)?;
        visitor.visit_enum(s.into_deserializer())
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.skip()?;
        visitor.visit_unit()
    }
}

/// A string borrowed from the input, or nothing.
struct Borrowed;

impl<'de> Visitor<'de> for Borrowed {
    type Value = &'de str;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string without escapes")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<&'de str, E> {
        Ok(v)
    }
}

struct Seq<'a, 'de> {
    de: &'a mut Fast<'de>,
    first: bool,
}

impl<'de> de::SeqAccess<'de> for Seq<'_, 'de> {
    type Error = Bail;

    #[inline]
    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> R<Option<T::Value>> {
        match self.de.peek()? {
            b']' => return Ok(None),
            b',' if !self.first => self.de.i += 1,
            _ if self.first => {}
            _ => return Err(Bail),
        }
        self.first = false;
        seed.deserialize(&mut *self.de).map(Some)
    }
}

struct Map<'a, 'de> {
    de: &'a mut Fast<'de>,
    first: bool,
}

impl<'de> de::MapAccess<'de> for Map<'_, 'de> {
    type Error = Bail;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> R<Option<K::Value>> {
        match self.de.peek()? {
            b'}' => return Ok(None),
            b',' if !self.first => self.de.i += 1,
            _ if self.first => {}
            _ => return Err(Bail),
        }
        self.first = false;
        if self.de.peek()? != b'"' {
            return Err(Bail);
        }
        seed.deserialize(MapKey { de: &mut *self.de }).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> R<V::Value> {
        self.de.expect(b':')?;
        seed.deserialize(&mut *self.de)
    }
}

/// A map key: a string, whatever type the key is read as (serde_json reads numeric keys
/// out of strings too; that is left to it).
struct MapKey<'a, 'de> {
    de: &'a mut Fast<'de>,
}

impl<'de> de::Deserializer<'de> for MapKey<'_, 'de> {
    type Error = Bail;

    #[inline]
    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.de.visit_string(visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> R<V::Value> {
        self.de.visit_string(de::IgnoredAny)?;
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        str string identifier
    }

    bail!(deserialize_bool deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_f32 deserialize_f64 deserialize_char deserialize_bytes
        deserialize_byte_buf deserialize_option deserialize_unit deserialize_seq deserialize_map);

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, _: V) -> R<V::Value> {
        Err(Bail)
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, _: V) -> R<V::Value> {
        Err(Bail)
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, _: V) -> R<V::Value> {
        Err(Bail)
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        _: V,
    ) -> R<V::Value> {
        Err(Bail)
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> R<V::Value> {
        Err(Bail)
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> R<V::Value> {
        Err(Bail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRecord;
    use serde_json::Value;

    /// The fast path's value is serde_json's, or it declines.
    fn same<T: DeserializeOwned + PartialEq + fmt::Debug>(text: &str, expect_fast: bool) {
        let fast = fast::<T>(text.as_bytes());
        assert_eq!(fast.is_some(), expect_fast, "{text}");
        if let Some(v) = fast {
            let slow: T = serde_json::from_slice(text.as_bytes()).unwrap();
            assert_eq!(v, slow, "{text}");
        }
    }

    #[test]
    fn numbers_are_serde_jsons_bit_for_bit() {
        let mut x = 0x9e3779b97f4a7c15u64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let digits = (x % 16) as u32 + 1;
            let int = (x >> 8) % 10u64.pow(digits.min(15));
            let frac_len = ((x >> 40) % 9) as usize;
            let frac = (x >> 20) % 10u64.pow(frac_len as u32);
            let text = if frac_len == 0 {
                format!("{int}")
            } else {
                format!("{int}.{frac:0frac_len$}")
            };
            let a: f64 = fast(text.as_bytes()).unwrap_or_else(|| panic!("{text}"));
            let b: f64 = serde_json::from_str(&text).unwrap();
            assert_eq!(a.to_bits(), b.to_bits(), "{text}");
            let v: Value = fast(text.as_bytes()).unwrap();
            assert_eq!(v, serde_json::from_str::<Value>(&text).unwrap());
        }
        // read by serde_json, token by token: the same values
        for s in [
            "1e3",
            "-1",
            "-0",
            "-0.0",
            "1.5e2",
            "99999999999999999999",
            "-12.5",
            "1E-7",
        ] {
            same::<Value>(s, true);
            same::<f64>(s, true);
        }
        for s in ["01", "1.", ".5", "1.2.3", "--1", "1e", "+1", "-"] {
            same::<Value>(s, false);
        }
        same::<f64>("9007199254740993.0", true);
        same::<f64>("900719925474099.3", true);
        same::<u64>("18446744073709551615", true);
        same::<u64>("18446744073709551616", false);
        same::<u32>("4294967296", false);
    }

    #[test]
    fn records_and_values_match_or_decline() {
        same::<TraceRecord>(
            r#"{"request_id":"a b","prompt_tokens":3,"output_tokens":4,"arrival_ms":1.5,"ttft_ms":20.25,"itl_ms":[1.0,2,3.125],"itl_tokens":[1,2,1],"itl_ctx":{"num_running":[1,2],"prefill_tokens":[0,5]},"block_hashes":[1,"x"],"finish_reason":"stop","incomplete":false,"unknown":{"a":[true,null,"z",{}]}}"#,
            true,
        );
        same::<TraceRecord>(" { \"prompt_tokens\" : 3 , \"itl_ms\" : [ ] } ", true);
        // escapes are serde_json's to read; then a duplicate key, a wrong type, trailing
        // text, a trailing comma, a control character
        same::<TraceRecord>(
            r#"{"request_id":"a\"b\\","finish_reason":"\u00e9\n"}"#,
            true,
        );
        same::<Value>(r#"{"k\"ey":"\ud83d\ude00","x":"\\"}"#, true);
        same::<Value>(r#"{"k":"\ud83d"}"#, false);
        same::<Value>(r#"{"k":"a\"#, false);
        same::<TraceRecord>(r#"{"prompt_tokens":3,"prompt_tokens":4}"#, false);
        same::<TraceRecord>(r#"{"prompt_tokens":3.5}"#, false);
        same::<TraceRecord>(r#"{"prompt_tokens":3} x"#, false);
        same::<TraceRecord>(r#"{"itl_ms":[1,]}"#, false);
        same::<TraceRecord>(r#"{"x":[1 2]}"#, false);
        same::<TraceRecord>("{\"request_id\":\"a\tb\"}", false);
        same::<Value>(r#"{"b":1,"a":[1.5,"x",null,true,false,{"c":{}}]}"#, true);
        // errors are serde_json's own
        let e = from_slice::<TraceRecord>(br#"{"prompt_tokens":3,"prompt_tokens":4}"#);
        let s = serde_json::from_slice::<TraceRecord>(br#"{"prompt_tokens":3,"prompt_tokens":4}"#);
        assert_eq!(e.unwrap_err().to_string(), s.unwrap_err().to_string());
    }
}
