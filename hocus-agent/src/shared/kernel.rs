//! The running kernel: its release, the oldest one hocus runs on, and the ways
//! (`Route`s) the parts of hocus take on it, each chosen by a probe at start and said in
//! the log and in `status` (docs/kernels.md).

use anyhow::{Result, bail};
pub use hocus_control::status::Route;

/// The oldest kernel hocus runs on: Debian 11's. Older ones lack what the programs need
/// (BTF-typed tracepoints and the BPF ring buffer, 5.8, among others) or were never
/// tried.
pub const OLDEST: (u32, u32) = (5, 10);

/// `uname -r`.
pub fn release() -> String {
    // SAFETY: uname fills the struct it is given.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return String::new();
    }
    // SAFETY: the kernel terminates the field.
    unsafe { std::ffi::CStr::from_ptr(uts.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// The major and minor version of a release (`6.1.0-56-amd64`: 6.1).
pub fn version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release.split(['.', '-']).map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

/// Refuses to start on a kernel older than `OLDEST`, naming it.
pub fn check_supported(release: &str) -> Result<()> {
    let (major, minor) = OLDEST;
    match version(release) {
        Some(v) if v >= OLDEST => Ok(()),
        Some(_) => bail!(
            "this kernel is Linux {release}; hocus needs {major}.{minor} or later (Debian 11's \
             kernel is the oldest it runs on: older ones lack the BPF ring buffer and \
             BTF-typed tracepoints its programs use)"
        ),
        None => bail!("cannot tell the kernel's version from its release name {release:?}"),
    }
}

/// The environment variable that makes the agent take fallbacks even where this kernel
/// has what the preferred way needs: names from `FALLBACK_NAMES`, comma-separated, or
/// `all`. The tests take each fallback this way on the kernel they run on; and it is a
/// way round a kernel feature that misbehaves.
pub const FALLBACKS: &str = "HOCUS_FALLBACKS";

/// What `FALLBACKS` can name: the current task read with the helper (`typed-task`),
/// open files read with the helper (`kfuncs`), closes claimed by a plain store
/// (`atomics`), exits told by the group's count (`group-dead`), callers pinned by their
/// pid (`peer-pidfd`), read-only binds by a remount (`mount-setattr`), a job's
/// descriptors closed on exec by marks made at start (`close-range`), Slurm tasks
/// followed by the tracer all along rather than their binds' opens reported by
/// fanotify (`bind-opens`), jobs on FUSE learned from their syscalls rather than from
/// their servers' requests (`fuse-requests`), jobs on NFS learned from their syscalls
/// rather than from the NFS client's functions (`nfs-functions`), big files read in part
/// copied whole rather than in part (`partial-copies`).
pub const FALLBACK_NAMES: [&str; 11] = [
    "typed-task",
    "kfuncs",
    "atomics",
    "group-dead",
    "peer-pidfd",
    "mount-setattr",
    "close-range",
    "bind-opens",
    "fuse-requests",
    "nfs-functions",
    "partial-copies",
];

/// Whether `FALLBACKS` asks for fallback `name` (one of `FALLBACK_NAMES`).
pub fn forced(name: &str) -> bool {
    debug_assert!(FALLBACK_NAMES.contains(&name));
    std::env::var(FALLBACKS)
        .is_ok_and(|v| v.split(',').any(|f| f.trim() == name || f.trim() == "all"))
}

/// Why fallback `name` is taken: `lacking` (what the kernel lacks), or `FALLBACKS` asked.
pub fn why(name: &str, lacking: &str) -> String {
    if forced(name) {
        format!("{FALLBACKS}={name}")
    } else {
        lacking.to_owned()
    }
}

/// Refuses a `FALLBACKS` that names something else (a typo would test nothing).
pub fn check_fallbacks() -> Result<()> {
    let Ok(v) = std::env::var(FALLBACKS) else {
        return Ok(());
    };
    for f in v.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        if f != "all" && !FALLBACK_NAMES.contains(&f) {
            bail!(
                "{FALLBACKS} names {f:?}: it takes {} or all",
                FALLBACK_NAMES.join(", ")
            );
        }
    }
    Ok(())
}

pub fn route(part: &str, way: impl Into<String>, fallback: bool) -> Route {
    Route {
        part: part.to_owned(),
        way: way.into(),
        fallback,
    }
}

/// Says in the log the way each part takes on this kernel.
pub fn log_routes(release: &str, routes: &[Route]) {
    let fallbacks = routes.iter().filter(|r| r.fallback).count();
    log::info!(
        "kernel {release}: {} parts take their preferred way, {fallbacks} a fallback (docs/kernels.md)",
        routes.len() - fallbacks
    );
    for r in routes {
        let note = if r.fallback { " (fallback)" } else { "" };
        log::info!("  {}: {}{note}", r.part, r.way);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_the_oldest_kernel() {
        assert_eq!(version("6.1.0-56-amd64"), Some((6, 1)));
        assert_eq!(version("5.10.0-46-amd64"), Some((5, 10)));
        assert_eq!(version("6.12.118+deb13-amd64"), Some((6, 12)));
        assert_eq!(version("4.18.0-553.el8_10.x86_64"), Some((4, 18)));
        assert!(check_supported("5.10.0-46-amd64").is_ok());
        assert!(check_supported("6.18.0").is_ok());
        let old = check_supported("4.19.0-27-amd64").unwrap_err().to_string();
        assert!(
            old.contains("4.19.0-27-amd64") && old.contains("5.10"),
            "{old}"
        );
        assert!(check_supported("garbage").is_err());
        assert!(version(&release()).is_some());
    }
}
