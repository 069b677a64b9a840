//! Small typed readers over [`rmpv::Value`] with msgspec's leniency (ints for floats,
//! float32 or float64) and field-named errors.

use bytes::Bytes;
use rmpv::Value;

use super::{DecodeErrorKind, MAX_DEPTH};
use crate::types::Tensor;

pub(crate) type R<T> = Result<T, DecodeErrorKind>;

/// A short name of a value's msgpack type, for error messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "bool",
        Value::Integer(_) => "int",
        Value::F32(_) => "float32",
        Value::F64(_) => "float64",
        Value::String(s) if s.is_str() => "str",
        Value::String(_) => "invalid UTF-8 str",
        Value::Binary(_) => "bin",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "ext",
    }
}

fn wrong(field: &str, expected: &'static str, v: &Value) -> DecodeErrorKind {
    DecodeErrorKind::WrongType {
        field: field.to_string(),
        expected,
        found: kind(v),
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> DecodeErrorKind {
    DecodeErrorKind::InvalidValue {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// Read one msgpack value that must span the whole buffer.
pub(crate) fn read_whole(buf: &[u8]) -> R<Value> {
    let mut cur = buf;
    let v = rmpv::decode::read_value_with_max_depth(&mut cur, MAX_DEPTH)
        .map_err(|e| DecodeErrorKind::NotMsgpack(e.to_string()))?;
    if !cur.is_empty() {
        return Err(DecodeErrorKind::TrailingBytes(cur.len()));
    }
    Ok(v)
}

/// A top-level array whose element `index`, when it is an array of token ids, is read
/// straight into a flat vector (4 bytes an id, instead of a msgpack `Value` each) and
/// refused, before any of it is read, when it claims more than `max` ids.
pub(crate) struct TokenField {
    pub index: usize,
    pub max: usize,
    pub name: &'static str,
}

/// Read a top-level array element by element, so that the elements read before a failure
/// are available for error context. Returns the elements read and the error, if any.
pub(crate) fn read_top_array(buf: &[u8], what: &str) -> (Vec<Value>, Option<DecodeErrorKind>) {
    let (items, _, err) = read_top_array_with(buf, what, None);
    (items, err)
}

/// [`read_top_array`], with `tokens` read flat (its place in the items is nil).
pub(crate) fn read_top_array_with(
    buf: &[u8],
    what: &str,
    tokens: Option<&TokenField>,
) -> (Vec<Value>, Option<Vec<u32>>, Option<DecodeErrorKind>) {
    let mut flat = None;
    let mut cur = buf;
    let len = match rmp::decode::read_array_len(&mut cur) {
        Ok(n) => n as usize,
        Err(_) => {
            // Not an array header: say what it is, if it is msgpack at all.
            let err = match read_whole(buf) {
                Ok(v) => DecodeErrorKind::Shape {
                    what: what.to_string(),
                    expected: "an array",
                    found: kind(&v).to_string(),
                },
                Err(e) => e,
            };
            return (Vec::new(), None, Some(err));
        }
    };
    // The header may claim far more than the frame holds: never trust it for allocation.
    let mut items = Vec::with_capacity(len.min(64));
    for i in 0..len {
        if let Some(t) = tokens.filter(|t| t.index == i)
            && is_array_marker(cur.first().copied())
        {
            match read_token_array(&mut cur, t) {
                Ok(ids) => {
                    flat = Some(ids);
                    items.push(Value::Nil);
                    continue;
                }
                Err(e) => return (items, None, Some(e)),
            }
        }
        match rmpv::decode::read_value_with_max_depth(&mut cur, MAX_DEPTH) {
            Ok(v) => items.push(v),
            Err(e) => {
                return (
                    items,
                    flat,
                    Some(DecodeErrorKind::NotMsgpack(e.to_string())),
                );
            }
        }
    }
    if !cur.is_empty() {
        return (items, flat, Some(DecodeErrorKind::TrailingBytes(cur.len())));
    }
    (items, flat, None)
}

fn is_array_marker(b: Option<u8>) -> bool {
    matches!(b, Some(0x90..=0x9f | 0xdc | 0xdd))
}

/// An array of non-negative ints into a `Vec<u32>`, refusing more than `t.max` of them.
fn read_token_array(cur: &mut &[u8], t: &TokenField) -> R<Vec<u32>> {
    let n = rmp::decode::read_array_len(cur)
        .map_err(|e| DecodeErrorKind::NotMsgpack(e.to_string()))? as usize;
    if n > t.max {
        return Err(DecodeErrorKind::InvalidValue {
            field: t.name.to_string(),
            reason: format!(
                "the prompt has {n} tokens, and this engine's maximum model length is {}: refused before its ids were read",
                t.max
            ),
        });
    }
    // each id is at least one byte: the frame bounds what is allocated
    let mut ids = Vec::with_capacity(n.min(cur.len()));
    for i in 0..n {
        let id: u64 = rmp::decode::read_int(cur).map_err(|e| DecodeErrorKind::InvalidValue {
            field: format!("{}[{i}]", t.name),
            reason: format!("not a token id ({e})"),
        })?;
        let id = u32::try_from(id).map_err(|_| DecodeErrorKind::InvalidValue {
            field: format!("{}[{i}]", t.name),
            reason: format!("{id} is not a 32-bit token id"),
        })?;
        ids.push(id);
    }
    Ok(ids)
}

pub(crate) fn is_nil(v: &Value) -> bool {
    matches!(v, Value::Nil)
}

pub(crate) fn str_ref<'a>(v: &'a Value, field: &str) -> R<&'a str> {
    match v {
        Value::String(s) => s.as_str().ok_or_else(|| wrong(field, "str", v)),
        _ => Err(wrong(field, "str", v)),
    }
}

pub(crate) fn string(v: &Value, field: &str) -> R<String> {
    str_ref(v, field).map(str::to_string)
}

pub(crate) fn opt_string(v: &Value, field: &str) -> R<Option<String>> {
    if is_nil(v) {
        Ok(None)
    } else {
        string(v, field).map(Some)
    }
}

pub(crate) fn u64_(v: &Value, field: &str) -> R<u64> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .ok_or_else(|| invalid(field, format!("expected a non-negative int, found {i}"))),
        _ => Err(wrong(field, "int", v)),
    }
}

