//! The committed captures and the conformance corpus: the manifest's hashes, the gates
//! every vLLM line must pass, and the CPU-engine capture's shape.

mod cpu_engine_capture;
mod gates;
mod manifest;
