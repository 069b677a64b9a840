//! The container image's entrypoint (`docker/entrypoint.sh`), run with bash and stand-in
//! binaries: real service links only, numbers in base 10, enums exactly, and the traced
//! model named as clients name it.

use super::*;

/// The image's entrypoint (docker/entrypoint.sh), run with bash directly: `vllm-vcr` and
/// `vllm-rs` on its PATH are stand-ins that exit 0, so what is checked is the command it
/// would exec (printed on stderr) or the error it stops with. `env` holds the whole
/// environment.
fn entrypoint(mode: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    use std::os::unix::fs::PermissionsExt;
    // written once per process: rewriting a shim while another test execs it fails with
    // "Text file busy"
    static SHIMS: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let bin = SHIMS.get_or_init(|| {
        let bin = process_dir("vcr-entrypoint-shims");
        for name in ["vllm-vcr", "vllm-rs"] {
            let p = bin.join(name);
            std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        bin
    });
    let out = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/docker/entrypoint.sh"))
        .arg(mode)
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A typo in a MOCK_* name ending in `_PORT` is an error naming it, not a Kubernetes
/// service link (it used to be ignored silently); real service links, which come with
/// their `<SERVICE>_SERVICE_HOST`, still pass.
#[test]
fn the_entrypoint_takes_only_real_service_links_for_links() {
    for typo in ["MOCK_SIDE_CHANEL_PORT", "MOCK_MAX_NUM_SEQ_PORT"] {
        let (code, err) = entrypoint("play", &[(typo, "5600")]);
        assert_eq!(code, Some(2), "{typo}: {err}");
        assert!(err.contains(&format!("unknown variable {typo}")), "{err}");
    }
    // what a Service named `mock` (one port, named http) puts into every pod
    let links = [
        ("MOCK_SERVICE_HOST", "10.0.0.7"),
        ("MOCK_SERVICE_PORT", "8000"),
        ("MOCK_SERVICE_PORT_HTTP", "8000"),
        ("MOCK_PORT", "tcp://10.0.0.7:8000"),
        ("MOCK_PORT_8000_TCP", "tcp://10.0.0.7:8000"),
        ("MOCK_PORT_8000_TCP_PROTO", "tcp"),
        ("MOCK_PORT_8000_TCP_PORT", "8000"),
        ("MOCK_PORT_8000_TCP_ADDR", "10.0.0.7"),
    ];
    let (code, err) = entrypoint("play", &links);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("exec vllm-vcr play"), "{err}");
    // the same link names without their service host are not links
    let (code, err) = entrypoint("play", &links[1..]);
    assert_eq!(code, Some(2), "{err}");
}

/// `PORT=08080` is port 8080 (bash used to read it as octal and fail with "value too great
/// for base"); an enum value matches one choice exactly (`prefill,decode` used to pass).
#[test]
fn the_entrypoint_reads_numbers_in_base_10_and_enums_exactly() {
    let (code, err) = entrypoint("serve", &[("PORT", "08080")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("--port 8080 "), "{err}");
    let (code, err) = entrypoint("serve", &[("PORT", "070000")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("PORT=\"070000\": expected a port number"),
        "{err}"
    );
    for bad in ["prefill,decode", "decode,", ",both", "prefil"] {
        let (code, err) = entrypoint("play", &[("MOCK_PD_ROLE", bad)]);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("MOCK_PD_ROLE"), "{err}");
    }
    let (code, err) = entrypoint("play", &[("MOCK_PD_ROLE", "decode")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("--pd-role decode"), "{err}");
}

/// `record` mode names the trace's model as clients send it: SERVED_MODEL_NAME before
/// MODEL (docs/deploy.md); SERVED_MODEL_NAME alone used to leave the meta without a model.
#[test]
fn the_entrypoint_names_the_traced_model_as_clients_do() {
    for (env, want) in [
        (vec![("MODEL", "org/m")], Some("--model org/m ")),
        (vec![("SERVED_MODEL_NAME", "s")], Some("--model s ")),
        (
            vec![("MODEL", "org/m"), ("SERVED_MODEL_NAME", "s")],
            Some("--model s "),
        ),
        (vec![], None),
    ] {
        let (code, err) = entrypoint("record", &env);
        assert_eq!(code, Some(0), "{env:?}: {err}");
        match want {
            Some(w) => assert!(err.contains(w), "{env:?}: {err}"),
            None => assert!(!err.contains("--model"), "{err}"),
        }
    }
}

/// A boolean MOCK_ variable gives its flag when true and nothing when false.
#[test]
fn the_entrypoint_maps_a_true_boolean_to_its_flag_and_a_false_one_to_nothing() {
    let (code, err) = entrypoint("play", &[("MOCK_DISABLE_LOG_STATS", "true")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains(" --disable-log-stats"), "{err}");
    let (code, err) = entrypoint("play", &[("MOCK_DISABLE_LOG_STATS", "off")]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!err.contains("--disable-log-stats"), "{err}");
    let (code, err) = entrypoint("play", &[("MOCK_DISABLE_LOG_STATS", "maybe")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("MOCK_DISABLE_LOG_STATS"), "{err}");
}