pub(crate) fn i64_(v: &Value, field: &str) -> R<i64> {
    match v {
        Value::Integer(i) => i
            .as_i64()
            .ok_or_else(|| invalid(field, format!("{i} does not fit a signed 64-bit int"))),
        _ => Err(wrong(field, "int", v)),
    }
}

pub(crate) fn u32_(v: &Value, field: &str) -> R<u32> {
    let n = u64_(v, field)?;
    u32::try_from(n).map_err(|_| invalid(field, format!("{n} does not fit 32 bits")))
}

pub(crate) fn opt_i64(v: &Value, field: &str) -> R<Option<i64>> {
    if is_nil(v) {
        Ok(None)
    } else {
        i64_(v, field).map(Some)
    }
}

pub(crate) fn opt_u32(v: &Value, field: &str) -> R<Option<u32>> {
    if is_nil(v) {
        Ok(None)
    } else {
        u32_(v, field).map(Some)
    }
}

/// A float as msgspec accepts it: float64, float32 or an integer.
pub(crate) fn f64_(v: &Value, field: &str) -> R<f64> {
    match v {
        Value::F64(f) => Ok(*f),
        Value::F32(f) => Ok(f64::from(*f)),
        Value::Integer(i) => i.as_f64().ok_or_else(|| wrong(field, "float", v)),
        _ => Err(wrong(field, "float", v)),
    }
}

pub(crate) fn opt_f64(v: &Value, field: &str) -> R<Option<f64>> {
    if is_nil(v) {
        Ok(None)
    } else {
        f64_(v, field).map(Some)
    }
}

pub(crate) fn bool_(v: &Value, field: &str) -> R<bool> {
    match v {
        Value::Boolean(b) => Ok(*b),
        _ => Err(wrong(field, "bool", v)),
    }
}

pub(crate) fn opt_bool(v: &Value, field: &str) -> R<Option<bool>> {
    if is_nil(v) {
        Ok(None)
    } else {
        bool_(v, field).map(Some)
    }
}

