//! `--kv-events-config '<json>'`, parsed as vLLM's pydantic `KVEventsConfig` parses it.

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value as Json;
use sim_protocol::kv_events::{KV_EVENTS_CONFIG_KEYS, KvEventsConfig};

/// Parse `--kv-events-config '<json>'` as vLLM does (`TypeAdapter(KVEventsConfig)
/// .validate_json` in lax mode, after expanding bare `10k`/`1K`-style numbers): a JSON
/// object with any subset of the 8 keys; unknown keys, wrong types and a `publisher` other
/// than `"zmq"`/`"null"` are errors. Lax coercions as pydantic's: bools also from `0`/`1`
/// and `"yes"`/`"on"`/…; integers also from integral floats, numeric strings and bools.
/// Unlike vLLM, negative integers are rejected here (vLLM accepts them and fails later).
/// An unset `publisher` resolves to `"zmq"` when events are enabled, else `"null"`.
pub fn parse_kv_events_config(json: &str) -> Result<KvEventsConfig> {
    let expanded = expand_human_readable_numbers(json)?;
    let value: Json = serde_json::from_str(&expanded)
        .with_context(|| format!("--kv-events-config is not valid JSON: {json}"))?;
    let Json::Object(map) = value else {
        bail!(
            "--kv-events-config must be a JSON object (e.g. '{{\"enable_kv_cache_events\": true}}'), got: {json}"
        );
    };
    let mut c = KvEventsConfig::default();
    let mut publisher = None;
    for (key, x) in &map {
        let bad =
            |expected: &str| anyhow!("--kv-events-config: `{key}` must be {expected}, got {x}");
        match key.as_str() {
            "enable_kv_cache_events" => {
                c.enable_kv_cache_events = lax_bool(x).ok_or_else(|| bad("a boolean"))?
            }
            "publisher" => match x.as_str() {
                Some(p @ ("zmq" | "null")) => publisher = Some(p.to_string()),
                _ => return Err(bad("\"zmq\" or \"null\"")),
            },
            "endpoint" => c.endpoint = x.as_str().ok_or_else(|| bad("a string"))?.to_string(),
            "replay_endpoint" => {
                c.replay_endpoint = match x {
                    Json::Null => None,
                    Json::String(s) => Some(s.clone()),
                    _ => return Err(bad("a string or null")),
                }
            }
            "buffer_steps" => {
                c.buffer_steps = lax_u64(x).ok_or_else(|| bad("a non-negative integer"))?
            }
            "hwm" => c.hwm = lax_u64(x).ok_or_else(|| bad("a non-negative integer"))?,
            "max_queue_size" => {
                c.max_queue_size = lax_u64(x).ok_or_else(|| bad("a non-negative integer"))?
            }
            "topic" => c.topic = x.as_str().ok_or_else(|| bad("a string"))?.to_string(),
            _ => bail!(
                "--kv-events-config: unknown key `{key}` (vLLM's KVEventsConfig accepts: {})",
                KV_EVENTS_CONFIG_KEYS.join(", ")
            ),
        }
    }
    c.publisher = publisher
        .unwrap_or_else(|| KvEventsConfig::default_publisher(c.enable_kv_cache_events).to_string());
    Ok(c)
}

/// pydantic's lax bool.
fn lax_bool(x: &Json) -> Option<bool> {
    match x {
        Json::Bool(b) => Some(*b),
        Json::Number(n) => match n.as_f64() {
            Some(0.0) => Some(false),
            Some(1.0) => Some(true),
            _ => None,
        },
        Json::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            _ => None,
        },
        _ => None,
    }
}

