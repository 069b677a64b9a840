# Developer shortcuts; `cargo xtask …` is the source of truth.

default:
    @just --list

# the main job: a real vllm-rs frontend with play behind it
serve *ARGS:
    cargo run --release -- serve {{ARGS}}

# the whole test suite, as CI runs it
ci:
    cargo xtask ci

# unit and wire-level tests only
test:
    cargo test --workspace

# the end-to-end matrix (all lines + the Python frontend)
e2e *ARGS:
    cargo xtask e2e {{ARGS}}

# download the real frontends into ~/.cache/vllm-vcr
fetch *ARGS:
    cargo xtask fetch {{ARGS}}

# engine benchmarks (docs/performance.md)
bench:
    cargo bench --bench engine

# what CI's fmt and clippy stages check (serve_e2e is `test = false`: `--all-targets`
# leaves it out, so it is linted by name)
lint:
    cargo fmt --all --check
    cargo clippy --workspace --all-targets -- -D warnings
    cargo clippy --test serve_e2e -- -D warnings
