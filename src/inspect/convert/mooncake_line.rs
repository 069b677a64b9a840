//! One line of `--from mooncake`, read and written without a `serde_json::Value` per id.
//!
//! A Mooncake line is mostly its `hash_ids`. Reading them as `Value`s (32 bytes and a
//! branch each, then converted) and writing the record through serde's flattening map
//! serialiser were most of the conversion; here the ids are read straight into a `Vec<u64>`
//! and the record line is written by hand, byte for byte what serde_json writes for the
//! same [`TraceRecord`](sim_trace::trace::TraceRecord). Anything unusual (a bad id, a
//! non-array) is still kept as the `Value` the error message shows.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::inspect::perfetto::json::{float, int, uint};

/// Integers above this lose precision in an `f64` `arrival_ms`.
pub(super) const MAX_EXACT: u64 = 1 << 53;

/// One line of a Mooncake file, read straight from its text: the format's four keys, and
/// the others sorted by name (a repeated key: its last value, as a JSON object keeps).
#[derive(Default)]
pub(super) struct MooncakeIn {
    /// `false` when the line is not a JSON object.
    pub object: bool,
    pub timestamp: Option<Value>,
    pub input_length: Option<Value>,
    pub output_length: Option<Value>,
    pub hash_ids: Option<HashIds>,
    pub extra: BTreeMap<String, Value>,
}

/// `hash_ids` as read.
pub(super) enum HashIds {
    /// `null`: no prefix sharing known, as when the key is missing.
    Null,
    /// An array of non-negative integers: the usual case.
    Ints(Vec<u64>),
    /// An array with something else: its first such element.
    BadElement(Value),
    /// Not an array.
    NotArray(Value),
}

/// A key of a Mooncake line, not copied when it is one of the format's.
enum Key {
    Timestamp,
    InputLength,
    OutputLength,
    HashIds,
    Other(String),
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, k: &str) -> Result<Key, E> {
                Ok(match k {
                    "timestamp" => Key::Timestamp,
                    "input_length" => Key::InputLength,
                    "output_length" => Key::OutputLength,
                    "hash_ids" => Key::HashIds,
                    other => Key::Other(other.to_string()),
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for MooncakeIn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MooncakeIn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MooncakeIn, A::Error> {
                let mut line = MooncakeIn {
                    object: true,
                    ..MooncakeIn::default()
                };
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Timestamp => line.timestamp = Some(map.next_value()?),
                        Key::InputLength => line.input_length = Some(map.next_value()?),
                        Key::OutputLength => line.output_length = Some(map.next_value()?),
                        Key::HashIds => line.hash_ids = Some(map.next_value()?),
                        Key::Other(k) => {
                            line.extra.insert(k, map.next_value()?);
                        }
                    }
                }
                Ok(line)
            }
            // anything else is "not an object", reported by the caller
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MooncakeIn, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MooncakeIn::default())
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<MooncakeIn, E> {
                Ok(MooncakeIn::default())
            }
        }
        d.deserialize_any(V)
    }
}

/// Any JSON value as the `Value` serde_json would build for it, for the visitors below to
/// hand over what they do not read themselves.
struct ToValue;

