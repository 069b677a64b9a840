//! Stamps the supported vLLM lines (from compat.toml) and build information into the binary.

use std::{env, fs, path::Path};

#[derive(serde::Deserialize)]
struct Compat {
    vllm: Vec<Line>,
}

#[derive(serde::Deserialize)]
struct Line {
    line: String,
    tag: String,
    #[serde(default)]
    default: bool,
    #[serde(default)]
    fidelity_validated: bool,
}

fn main() {
    println!("cargo:rerun-if-changed=compat.toml");
    println!("cargo:rerun-if-changed=build.rs");
    let text = fs::read_to_string("compat.toml").expect("compat.toml is missing");
    let compat: Compat = toml::from_str(&text).expect("compat.toml does not parse");
    let defaults: Vec<&Line> = compat.vllm.iter().filter(|l| l.default).collect();
    assert_eq!(
        defaults.len(),
        1,
        "compat.toml must mark exactly one line default = true"
    );
    let mut table =
        String::from("/// `(line, tag, default, fidelity_validated)` from compat.toml.\n");
    table.push_str("pub const LINES: &[(&str, &str, bool, bool)] = &[\n");
    for l in &compat.vllm {
        table.push_str(&format!(
            "    ({:?}, {:?}, {}, {}),\n",
            l.line, l.tag, l.default, l.fidelity_validated
        ));
    }
    table.push_str("];\n");
    let out = Path::new(&env::var("OUT_DIR").unwrap()).join("compat.rs");
    fs::write(out, table).unwrap();
    println!("cargo:rustc-env=VLLM_VCR_DEFAULT_LINE={}", defaults[0].line);
    println!("cargo:rustc-env=VLLM_VCR_DEFAULT_TAG={}", defaults[0].tag);
    let profile = env::var("PROFILE").unwrap_or_default();
    let target = env::var("TARGET").unwrap_or_default();
    println!("cargo:rustc-env=VLLM_VCR_BUILD_INFO={profile} {target}");
}
