//! The identity of the host CPU a capture ran on (`meta.host_cpu`, and an input of the
//! config hash — see [`crate::config_hash`]).
//!
//! An engine's step times depend on the CPU: for a CPU engine it *is* the hardware (its
//! vector extensions decide whether oneDNN runs bf16 natively or vLLM falls back to an
//! emulated path several times slower), and even behind a GPU the scheduler, the sampler
//! bookkeeping and the frontend run on it. So a capture records which CPU it saw: the model
//! name, the vendor's family/model numbers (a hypervisor often masks the name to e.g. `AMD
//! EPYC`, the numbers still tell Milan from Genoa), the vector-relevant flags (a short
//! sorted list, not the hundred flags of `/proc/cpuinfo`) and the logical CPU count.
//!
//! Read from `/proc/cpuinfo` (Linux, x86 and Arm); elsewhere [`HostCpu::detect`] returns
//! `None` and nothing is recorded.

use serde::{Deserialize, Serialize};

/// x86 flags that decide which kernels a CPU engine (oneDNN, vLLM's CPU ops) can use.
const X86_FLAGS: &[&str] = &[
    "amx_bf16",
    "amx_fp16",
    "amx_int8",
    "amx_tile",
    "avx",
    "avx2",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512f",
    "avx512ifma",
    "avx512vbmi",
    "avx512vl",
    "avx_vnni",
    "f16c",
    "fma",
];

/// Arm (`Features`) flags of the same kind: NEON, its dot-product / half / bf16 / int8
/// matrix extensions, SVE and SME.
const ARM_FLAGS: &[&str] = &[
    "asimd", "asimddp", "asimdfhm", "asimdhp", "bf16", "fphp", "i8mm", "sme", "sme2", "sve",
    "sve2", "svebf16", "svei8mm",
];

/// A few Arm server cores by (implementer, part); others are named by their numbers only.
const ARM_PARTS: &[(&str, &str, &str)] = &[
    ("0x41", "0xd08", "ARM Cortex-A72"),
    ("0x41", "0xd0c", "ARM Neoverse-N1"),
    ("0x41", "0xd40", "ARM Neoverse-V1"),
    ("0x41", "0xd49", "ARM Neoverse-N2"),
    ("0x41", "0xd4f", "ARM Neoverse-V2"),
];

/// The host CPU as a capture saw it (`meta.host_cpu`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HostCpu {
    /// `x86_64`, `x86`, `aarch64`, `arm` (from the cpuinfo's contents), or empty when
    /// unknown.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub arch: String,
    /// The model name (`model name`), e.g. `AMD EPYC 9R14`; on Arm, where the kernel
    /// prints none, the core's name when known (`ARM Neoverse-V1`), else its numbers.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    /// The vendor's identifying numbers, stepping/revision left out: `AuthenticAMD family
    /// 25 model 17`, or `implementer 0x41 part 0xd40` on Arm.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub signature: String,
    /// The vector-relevant flags the CPU has, sorted (see the module docs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<String>,
    /// Logical CPUs listed in `/proc/cpuinfo` (the machine's, not the capture's affinity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logical_cpus: Option<u32>,
}

impl HostCpu {
    /// This host's CPU, from `/proc/cpuinfo`; `None` where there is no such file (not
    /// Linux) or it names no CPU.
    pub fn detect() -> Option<HostCpu> {
        let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        parse_cpuinfo(&text)
    }

    /// The config-hash input (the `host_cpu` field of [`crate::config_hash`]):
    /// `arch=A;logical_cpus=N;flags=F1,F2,…;signature=S;model=M`. Every field but the
    /// model is made of tokens without `;` (the flags come from a fixed list, the
    /// signature from numbers and the vendor id), and the model, the only free text, comes
    /// last, so two different CPUs cannot give the same string. CPU frequency, microcode
    /// and stepping are left out: they change without changing what the CPU computes with.
    pub fn canonical(&self) -> String {
        format!(
            "arch={};logical_cpus={};flags={};signature={};model={}",
            self.arch,
            self.logical_cpus.map(|n| n.to_string()).unwrap_or_default(),
            self.flags.join(","),
            self.signature,
            self.model
        )
    }

