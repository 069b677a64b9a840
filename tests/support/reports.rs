//! Traces and reports as the `inspect` tests read and rewrite them.

/// Copy the trace `from` to `to` with its meta's `config_hash` set to `hash`: the same
/// capture, as another configuration's (host, rig, engine flags).
pub fn copy_with_config_hash(from: &std::path::Path, to: &std::path::Path, hash: &str) {
    use sim_trace::trace::{TraceItem, TraceReader, TraceWriter};
    let mut w = TraceWriter::create_without_meta(to).unwrap();
    for item in TraceReader::open(from).unwrap() {
        match item.unwrap() {
            TraceItem::Meta(mut m) => {
                m.config_hash = Some(hash.into());
                w.write_meta(&m).unwrap();
            }
            TraceItem::Record(r) => w.write_record(&r).unwrap(),
        }
    }
    w.finish().unwrap();
}

/// A trace's meta (the first, if any) and records; fails the test on any error, a
/// truncated file included.
pub fn read_trace(
    path: &std::path::Path,
) -> (
    Option<sim_trace::trace::TraceMeta>,
    Vec<sim_trace::trace::TraceRecord>,
) {
    use sim_trace::trace::{TraceItem, TraceReader};
    let mut meta = None;
    let mut records = Vec::new();
    let reader =
        TraceReader::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    for item in reader {
        match item.unwrap_or_else(|e| panic!("reading {}: {e}", path.display())) {
            TraceItem::Meta(m) => meta = meta.or(Some(m)),
            TraceItem::Record(r) => records.push(r),
        }
    }
    (meta, records)
}

/// The pooled cohort (`"all"`) of an `inspect calibrate --json` or `inspect compare --json`
/// report.
pub fn pooled_cohort(report: &serde_json::Value) -> &serde_json::Value {
    report["cohorts"]
        .as_array()
        .and_then(|c| c.iter().find(|x| x["cohort"] == "all"))
        .unwrap_or_else(|| panic!("no pooled cohort in {report}"))
}

/// The cohort `name` of an `inspect calibrate --json` or `inspect compare --json` report.
pub fn cohort<'a>(report: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    report["cohorts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["cohort"] == name)
        .unwrap_or_else(|| panic!("no cohort {name} in {}", report["cohorts"]))
}

/// A number of a report, failing the test when it is not one.
pub fn number(v: &serde_json::Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Write a replay trace of one record: request `a`, a 4-token prompt answered by the
/// tokens 70, 71 (`length`), block size 16.
pub fn write_one_record_replay_trace(path: &std::path::Path) {
    std::fs::write(
        path,
        "{\"meta\":{\"block_size\":16}}\n{\"request_id\":\"a\",\"prompt_tokens\":4,\
         \"output_tokens\":2,\"arrival_ms\":0,\"output_token_ids\":[70,71],\
         \"finish_reason\":\"length\"}\n",
    )
    .unwrap();
}
