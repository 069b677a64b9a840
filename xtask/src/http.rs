//! The blocking HTTP/1.1 client the checks, loads and e2e runs use: it lives in
//! `vcr-host` (the integration tests use it too), re-exported here so callers say
//! `crate::http::…`.

pub use vcr_host::http::*;
