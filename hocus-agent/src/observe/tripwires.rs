//! Tripwires: the hooks that see which processes use a watched mount, so that the
//! syscall program follows those (and jobs) instead of every process on the node
//! (docs/overhead.md). Each kind of filesystem has its own, where its kernel has it:
//!
//! - FUSE (sshfs ...): every open, and every lookup of a name the kernel does not hold,
//!   is a request to the server, made in the context of the process that needs it
//!   (`fuse:fuse_request_send`, newer kernels than Debian 13's);
//! - kernel NFS (v3, v4.x): every path walk through one of its directories checks the
//!   process may search it, from the client's caches or not, a cached failed lookup too,
//!   and opening the mount's root checks it may read it (`nfs:nfs_access_enter`, from
//!   5.10 on, while the nfs module is loaded). A `stat` of the root alone is not seen
//!   (its attributes' tracepoint fires for every `ls -l` of the mount's parent: it would
//!   follow processes that only look at the mount from outside). A job served from
//!   local copies trips it too (its path walks cross the mount's directories above its
//!   binds), so the requests that read or change the mount are hooked beside it
//!   (`miss_hooks`): they wake a rest with jobs running.
//!
//! Other filesystems (Lustre, GPFS, a local disk ...) have none here: a watched tree on
//! one follows every process (docs/kernels.md).

use std::path::Path;

use crate::observe::mounts;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tripwire {
    Fuse,
    Nfs,
}

/// A program of the kernel side, and the tracepoint (category, event) it goes on.
pub type Hook = (&'static str, (&'static str, &'static str));
/// A hook that tells a served job's misses apart, and whether a rest with jobs running
/// needs it (`Tripwire::miss_hooks`).
pub type MissHook = (&'static str, (&'static str, &'static str), bool);

impl Tripwire {
    /// The tripwire for a filesystem type, if it has one.
    pub fn of(fs_type: &str) -> Option<Self> {
        if mounts::is_fuse_type(fs_type) {
            Some(Self::Fuse)
        } else if fs_type == "nfs" || fs_type == "nfs4" {
            Some(Self::Nfs)
        } else {
            None
        }
    }

    /// Where its programs go; the field holding the mount's device in each record is
    /// read from the formats (`loader`).
    pub fn hooks(self) -> &'static [Hook] {
        match self {
            Self::Fuse => &[("fuse_request", ("fuse", "fuse_request_send"))],
            Self::Nfs => &[("nfs_access", ("nfs", "nfs_access_enter"))],
        }
    }

    /// Whether the kernel under `tracefs` has every tracepoint it needs.
    pub fn is_on(self, tracefs: &Path) -> bool {
        self.hooks().iter().all(|(_, (category, event))| {
            tracefs.join("events").join(category).join(event).exists()
        })
    }

    /// Its tracepoints, for messages.
    pub fn tracepoints(self) -> String {
        let names: Vec<String> = self
            .hooks()
            .iter()
            .map(|(_, (category, event))| format!("{category}:{event}"))
            .collect();
        names.join(", ")
    }

    /// The hooks that tell a served job's misses apart, each with whether a rest with
    /// jobs running needs it: FUSE's own request hook does (it reads the opcode); NFS's
    /// fires on every path walk through the mount, from the client's caches too, so the
    /// requests that read or change the mount are hooked beside it (`hooks/nfs_request`):
    /// opens and creates of names the client does not hold, NFSv4's opens (only where a
    /// v4 mount loaded its module), and changes.
    pub fn miss_hooks(self) -> &'static [MissHook] {
        match self {
            Self::Fuse => &[],
            Self::Nfs => &[
                ("nfs_lookup", ("nfs", "nfs_lookup_enter"), true),
                ("nfs_create", ("nfs", "nfs_create_enter"), true),
                ("nfs_atomic_open", ("nfs", "nfs_atomic_open_enter"), true),
                ("nfs4_open", ("nfs4", "nfs4_open_file"), false),
                ("nfs_change", ("nfs", "nfs_setattr_enter"), true),
                ("nfs_change", ("nfs", "nfs_remove_enter"), false),
                ("nfs_change", ("nfs", "nfs_unlink_enter"), false),
                ("nfs_change", ("nfs", "nfs_mkdir_enter"), false),
                ("nfs_change", ("nfs", "nfs_rmdir_enter"), false),
                ("nfs_change", ("nfs", "nfs_rename_enter"), false),
                ("nfs_change", ("nfs", "nfs_link_enter"), false),
                ("nfs_change", ("nfs", "nfs_symlink_enter"), false),
                ("nfs_change", ("nfs", "nfs_initiate_write"), false),
            ],
        }
    }

    pub fn filesystems(self) -> &'static str {
        match self {
            Self::Fuse => "FUSE",
            Self::Nfs => "NFS",
        }
    }
}

/// The tripwires the kernel under `tracefs` has.
pub fn on_this_kernel(tracefs: &Path) -> Vec<Tripwire> {
    [Tripwire::Fuse, Tripwire::Nfs]
        .into_iter()
        .filter(|t| t.is_on(tracefs))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_and_kernel_nfs_have_one_the_others_none() {
        for (fs, wire) in [
            ("fuse.sshfs", Some(Tripwire::Fuse)),
            ("fuse", Some(Tripwire::Fuse)),
            ("nfs", Some(Tripwire::Nfs)),
            ("nfs4", Some(Tripwire::Nfs)),
            ("lustre", None),
            ("gpfs", None),
            ("ext4", None),
            ("fusectl", None),
        ] {
            assert_eq!(Tripwire::of(fs), wire, "{fs}");
        }
        assert_eq!(Tripwire::Nfs.tracepoints(), "nfs:nfs_access_enter");
    }
}
