//! The JSON writer's tests: hand-written strings and numbers are serde_json's, the fast
//! path writes the general path's bytes, a run writes what its slices write.

use super::*;

/// The hand-written strings and numbers are serde_json's.
#[test]
fn strings_and_numbers_are_serde_jsons() {
    for s in [
        "",
        "decode",
        "a\"b",
        "tab\there",
        "back\\slash",
        "ünï",
        "\u{1}",
        "/",
    ] {
        let mut buf = Vec::new();
        string(&mut buf, s);
        assert_eq!(buf, serde_json::to_vec(s).unwrap(), "{s:?}");
    }
    for x in [
        0.0,
        -0.0,
        1.5,
        1e-7,
        123456789.125,
        1e300,
        f64::NAN,
        f64::INFINITY,
    ] {
        let mut buf = Vec::new();
        float(&mut buf, x);
        assert_eq!(buf, serde_json::to_vec(&x).unwrap(), "{x}");
    }
    for v in [i64::MIN, -1, 0, 7, i64::MAX] {
        let mut buf = Vec::new();
        int(&mut buf, v);
        assert_eq!(buf, serde_json::to_vec(&v).unwrap());
    }
}

fn via_plain_slice(plain: &mut Plain, s: &Slice) -> Option<Vec<u8>> {
    if !plain.fit_slice(s) {
        return None;
    }
    let mut room = [0u8; ROOM];
    let n = plain.slice(&mut room, s);
    Some(room[..n].to_vec())
}

fn via_general_slice(s: &Slice) -> Vec<u8> {
    let mut buf = b",\n".to_vec();
    write_slice(&mut buf, s);
    buf
}

/// A slice written by the fast path is the general path's bytes, whatever its numbers,
/// and the pieces follow every change of name, process, category or colour; a string
/// that needs escaping or a name too long for its piece goes to the general path.
#[test]
fn the_fast_path_writes_the_general_paths_bytes() {
    let long = "n".repeat(HEAD);
    let names = [
        "",
        "decode",
        "decode x3",
        "prefill",
        "decode B12 (+3r 456t)",
        "d",
    ];
    let styles: [(&'static str, &'static str); 3] = [
        ("request", "rail_load"),
        ("request", "rail_idle"),
        ("step", "yellow"),
    ];
    let numbers = [
        0i64,
        1,
        9,
        10,
        99,
        100,
        12_345,
        999_999,
        4_011_910_026,
        -1,
        -100,
        i64::MAX,
        i64::MIN,
    ];
    let mut plain = Plain::new();
    let mut written = 0;
    for (i, &ts) in numbers.iter().enumerate() {
        for (j, name) in names.iter().enumerate() {
            let (category, colour) = styles[(i + j) % styles.len()];
            let s = Slice {
                pid: [1, 2, 4_000_000_000][j % 3],
                tid: [1, 222, u64::MAX][i % 3],
                name,
                category,
                colour,
                ts,
                dur: numbers[(i + j) % numbers.len()],
                args: &[],
            };
            let fast = via_plain_slice(&mut plain, &s).expect("a plain slice");
            assert_eq!(
                String::from_utf8(fast).unwrap(),
                String::from_utf8(via_general_slice(&s)).unwrap()
            );
            written += 1;
        }
    }
    assert_eq!(written, numbers.len() * names.len());
    for name in ["a\"b", "tab\there", long.as_str()] {
        let s = Slice {
            pid: 1,
            tid: 1,
            name,
            category: "request",
            colour: "rail_load",
            ts: 5,
            dur: 6,
            args: &[],
        };
        assert!(via_plain_slice(&mut plain, &s).is_none(), "{name}");
        // the next plain slice is still right after a refusal, an empty name too
        for next in ["", "decode"] {
            let ok = Slice { name: next, ..s };
            assert_eq!(
                via_plain_slice(&mut plain, &ok),
                Some(via_general_slice(&ok))
            );
            assert!(via_plain_slice(&mut plain, &s).is_none());
        }
    }
}