pub(crate) fn array<'a>(v: &'a Value, field: &str) -> R<&'a [Value]> {
    match v {
        Value::Array(a) => Ok(a),
        _ => Err(wrong(field, "array", v)),
    }
}

pub(crate) fn map<'a>(v: &'a Value, field: &str) -> R<&'a [(Value, Value)]> {
    match v {
        Value::Map(m) => Ok(m),
        _ => Err(wrong(field, "map", v)),
    }
}

pub(crate) fn u32_list(v: &Value, field: &str) -> R<Vec<u32>> {
    let a = array(v, field)?;
    let mut out = Vec::with_capacity(a.len());
    for x in a {
        out.push(u32_(x, field)?);
    }
    Ok(out)
}

pub(crate) fn u64_list(v: &Value, field: &str) -> R<Vec<u64>> {
    let a = array(v, field)?;
    a.iter().map(|x| u64_(x, field)).collect()
}

pub(crate) fn i64_list(v: &Value, field: &str) -> R<Vec<i64>> {
    let a = array(v, field)?;
    a.iter().map(|x| i64_(x, field)).collect()
}

pub(crate) fn string_list(v: &Value, field: &str) -> R<Vec<String>> {
    let a = array(v, field)?;
    a.iter().map(|x| string(x, field)).collect()
}

/// A `{str: int}` map as `(key, count)` pairs in wire order.
pub(crate) fn str_u64_pairs(v: &Value, field: &str) -> R<Vec<(String, u64)>> {
    let m = map(v, field)?;
    m.iter()
        .map(|(k, x)| Ok((string(k, field)?, u64_(x, field)?)))
        .collect()
}

/// Opaque field: nil → `None`, anything else kept.
pub(crate) fn opaque(v: Value) -> Option<Value> {
    if is_nil(&v) { None } else { Some(v) }
}

/// Iterate a map's string keys (non-string keys are skipped, like unknown keys).
pub(crate) fn str_entries(m: &[(Value, Value)]) -> impl Iterator<Item = (&str, &Value)> {
    m.iter().filter_map(|(k, v)| k.as_str().map(|k| (k, v)))
}

/// Resolve a tensor/ndarray triple `[dtype, shape, data]`; `aux[k - 1]` is frame index `k`
/// (index 0 is the payload itself, so valid indices start at 1).
pub(crate) fn tensor(v: &Value, aux: &[Bytes], field: &str) -> R<Tensor> {
    let a = array(v, field)?;
    if a.len() < 3 {
        return Err(DecodeErrorKind::Shape {
            what: field.to_string(),
            expected: "a [dtype, shape, data] triple",
            found: format!("an array of {} elements", a.len()),
        });
    }
    let dtype = string(&a[0], &format!("{field}.dtype"))?;
    let shape = u64_list(&a[1], &format!("{field}.shape"))?;
    let data = match &a[2] {
        Value::Ext(3, bytes) => bytes.clone(),
        Value::Binary(bytes) => bytes.clone(),
        Value::Ext(code, _) => {
            return Err(invalid(
                &format!("{field}.data"),
                format!("unsupported msgpack ext type {code} (only 3, raw bytes, is allowed)"),
            ));
        }
        Value::Integer(i) => {
            let idx = i.as_i64().unwrap_or(i64::MAX);
            let frame = usize::try_from(idx)
                .ok()
                .and_then(|k| k.checked_sub(1))
                .and_then(|k| aux.get(k));
            match frame {
                Some(f) => f.to_vec(),
                None => {
                    return Err(DecodeErrorKind::BadFrameIndex {
                        field: format!("{field}.data"),
                        index: idx,
                        aux: aux.len(),
                    });
                }
            }
        }
        Value::Map(_) => {
            return Err(DecodeErrorKind::OutOfBandTensor {
                field: field.to_string(),
            });
        }
        other => {
            return Err(wrong(
                &format!("{field}.data"),
                "ext 3 or a frame index",
                other,
            ));
        }
    };
    Ok(Tensor { dtype, shape, data })
}
