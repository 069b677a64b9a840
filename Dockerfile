# The vllm-vcr image: `vllm-vcr` (engine simulator, tap, trace tools), the `vllm-rs`
# frontend of one vLLM line, and an entrypoint configured from environment variables
# (docs/deploy.md). One image per vLLM line:
#
#   podman build --build-arg VLLM_TAG=0.33.0 -t vllm-vcr:0.1.0-vllm0.33 -t vllm-vcr:vllm0.33 .
#
# Targets:
#   release (the default, last stage)  builds vllm-vcr from this checkout with cargo and
#                                      takes vllm-rs out of the PyPI `vllm==VLLM_TAG` wheel
#   prebuilt                           copies both binaries from the build context
#                                      (prebuilt/vllm-vcr, prebuilt/vllm-rs, prebuilt/model/),
#                                      so a machine without a Rust image or PyPI access can
#                                      build the image from binaries it already has
#   nixl                               `release` with vllm-vcr built `--features nixl` and the
#                                      NIXL runtime (UCX and its plugins) from PyPI's
#                                      `nixl-cu12==NIXL_VERSION` wheel: P/D engines move real
#                                      KV bytes over NIXL (tag it …-nixl)
#   prebuilt-nixl                      `prebuilt` plus a NIXL runtime from the build context
#                                      (prebuilt/vllm-vcr built with `--features nixl`,
#                                      prebuilt/nixl/ holding the wheel's two library
#                                      directories side by side)
#
# Every base image is a build argument, so a registry mirror or a locally built base works:
#   --build-arg BASE=localhost/debian:bookworm-slim

ARG BASE=debian:bookworm-slim
ARG RUST_IMAGE=rust:1-bookworm
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The PyPI `vllm` release whose vllm-rs the image carries (compat.toml's `tag` of the line).
ARG VLLM_TAG=0.33.0
# The NIXL runtime of the `nixl` targets (PyPI `nixl-cu12`; its libraries are NVIDIA's and
# are fetched at build time, never part of this repository).
ARG NIXL_VERSION=1.5.1

# --- vllm-vcr from source --------------------------------------------------------------
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin vllm-vcr \
 && mkdir -p /out \
 && cp target/release/vllm-vcr /out/vllm-vcr \
 && cargo run --release --locked --quiet --package xtask -- model-dir /out/model

# --- vllm-rs from the vLLM wheel of the line --------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ARG VLLM_TAG
RUN python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
        --progress-bar off -d /wheel "vllm==${VLLM_TAG}" \
 && python3 -c 'import glob, os, shutil, zipfile; \
wheel, = glob.glob("/wheel/vllm-*.whl"); os.makedirs("/out", exist_ok=True); \
z = zipfile.ZipFile(wheel); \
shutil.copyfileobj(z.open("vllm/vllm-rs"), open("/out/vllm-rs", "wb")); \
os.chmod("/out/vllm-rs", 0o755)' \
 && /out/vllm-rs serve --help > /dev/null

# --- the `nixl` variant: vllm-vcr with the NIXL data plane, and NIXL's runtime -----------
FROM ${RUST_IMAGE} AS build-nixl
WORKDIR /src
COPY . .
RUN apt-get update && apt-get install -y --no-install-recommends libclang-dev \
 && cargo build --release --locked --features nixl --bin vllm-vcr \
 && mkdir -p /out \
 && cp target/release/vllm-vcr /out/vllm-vcr

FROM ${PYTHON_IMAGE} AS nixl-runtime
ARG NIXL_VERSION
# The wheel's libraries carry $ORIGIN rpaths between its two directories: kept side by side.
RUN python3 -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
        --progress-bar off -d /wheel "nixl-cu12==${NIXL_VERSION}" \
 && python3 -c 'import glob, zipfile; \
wheel, = glob.glob("/wheel/nixl_cu12-*.whl"); z = zipfile.ZipFile(wheel); \
names = [n for n in z.namelist() if n.startswith((".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/"))]; \
z.extractall("/out/nixl", names)' \
 && test -f /out/nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so

# --- what every target shares -----------------------------------------------------------
FROM ${BASE} AS runtime
ARG VLLM_TAG
# The cache (the embedded model serve writes, logs) goes to /tmp, writable for any uid.
ENV VLLM_VCR_CACHE=/tmp/vllm-vcr \
    VLLM_VCR_IMAGE_VLLM_TAG=${VLLM_TAG} \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    NO_COLOR=1
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp vcr \
 && mkdir -p /trace \
 && chown vcr:vcr /trace
COPY docker/entrypoint.sh /usr/local/bin/vllm-vcr-entrypoint
USER 10001
# 8000: the OpenAI API (frontend). 29550/29551: engine handshakes (sidecar modes).
# 5600: P/D side channel (prefill). 5557: KV-cache events.
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/vllm-vcr-entrypoint"]
CMD ["serve"]

# --- binaries from the build context (tests, air-gapped machines) -----------------------
FROM runtime AS prebuilt
COPY prebuilt/vllm-vcr prebuilt/vllm-rs /usr/local/bin/
COPY prebuilt/model /opt/vllm-vcr/model

# the NIXL runtime's system libraries (the wheel bundles the rest): OpenSSL, OpenMP
FROM runtime AS runtime-nixl
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl3 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
USER 10001
ENV VLLM_VCR_NIXL_LIB_DIR=/opt/nixl/.nixl_cu12.mesonpy.libs

FROM runtime-nixl AS prebuilt-nixl
COPY prebuilt/vllm-vcr prebuilt/vllm-rs /usr/local/bin/
COPY prebuilt/model /opt/vllm-vcr/model
COPY prebuilt/nixl /opt/nixl

FROM runtime-nixl AS nixl
COPY --from=build-nixl /out/vllm-vcr /usr/local/bin/vllm-vcr
COPY --from=build /out/model /opt/vllm-vcr/model
COPY --from=wheel /out/vllm-rs /usr/local/bin/vllm-rs
COPY --from=nixl-runtime /out/nixl /opt/nixl

# --- the full build (default) -----------------------------------------------------------
FROM runtime AS release
COPY --from=build /out/vllm-vcr /usr/local/bin/vllm-vcr
COPY --from=build /out/model /opt/vllm-vcr/model
COPY --from=wheel /out/vllm-rs /usr/local/bin/vllm-rs
