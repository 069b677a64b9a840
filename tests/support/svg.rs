//! Checks on the SVG figures `inspect calibrate --plot` and `inspect compare --plot` write.

use std::path::Path;

/// Well-formed XML, as far as SVG needs: every tag closed in order, one `<svg>` root.
pub fn check_xml(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let body = text.trim();
    let body = match body.strip_prefix("<?xml") {
        Some(rest) => rest.split_once("?>").unwrap().1.trim(),
        None => body,
    };
    assert!(
        body.starts_with("<svg"),
        "{}: {}",
        path.display(),
        &body[..40]
    );
    let mut stack: Vec<String> = Vec::new();
    let mut rest = body;
    let mut roots = 0;
    while let Some(i) = rest.find('<') {
        let after = &rest[i + 1..];
        let end = after
            .find('>')
            .unwrap_or_else(|| panic!("unclosed tag in {}", path.display()));
        let tag = &after[..end];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                stack.pop().as_deref(),
                Some(name.trim()),
                "{}",
                path.display()
            );
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap().to_string();
            if stack.is_empty() {
                roots += 1;
            }
            stack.push(name);
        } else if stack.is_empty() {
            roots += 1;
        }
        // attribute values carry no raw '<' or '&' except entities
        assert!(!tag.contains('<'), "{}: {tag}", path.display());
        rest = &after[end + 1..];
    }
    assert!(stack.is_empty(), "{}: unclosed {stack:?}", path.display());
    assert_eq!(roots, 1, "{}", path.display());
    text
}
