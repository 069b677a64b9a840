//! Printing that never panics: a closed stdout or stderr (`… | head`, `… 2>&1 | tee log`
//! and then Ctrl-C) is not worth dying for. Exported at this crate's root; `vllm_vcr`
//! re-exports them (`crate::errln!` in the root crate) and the xtask imports them.

/// `println!` that never panics: a closed stdout (`… | head`) is not worth dying for.
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `eprintln!` that never panics: a closed stderr (`… 2>&1 | tee log`, then Ctrl-C) is not
/// worth dying for.
#[macro_export]
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// `eprint!` that never panics.
#[macro_export]
macro_rules! errp {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr().lock(), $($t)*);
    }};
}