/// pydantic's lax int, restricted to `u64`.
fn lax_u64(x: &Json) -> Option<u64> {
    fn from_f64(f: f64) -> Option<u64> {
        (f.fract() == 0.0 && f >= 0.0 && f < u64::MAX as f64).then_some(f as u64)
    }
    match x {
        Json::Bool(b) => Some(u64::from(*b)),
        Json::Number(n) => n.as_u64().or_else(|| n.as_f64().and_then(from_f64)),
        Json::String(s) => {
            let s = s.trim();
            s.parse::<u64>().ok().or_else(|| {
                // "12.0" is accepted, "1e3" is not.
                let plain = s.chars().all(|c| c.is_ascii_digit() || c == '.');
                plain
                    .then(|| s.parse::<f64>().ok().and_then(from_f64))
                    .flatten()
            })
        }
        _ => None,
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// vLLM's `_expand_json_human_readable_numbers`: outside JSON strings, replace every bare
/// `\b\d+(\.\d+)?[kKmMgGtT]\b` by its value (`k`/`m`/`g`/`t` decimal, `K`/`M`/`G`/`T`
/// binary; decimals only with decimal suffixes).
fn expand_human_readable_numbers(s: &str) -> Result<String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            // Copy the string literal verbatim (escapes included).
            out.push(c);
            i += 1;
            while i < chars.len() {
                out.push(chars[i]);
                if chars[i] == '\\' && i + 1 < chars.len() {
                    out.push(chars[i + 1]);
                    i += 2;
                    continue;
                }
                i += 1;
                if chars[i - 1] == '"' {
                    break;
                }
            }
            continue;
        }
        let at_boundary = i == 0 || !is_word_char(chars[i - 1]);
        if c.is_ascii_digit()
            && at_boundary
            && let Some((len, value)) = match_human_readable(&chars[i..])?
        {
            out.push_str(&value.to_string());
            i += len;
            continue;
        }
        out.push(c);
        i += 1;
    }
    Ok(out)
}