    /// One line for people: `AMD EPYC (AuthenticAMD family 25 model 17), 2 logical CPUs,
    /// x86_64: avx avx2 …`.
    pub fn describe(&self) -> String {
        let mut s = if self.model.is_empty() {
            "unknown CPU".to_string()
        } else {
            self.model.clone()
        };
        if !self.signature.is_empty() && self.signature != self.model {
            s.push_str(&format!(" ({})", self.signature));
        }
        if let Some(n) = self.logical_cpus {
            s.push_str(&format!(", {n} logical CPUs"));
        }
        if !self.arch.is_empty() {
            s.push_str(&format!(", {}", self.arch));
        }
        if !self.flags.is_empty() {
            s.push_str(&format!(": {}", self.flags.join(" ")));
        }
        s
    }
}

/// Parse the text of a `/proc/cpuinfo` (x86 or Arm). The first processor's entries name
/// the CPU (a machine's processors are alike); the flags are those every listed processor
/// has. `None` when the text lists no processor and names no CPU.
pub fn parse_cpuinfo(text: &str) -> Option<HostCpu> {
    let mut processors = 0u32;
    let mut first: Vec<(&str, &str)> = Vec::new();
    let mut flags: Option<Vec<&str>> = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match key {
            "processor" => processors += 1,
            "flags" | "Features" => {
                let mine: Vec<&str> = value.split_whitespace().collect();
                flags = Some(match flags {
                    None => mine,
                    Some(all) => all.into_iter().filter(|f| mine.contains(f)).collect(),
                });
            }
            _ => {}
        }
        if processors <= 1 && !first.iter().any(|(k, _)| *k == key) {
            first.push((key, value));
        }
    }
    let get = |k: &str| {
        first
            .iter()
            .find(|(key, _)| *key == k)
            .map(|(_, v)| *v)
            .filter(|v| !v.is_empty())
    };
    let flags = flags.unwrap_or_default();
    let x86 = get("vendor_id").is_some() || first.iter().any(|(k, _)| *k == "flags");
    let arm = get("CPU implementer").is_some() || first.iter().any(|(k, _)| *k == "Features");
    let token = |s: &str| s.split_whitespace().next().unwrap_or("").replace(';', "");
    let (arch, signature, known, wanted) = if x86 {
        let arch = if flags.contains(&"lm") {
            "x86_64"
        } else {
            "x86"
        };
        let signature = match (get("vendor_id"), get("cpu family"), get("model")) {
            (Some(v), Some(f), Some(m)) => {
                format!("{} family {} model {}", token(v), token(f), token(m))
            }
            _ => String::new(),
        };
        (arch, signature, None, X86_FLAGS)
    } else if arm {
        let arch = match get("CPU architecture").map(token).as_deref() {
            Some("8") | Some("AArch64") | None => "aarch64",
            Some(_) => "arm",
        };
        let (imp, part) = (
            get("CPU implementer").map(token),
            get("CPU part").map(token),
        );
        let signature = match (&imp, &part) {
            (Some(i), Some(p)) => format!("implementer {i} part {p}"),
            _ => String::new(),
        };
        let known = ARM_PARTS
            .iter()
            .find(|(i, p, _)| imp.as_deref() == Some(*i) && part.as_deref() == Some(*p))
            .map(|(_, _, name)| name.to_string());
        (arch, signature, known, ARM_FLAGS)
    } else {
        ("", String::new(), None, &[][..])
    };
    let model = get("model name")
        .map(|m| m.split_whitespace().collect::<Vec<_>>().join(" "))
        .or(known)
        .or_else(|| get("Hardware").map(str::to_string))
        .unwrap_or_else(|| signature.clone());
    let mut flags: Vec<String> = flags
        .into_iter()
        .filter(|f| wanted.contains(f))
        .map(str::to_string)
        .collect();
    flags.sort();
    flags.dedup();
    if processors == 0 && model.is_empty() {
        return None;
    }
    Some(HostCpu {
        arch: arch.to_string(),
        model,
        signature,
        flags,
        logical_cpus: (processors > 0).then_some(processors),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two processors of the 2-core AMD EPYC VM the CPU engine was measured on (flags
    /// verbatim, other lines trimmed).
    const X86: &str = "\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2596.140
cache size\t: 1024 KB
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm
bogomips\t: 5192.28

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2596.141
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm
bogomips\t: 5192.28
";

    /// An AWS Graviton3 (Neoverse-V1) as its kernel prints it: no model name.
    const ARM: &str = "\
processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
";

    #[test]
    fn parses_an_x86_cpuinfo() {
        let cpu = parse_cpuinfo(X86).unwrap();
        assert_eq!(
            cpu,
            HostCpu {
                arch: "x86_64".into(),
                model: "AMD EPYC".into(),
                signature: "AuthenticAMD family 25 model 17".into(),
                flags: [
                    "avx",
                    "avx2",
                    "avx512_bf16",
                    "avx512_vbmi2",
                    "avx512_vnni",
                    "avx512bw",
                    "avx512cd",
                    "avx512dq",
                    "avx512f",
                    "avx512ifma",
                    "avx512vbmi",
                    "avx512vl",
                    "f16c",
                    "fma",
                ]
                .map(String::from)
                .to_vec(),
                logical_cpus: Some(2),
            }
        );
        assert_eq!(
            cpu.canonical(),
            "arch=x86_64;logical_cpus=2;flags=avx,avx2,avx512_bf16,avx512_vbmi2,avx512_vnni,\
             avx512bw,avx512cd,avx512dq,avx512f,avx512ifma,avx512vbmi,avx512vl,f16c,fma;\
             signature=AuthenticAMD family 25 model 17;model=AMD EPYC"
        );
        assert!(cpu.describe().starts_with(
            "AMD EPYC (AuthenticAMD family 25 model 17), 2 logical CPUs, x86_64: avx avx2 "
        ));
    }

    #[test]
    fn parses_an_arm_cpuinfo_without_a_model_name() {
        let cpu = parse_cpuinfo(ARM).unwrap();
        assert_eq!(cpu.arch, "aarch64");
        assert_eq!(cpu.model, "ARM Neoverse-V1");
        assert_eq!(cpu.signature, "implementer 0x41 part 0xd40");
        assert_eq!(
            cpu.flags,
            [
                "asimd", "asimddp", "asimdfhm", "asimdhp", "bf16", "fphp", "i8mm", "sve",
                "svebf16", "svei8mm"
            ]
        );
        assert_eq!(cpu.logical_cpus, Some(2));
        // an unknown core is named by its numbers
        let other = parse_cpuinfo(&ARM.replace("0xd40", "0xfff")).unwrap();
        assert_eq!(other.model, "implementer 0x41 part 0xfff");
    }

    #[test]
    fn flags_are_those_every_processor_has() {
        // a hybrid part whose second CPU lacks AVX-512 (as some kernels list them)
        let (p0, p1) = X86.split_at(X86.find("processor\t: 1").unwrap());
        let text = format!("{p0}{}", p1.replace(" avx512f ", " "));
        let cpu = parse_cpuinfo(&text).unwrap();
        assert!(!cpu.flags.iter().any(|f| f == "avx512f"), "{:?}", cpu.flags);
        assert!(cpu.flags.iter().any(|f| f == "avx2"));
    }

    #[test]
    fn nothing_to_parse_is_none() {
        assert_eq!(parse_cpuinfo(""), None);
        assert_eq!(parse_cpuinfo("not a cpuinfo\n"), None);
    }

    #[test]
    fn the_meta_form_round_trips_and_tolerates_missing_fields() {
        let cpu = parse_cpuinfo(X86).unwrap();
        let json = serde_json::to_string(&cpu).unwrap();
        assert!(json.starts_with(r#"{"arch":"x86_64","model":"AMD EPYC","signature":"#));
        assert_eq!(serde_json::from_str::<HostCpu>(&json).unwrap(), cpu);
        let partial: HostCpu = serde_json::from_str(r#"{"model":"X","extra":1}"#).unwrap();
        assert_eq!(partial.model, "X");
        assert_eq!(partial.logical_cpus, None);
    }

    #[test]
    fn detects_this_host_on_linux() {
        if std::path::Path::new("/proc/cpuinfo").exists() {
            let cpu = HostCpu::detect().expect("a CPU in /proc/cpuinfo");
            assert!(cpu.logical_cpus.unwrap_or(0) >= 1);
        }
    }
}
