//! A decode engine's NIXL reads as vLLM's NixlConnector reports them: per step, the
//! `kv_connector_stats` of its scheduler stats (`--nixl-connector-stats`), which a
//! frontend started with a `--kv-transfer-config` naming the NixlConnector turns into
//! `vllm:nixl_*` metrics. The payload is the connector's own: a list per key, one entry
//! per transfer (durations in seconds) or per failure.

use rmpv::Value;

/// One READ of a request's KV blocks from its prefill engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvTransfer {
    /// From posting the READ to its completion, seconds.
    pub seconds: f64,
    pub bytes: u64,
    /// Descriptors the READ moved (one per block and region).
    pub descriptors: u64,
}

/// How a pull's bytes moved, for the connector's stats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transfer {
    /// No bytes moved (the control plane only, or a local recompute).
    None,
    Done(KvTransfer),
    /// The READ (or the handshake before it) failed.
    Failed,
}

/// The transfers since the last stats.
#[derive(Debug, Default)]
pub struct NixlStats {
    done: Vec<KvTransfer>,
    failed: u64,
}

impl NixlStats {
    pub fn record(&mut self, t: Transfer) {
        match t {
            Transfer::None => {}
            Transfer::Done(k) => self.done.push(k),
            Transfer::Failed => self.failed += 1,
        }
    }

    /// The payload for the next stats and a fresh start; `None` when nothing happened
    /// (vLLM sends no empty stats).
    pub fn take(&mut self) -> Option<Value> {
        if self.done.is_empty() && self.failed == 0 {
            return None;
        }
        let done = std::mem::take(&mut self.done);
        let failed = std::mem::take(&mut self.failed);
        let list = |f: &dyn Fn(&KvTransfer) -> Value| Value::Array(done.iter().map(f).collect());
        let ones = |n: u64| Value::Array((0..n).map(|_| Value::from(1)).collect());
        let entries = [
            ("transfer_duration", list(&|t| Value::from(t.seconds))),
            // the engine posts a READ as one call: no separate posting time to report
            ("post_duration", list(&|_| Value::from(0.0))),
            ("bytes_transferred", list(&|t| Value::from(t.bytes))),
            ("num_descriptors", list(&|t| Value::from(t.descriptors))),
            ("num_failed_transfers", ones(failed)),
            ("num_failed_notifications", ones(0)),
            ("num_failed_handshakes", ones(0)),
            ("num_kv_expired_reqs", ones(0)),
            ("num_notifications_after_expiry", ones(0)),
        ];
        Some(Value::Map(
            entries
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_and_failures_become_the_connectors_lists_once() {
        let mut s = NixlStats::default();
        assert_eq!(s.take(), None);
        s.record(Transfer::None);
        assert_eq!(s.take(), None);
        s.record(Transfer::Done(KvTransfer {
            seconds: 0.002,
            bytes: 8192,
            descriptors: 2,
        }));
        s.record(Transfer::Failed);
        let v = s.take().unwrap();
        let get = |k: &str| {
            v.as_map()
                .unwrap()
                .iter()
                .find(|(key, _)| key.as_str() == Some(k))
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(
            get("bytes_transferred"),
            Value::Array(vec![Value::from(8192)])
        );
        assert_eq!(get("num_descriptors"), Value::Array(vec![Value::from(2)]));
        assert_eq!(
            get("transfer_duration"),
            Value::Array(vec![Value::from(0.002)])
        );
        assert_eq!(
            get("num_failed_transfers"),
            Value::Array(vec![Value::from(1)])
        );
        assert_eq!(get("num_failed_handshakes"), Value::Array(vec![]));
        assert_eq!(s.take(), None, "taken once");
    }
}