/// Match `\d+(\.\d+)?[kKmMgGtT]\b` at the start of `s`: (chars consumed, value).
fn match_human_readable(s: &[char]) -> Result<Option<(usize, u64)>> {
    let digits = |from: usize| s[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let int_len = digits(0);
    let mut end = int_len;
    if s.get(end) == Some(&'.') {
        let frac = digits(end + 1);
        if frac > 0 {
            end += 1 + frac;
        }
    }
    let Some(&suffix) = s.get(end) else {
        return Ok(None);
    };
    if !"kKmMgGtT".contains(suffix) || s.get(end + 1).is_some_and(|&c| is_word_char(c)) {
        return Ok(None);
    }
    let number: String = s[..end].iter().collect();
    let value = match suffix {
        'k' | 'm' | 'g' | 't' => {
            let mult = match suffix {
                'k' => 1e3,
                'm' => 1e6,
                'g' => 1e9,
                _ => 1e12,
            };
            let f: f64 = number.parse().context("human-readable number")?;
            (f * mult) as u64
        }
        _ => {
            if end != int_len {
                bail!(
                    "--kv-events-config: decimals are not allowed with binary suffixes like {suffix}; did you mean {number}{}?",
                    suffix.to_ascii_lowercase()
                );
            }
            let shift = match suffix {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                _ => 40,
            };
            let n: u64 = number.parse().context("human-readable number")?;
            n.checked_mul(1 << shift)
                .ok_or_else(|| anyhow!("--kv-events-config: {number}{suffix} is too large"))?
        }
    };
    Ok(Some((end + 1, value)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_json_is_vllms_defaults() {
        assert_eq!(
            parse_kv_events_config("{}").unwrap(),
            KvEventsConfig::default()
        );
        let c = parse_kv_events_config(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!(c.publisher, "zmq");
        assert!(c.is_active());
        let c = parse_kv_events_config(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#)
            .unwrap();
        assert!(!c.is_active());
    }

    #[test]
    fn all_keys_and_lax_values() {
        // Each case checked against vLLM 0.33's TypeAdapter(KVEventsConfig).validate_json.
        let c = parse_kv_events_config(
            r#"{"enable_kv_cache_events": "yes", "publisher": "zmq", "endpoint": "tcp://*:6000",
                "replay_endpoint": "tcp://*:6001", "buffer_steps": 10k, "hwm": "12",
                "max_queue_size": 1K, "topic": "kv@10k"}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            KvEventsConfig {
                enable_kv_cache_events: true,
                publisher: "zmq".into(),
                endpoint: "tcp://*:6000".into(),
                replay_endpoint: Some("tcp://*:6001".into()),
                buffer_steps: 10_000,
                hwm: 12,
                max_queue_size: 1024,
                topic: "kv@10k".into(),
            }
        );
        let ok = |j: &str| parse_kv_events_config(j).unwrap();
        assert!(ok(r#"{"enable_kv_cache_events": 1}"#).enable_kv_cache_events);
        assert!(ok(r#"{"enable_kv_cache_events": "On"}"#).enable_kv_cache_events);
        assert!(ok(r#"{"enable_kv_cache_events": 1.0}"#).enable_kv_cache_events);
        assert_eq!(ok(r#"{"buffer_steps": 12.0}"#).buffer_steps, 12);
        assert_eq!(ok(r#"{"buffer_steps": " 12 "}"#).buffer_steps, 12);
        assert_eq!(ok(r#"{"buffer_steps": "12.0"}"#).buffer_steps, 12);
        assert_eq!(ok(r#"{"buffer_steps": 1e3}"#).buffer_steps, 1000);
        assert_eq!(ok(r#"{"buffer_steps": 1.5k}"#).buffer_steps, 1500);
        assert_eq!(ok(r#"{"buffer_steps": true}"#).buffer_steps, 1);
        assert_eq!(ok(r#"{"replay_endpoint": null}"#).replay_endpoint, None);
        assert_eq!(ok(r#"{"topic": "a", "topic": "b"}"#).topic, "b");
    }

    #[test]
    fn rejects_what_vllm_rejects() {
        let err = |j: &str| parse_kv_events_config(j).unwrap_err().to_string();
        assert!(err(r#"{"foo": 1}"#).contains("unknown key `foo`"));
        assert!(err(r#"{"foo": 1}"#).contains("replay_endpoint"));
        assert!(err("[]").contains("JSON object"));
        assert!(err("{").contains("not valid JSON"));
        assert!(err(r#"{"enable_kv_cache_events": 2}"#).contains("boolean"));
        assert!(err(r#"{"enable_kv_cache_events": null}"#).contains("boolean"));
        assert!(err(r#"{"buffer_steps": 12.5}"#).contains("integer"));
        assert!(err(r#"{"buffer_steps": "1e3"}"#).contains("integer"));
        assert!(err(r#"{"hwm": null}"#).contains("integer"));
        assert!(err(r#"{"publisher": null}"#).contains("\"zmq\" or \"null\""));
        assert!(err(r#"{"publisher": "ZMQ"}"#).contains("\"zmq\" or \"null\""));
        assert!(err(r#"{"endpoint": 5}"#).contains("string"));
        assert!(err(r#"{"endpoint": null}"#).contains("string"));
        assert!(err(r#"{"topic": 3}"#).contains("string"));
        assert!(err(r#"{"buffer_steps": 1.5K}"#).contains("did you mean 1.5k"));
        // Ours only: vLLM accepts a negative count and fails later.
        assert!(err(r#"{"buffer_steps": -3}"#).contains("non-negative"));
    }

    #[test]
    fn human_readable_numbers_only_outside_strings() {
        let e = |s: &str| expand_human_readable_numbers(s).unwrap();
        assert_eq!(
            e(r#"{"a": 10k, "b": "10k", "c": 2M}"#),
            r#"{"a": 10000, "b": "10k", "c": 2097152}"#
        );
        assert_eq!(
            e(r#"{"a": "x\"10k", "b": 3g}"#),
            r#"{"a": "x\"10k", "b": 3000000000}"#
        );
        assert_eq!(
            e("[a10k, 10kb, 10k_, 10.5t]"),
            "[a10k, 10kb, 10k_, 10500000000000]"
        );
    }
}
