//! The supported vLLM lines, as compat.toml lists them (stamped at build time).

use sim_protocol::VllmLine;

include!(concat!(env!("OUT_DIR"), "/compat.rs"));

/// The exact vLLM release a line is tested against (`tag` in compat.toml), or `X.Y.0`.
pub fn tag_for(line: VllmLine) -> String {
    let key = line.to_string();
    LINES
        .iter()
        .find(|(l, ..)| *l == key)
        .map(|(_, tag, ..)| tag.to_string())
        .unwrap_or_else(|| format!("{key}.0"))
}

/// The default line of this build.
pub fn default_line() -> VllmLine {
    VllmLine::parse(env!("VLLM_VCR_DEFAULT_LINE")).expect("compat.toml default line is valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compat_covers_every_supported_line() {
        for line in sim_protocol::supported_lines() {
            assert!(
                LINES.iter().any(|(l, ..)| *l == line.to_string()),
                "compat.toml lacks {line}"
            );
            let tag = tag_for(line);
            assert_eq!(VllmLine::parse(&tag).unwrap(), line, "tag {tag} of {line}");
        }
        assert_eq!(LINES.iter().filter(|l| l.2).count(), 1);
        assert_eq!(default_line(), VllmLine::new(0, 33));
    }
}
