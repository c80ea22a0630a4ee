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
//!   follow processes that only look at the mount from outside).
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

    /// Whether it fires only for requests that reach the server, so that a job served
    /// from local copies never trips it: FUSE's does (every request goes to the FUSE
    /// server); NFS's fires on every path walk through the mount, from the client's
    /// caches too, so a served job whose paths cross an NFS directory trips it.
    pub fn sees_only_server_requests(self) -> bool {
        match self {
            Self::Fuse => true,
            Self::Nfs => false,
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