/// A counter written by the fast path is the general path's bytes (serde_json's
/// float), for every value the fast path takes; the others are refused.
#[test]
fn the_counter_fast_path_writes_serde_jsons_numbers() {
    let mut plain = Plain::new();
    let names: [&'static str; 2] = ["active_requests", "engine_running"];
    let values = [
        0.0,
        1.0,
        -1.0,
        6.0,
        10.0,
        123_456.0,
        4e9,
        1e15 - 1.0,
        -(1e15 - 1.0),
    ];
    for (i, &v) in values.iter().enumerate() {
        let name = names[i % 2];
        let pid = [1, 7][i % 2];
        let ts = [0, 4_017_732_445, -3][i % 3];
        let w = whole(v).unwrap_or_else(|| panic!("{v} is whole"));
        assert!(plain.fit_counter(pid, name));
        let mut room = [0u8; ROOM];
        let n = plain.counter(&mut room, ts, w);
        let mut general = b",\n".to_vec();
        write_counter(&mut general, pid, name, ts, v);
        assert_eq!(
            String::from_utf8(room[..n].to_vec()).unwrap(),
            String::from_utf8(general).unwrap()
        );
    }
    for v in [
        -0.0,
        0.5,
        1e15,
        1e16,
        -1e15,
        f64::NAN,
        f64::INFINITY,
        1e-300,
    ] {
        assert_eq!(whole(v), None, "{v}");
    }
}

/// The in-place integers are Rust's own decimal text, at every digit count and sign.
#[test]
fn in_place_integers_are_decimal_text() {
    let mut values = vec![0u64, u64::MAX, i64::MAX as u64];
    let mut p = 1u64;
    while let Some(next) = p.checked_mul(10) {
        values.extend([p - 1, p, p + 1, p * 7 + 3]);
        p = next;
    }
    values.extend([p - 1, p, p + 1]);
    let mut room = [b'#'; 40];
    for &v in &values {
        let n = put_u64(&mut room, 3, v);
        assert_eq!(std::str::from_utf8(&room[3..n]).unwrap(), v.to_string());
        for w in [v as i64, (v as i64).wrapping_neg(), i64::MIN] {
            let n = put_i64(&mut room, 1, w);
            assert_eq!(std::str::from_utf8(&room[1..n]).unwrap(), w.to_string());
        }
    }
}

/// The whole file a sink writes for `events` (each given the sink), read back.
fn written(tag: &str, events: impl FnOnce(&mut JsonSink) -> Result<()>) -> String {
    let path = std::env::temp_dir().join(format!(
        "vllm-vcr-json-run-{}-{tag}.json",
        std::process::id()
    ));
    let file = std::fs::File::create(&path).unwrap();
    let mut sink = Box::new(JsonSink::new(Output::new(Some(file), false)).unwrap());
    events(&mut sink).unwrap();
    sink.finish().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    text
}

/// A run of slices is written as the same slices one at a time would be: as the first
/// event, after others, with a name the fast path refuses, across buffer flushes.
#[test]
fn a_run_writes_what_its_slices_write() {
    let bounds: Vec<i64> = (0..20_000i64).map(|k| 4_000_000_000 + k * 17_321).collect();
    let template = |name| Slice {
        pid: 1,
        tid: 3,
        name,
        category: "request",
        colour: "rail_load",
        ts: -1,
        dur: -1,
        args: &[],
    };
    let one_by_one = |sink: &mut JsonSink, name, bounds: &[i64]| -> Result<()> {
        for w in bounds.windows(2) {
            sink.slice(&Slice {
                ts: w[0],
                dur: w[1] - w[0],
                ..template(name)
            })?;
        }
        Ok(())
    };
    let by_runs = written("runs", |sink| {
        sink.run(&template("decode"), &bounds[..3])?;
        sink.process(1, "demo")?;
        sink.run(&template("decode"), &bounds)?;
        sink.run(&template("a\"b"), &bounds[..4])?;
        sink.run(&template("decode"), &bounds[..1])
    });
    let by_slices = written("slices", |sink| {
        one_by_one(sink, "decode", &bounds[..3])?;
        sink.process(1, "demo")?;
        one_by_one(sink, "decode", &bounds)?;
        one_by_one(sink, "a\"b", &bounds[..4])
    });
    assert!(by_runs.len() > 2 * FLUSH_AT, "{}", by_runs.len());
    assert_eq!(by_runs, by_slices);
    let doc: serde_json::Value = serde_json::from_str(&by_runs).unwrap();
    assert_eq!(
        doc["traceEvents"].as_array().unwrap().len(),
        2 + 1 + 19_999 + 3
    );
}
