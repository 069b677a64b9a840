//! Shared helpers for the integration tests.
#![allow(dead_code)]

use bytes::Bytes;

pub fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One captured message of `tests/fixtures/*-index.jsonl`.
pub struct Captured {
    pub seq: u64,
    pub socket: String,
    pub direction: String,
    pub label: String,
    pub frames: Vec<Bytes>,
    pub decoded: serde_json::Value,
}

pub fn capture(version: &str) -> Vec<Captured> {
    let path = format!(
        "{}/tests/fixtures/vllm-{version}-index.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).expect("fixture");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            Captured {
                seq: v["seq"].as_u64().expect("seq"),
                socket: v["socket"].as_str().expect("socket").to_string(),
                direction: v["direction"].as_str().expect("direction").to_string(),
                label: v["label"].as_str().expect("label").to_string(),
                frames: v["frames_hex"]
                    .as_array()
                    .expect("frames")
                    .iter()
                    .map(|f| Bytes::from(hex(f.as_str().expect("hex str"))))
                    .collect(),
                decoded: v["decoded"].clone(),
            }
        })
        .collect()
}
