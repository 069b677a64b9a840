//! Building msgpack values and engine messages for the codec tests.

use bytes::Bytes;
use rmpv::Value;
use sim_protocol::*;

pub(crate) fn mp(v: &Value) -> Bytes {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    Bytes::from(buf)
}

pub(crate) fn parse(b: &[u8]) -> Value {
    let mut cur = b;
    let v = rmpv::decode::read_value(&mut cur).unwrap();
    assert!(cur.is_empty(), "trailing bytes");
    v
}

pub(crate) fn s(x: &str) -> Value {
    Value::from(x)
}

pub(crate) fn arr(xs: Vec<Value>) -> Value {
    Value::Array(xs)
}

pub(crate) fn add_frames(payload: Value) -> Vec<Bytes> {
    vec![Bytes::from_static(&[0]), mp(&payload)]
}

/// A minimal valid 9-element ADD array.
pub(crate) fn add_array(id: &str) -> Vec<Value> {
    vec![
        s(id),
        arr(vec![Value::from(1), Value::from(2), Value::from(3)]),
        Value::Nil,
        Value::Map(vec![(s("max_tokens"), Value::from(7))]),
        Value::Nil,
        Value::F64(1.5),
        Value::Nil,
        Value::Nil,
        Value::Nil,
    ]
}

pub(crate) fn line(m: u16) -> VllmLine {
    VllmLine::new(0, m)
}

pub(crate) fn step(outputs: Vec<EngineCoreOutput>) -> EngineCoreOutputs {
    EngineCoreOutputs {
        outputs,
        timestamp: 12.5,
        ..Default::default()
    }
}

pub(crate) fn output_arrays(frames: &[Bytes]) -> Vec<Vec<Value>> {
    let v = parse(&frames[0]);
    let env = v.as_array().unwrap();
    env[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_array().unwrap().clone())
        .collect()
}

/// A rarely-set output field's value (they are boxed).
pub(crate) fn boxed<T>(t: T) -> Option<Box<T>> {
    Some(Box::new(t))
}