impl<'de> Visitor<'de> for ToValue {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any valid JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        // serde_json's own rule: a float that is not finite is `null`
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Value, A::Error> {
        Value::deserialize(SeqAccessDeserializer::new(seq))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Value, A::Error> {
        Value::deserialize(MapAccessDeserializer::new(map))
    }
}

/// One element of `hash_ids`: an id, or what stands where one should.
enum Element {
    Id(u64),
    Bad(Value),
}

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Element;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any valid JSON value")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Element, E> {
                Ok(Element::Id(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Element, E> {
                Ok(u64::try_from(v).map_or_else(|_| Element::Bad(Value::from(v)), Element::Id))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Element, E> {
                ToValue.visit_bool(v).map(Element::Bad)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Element, E> {
                ToValue.visit_f64(v).map(Element::Bad)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Element, E> {
                ToValue.visit_str(v).map(Element::Bad)
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Element, E> {
                ToValue.visit_string(v).map(Element::Bad)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Element, E> {
                Ok(Element::Bad(Value::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Element, A::Error> {
                ToValue.visit_seq(seq).map(Element::Bad)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Element, A::Error> {
                ToValue.visit_map(map).map(Element::Bad)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for HashIds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HashIds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any valid JSON value")
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<HashIds, E> {
                Ok(HashIds::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HashIds, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(e) = seq.next_element::<Element>()? {
                    match e {
                        Element::Id(v) => ids.push(v),
                        Element::Bad(v) => {
                            // the rest must still be valid JSON, but only the first is shown
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            return Ok(HashIds::BadElement(v));
                        }
                    }
                }
                Ok(HashIds::Ints(ids))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<HashIds, E> {
                ToValue.visit_bool(v).map(HashIds::NotArray)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<HashIds, E> {
                ToValue.visit_i64(v).map(HashIds::NotArray)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<HashIds, E> {
                ToValue.visit_u64(v).map(HashIds::NotArray)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<HashIds, E> {
                ToValue.visit_f64(v).map(HashIds::NotArray)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HashIds, E> {
                ToValue.visit_str(v).map(HashIds::NotArray)
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<HashIds, E> {
                ToValue.visit_string(v).map(HashIds::NotArray)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<HashIds, A::Error> {
                ToValue.visit_map(map).map(HashIds::NotArray)
            }
        }
        d.deserialize_any(V)
    }
}

/// The record line `--from mooncake` writes for a line, as serde_json writes the
/// [`TraceRecord`](sim_trace::trace::TraceRecord) (fields in its order, empty ones left
/// out) followed by the kept keys under `"mooncake"`. `buf` is cleared first.
pub(super) fn write_record_line(
    buf: &mut Vec<u8>,
    index: u64,
    record: (u32, u32, f64),
    ids: &[u64],
    extra: &BTreeMap<String, Value>,
) -> serde_json::Result<()> {
    let (prompt_tokens, output_tokens, arrival_ms) = record;
    buf.clear();
    buf.extend_from_slice(b"{\"request_id\":\"mooncake-");
    uint(buf, index);
    buf.extend_from_slice(b"\",\"prompt_tokens\":");
    uint(buf, u64::from(prompt_tokens));
    buf.extend_from_slice(b",\"output_tokens\":");
    uint(buf, u64::from(output_tokens));
    buf.extend_from_slice(b",\"arrival_ms\":");
    float(buf, arrival_ms);
    if !ids.is_empty() {
        buf.extend_from_slice(b",\"block_hashes\":[");
        write_ids(buf, ids);
        buf.push(b']');
    }
    if !extra.is_empty() {
        buf.extend_from_slice(b",\"mooncake\":");
        serde_json::to_writer(&mut *buf, extra)?;
    }
    buf.push(b'}');
    Ok(())
}

/// A Mooncake line as `--to mooncake` writes it: the format's keys in its order, the
/// timestamp an integer when it is one (as Mooncake writes it), then the kept keys.
/// `buf` is cleared first.
pub(super) fn write_mooncake_line(
    buf: &mut Vec<u8>,
    record: (f64, u32, u32),
    ids: &[u64],
    extra: &BTreeMap<String, Value>,
) -> serde_json::Result<()> {
    let (timestamp, input_length, output_length) = record;
    buf.clear();
    buf.extend_from_slice(b"{\"timestamp\":");
    if timestamp.fract() == 0.0 && timestamp.abs() < MAX_EXACT as f64 {
        int(buf, timestamp as i64);
    } else {
        float(buf, timestamp);
    }
    buf.extend_from_slice(b",\"input_length\":");
    uint(buf, u64::from(input_length));
    buf.extend_from_slice(b",\"output_length\":");
    uint(buf, u64::from(output_length));
    buf.extend_from_slice(b",\"hash_ids\":[");
    write_ids(buf, ids);
    buf.push(b']');
    for (k, v) in extra {
        buf.push(b',');
        serde_json::to_writer(&mut *buf, k)?;
        buf.push(b':');
        serde_json::to_writer(&mut *buf, v)?;
    }
    buf.push(b'}');
    Ok(())
}

/// Comma-separated integers.
fn write_ids(buf: &mut Vec<u8>, ids: &[u64]) {
    if let Some((first, rest)) = ids.split_first() {
        uint(buf, *first);
        for id in rest {
            buf.push(b',');
            uint(buf, *id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sim_trace::trace::{BlockHash, TraceRecord};

    /// The hand-written line is serde_json's for the same record, with and without ids
    /// and kept keys, for integer and fractional arrivals.
    #[test]
    fn the_line_is_what_serde_writes() {
        #[derive(serde::Serialize)]
        struct Line<'a> {
            #[serde(flatten)]
            record: &'a TraceRecord,
            #[serde(rename = "mooncake", skip_serializing_if = "BTreeMap::is_empty")]
            extra: BTreeMap<String, Value>,
        }
        let mut extra = BTreeMap::new();
        extra.insert("session_id".to_string(), Value::from("a\"b"));
        extra.insert("delay".to_string(), Value::from(1.5));
        for (arrival, ids, extra) in [
            (27482.0, vec![46, 47, u64::MAX], BTreeMap::new()),
            (0.125, vec![], extra.clone()),
            (1e300, vec![0], extra),
        ] {
            let record = TraceRecord {
                request_id: Some("mooncake-7".into()),
                prompt_tokens: 6472,
                output_tokens: 26,
                arrival_ms: Some(arrival),
                block_hashes: ids.iter().map(|v| BlockHash::Int(*v)).collect(),
                ..TraceRecord::default()
            };
            let want = serde_json::to_vec(&Line {
                record: &record,
                extra: extra.clone(),
            })
            .unwrap();
            let mut got = Vec::new();
            write_record_line(&mut got, 7, (6472, 26, arrival), &ids, &extra).unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                String::from_utf8(want).unwrap()
            );
        }
    }

    /// The hand-written Mooncake line is serde_json's for the same values.
    #[test]
    fn the_mooncake_line_is_what_serde_writes() {
        #[derive(serde::Serialize)]
        struct Line<'a> {
            timestamp: Value,
            input_length: u32,
            output_length: u32,
            hash_ids: &'a [u64],
            #[serde(flatten)]
            extra: BTreeMap<String, Value>,
        }
        let mut extra = BTreeMap::new();
        extra.insert("session_id".to_string(), Value::from("a\"b\n"));
        extra.insert("delay".to_string(), serde_json::json!({"x": [1, 2.5]}));
        for (t, ids, extra) in [
            (27482.0f64, vec![46, 47, u64::MAX], BTreeMap::new()),
            (0.125, vec![], extra.clone()),
            (-3.0, vec![0], extra.clone()),
            (1e300, vec![1], extra),
        ] {
            let timestamp = if t.fract() == 0.0 && t.abs() < MAX_EXACT as f64 {
                Value::from(t as i64)
            } else {
                Value::from(t)
            };
            let want = serde_json::to_vec(&Line {
                timestamp,
                input_length: 6472,
                output_length: 26,
                hash_ids: &ids,
                extra: extra.clone(),
            })
            .unwrap();
            let mut got = Vec::new();
            write_mooncake_line(&mut got, (t, 6472, 26), &ids, &extra).unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                String::from_utf8(want).unwrap()
            );
        }
    }

    /// Ids are read as integers; the first element that is not one, and a value that is
    /// not an array, are kept as serde_json reads them (the error shows them).
    #[test]
    fn ids_and_what_stands_for_them() {
        let read = |s: &str| sim_trace::fastjson::from_slice::<MooncakeIn>(s.as_bytes()).unwrap();
        let ids = |s: &str| read(s).hash_ids;
        assert!(matches!(ids(r#"{"hash_ids":[1,2,3]}"#), Some(HashIds::Ints(v)) if v == [1, 2, 3]));
        assert!(matches!(ids(r#"{"hash_ids":null}"#), Some(HashIds::Null)));
        assert!(ids(r#"{"timestamp":1}"#).is_none());
        for (text, shown) in [
            (r#"{"hash_ids":[1,-2,"x"]}"#, "-2"),
            (r#"{"hash_ids":[1,2.5]}"#, "2.5"),
            (r#"{"hash_ids":[{"a":[1]},3]}"#, r#"{"a":[1]}"#),
        ] {
            match ids(text) {
                Some(HashIds::BadElement(v)) => assert_eq!(v.to_string(), shown, "{text}"),
                _ => panic!("{text}: not a bad element"),
            }
        }
        match ids(r#"{"hash_ids":{"k":"v"}}"#) {
            Some(HashIds::NotArray(v)) => assert_eq!(v.to_string(), r#"{"k":"v"}"#),
            _ => panic!("not read as a non-array"),
        }
        assert!(!read("[1]").object);
        assert!(read(r#"{"z":1,"a":2}"#).extra.keys().eq(["a", "z"]));
    }
}
