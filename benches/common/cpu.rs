//! The CPU time the benches read of themselves and of the processes they wait for.

/// User + system CPU seconds so far of `who`: `libc::RUSAGE_SELF`, every thread of this
/// process (ended ones too), or `libc::RUSAGE_CHILDREN`, the children it waited for.
pub fn rusage_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage only writes the struct it is given; both `who`s are valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a local rusage.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return f64::NAN;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}
