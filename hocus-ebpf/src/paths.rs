//! Where a path a process passed lies (a failed lookup's, a mutation's). A relative path
//! is placed by the directory it starts from, found like an opened file; an absolute one
//! by the watched prefixes, but only in a namespace whose paths mean what they mean to
//! the agent (its own, its jobs'), or through the view of the watched trees the agent
//! learned for another namespace (a container). The path is copied only once a cheap
//! test says it may be watched: most failed lookups on a node (a search path's misses)
//! are nowhere near a watched tree.
//!
//! The hooks call `path_target` from as few places as they can: the verifier walks it
//! (and the walk up the directories below it) once per call site.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user, bpf_probe_read_user_str_bytes},
    macros::map,
    maps::{Array, LruHashMap},
};
use hocus_common::{
    AT_FDCWD, MAX_KNOWN_NAMESPACES, MAX_PATH, MAX_VIEWS, MAX_WATCHED, NamespaceKey, PathBuf, View,
    Watched, counter, ev, kind,
};

use crate::{
    agent::HOME,
    emit::{Header, SCRATCH, Target, ViewRef, emit, target},
    kernel::{
        files::file_at,
        task::{cwd, namespace_of, nsproxy, root_dentry},
    },
    locate::locate,
    skip::{Skip, count},
};

/// The watched trees as the agent sees them, for absolute paths of failed lookups and
/// mutations (opens are placed by what they opened).
#[map]
static WATCHED: Array<Watched> = Array::with_max_entries(MAX_WATCHED, 0);
/// Mount namespaces (with a root) whose absolute paths mean what they mean to the agent.
#[map]
pub static KNOWN_NAMESPACES: LruHashMap<NamespaceKey, u32> =
    LruHashMap::with_max_entries(MAX_KNOWN_NAMESPACES, 0);
/// How other mount namespaces (containers) see the watched trees, learned by the agent.
#[map]
static VIEWS: LruHashMap<NamespaceKey, View> = LruHashMap::with_max_entries(MAX_VIEWS, 0);
/// The namespaces whose view the agent was asked to learn, at which generation: asked
/// once per mount change, not once per lookup.
#[map]
static ASKED: LruHashMap<NamespaceKey, u64> = LruHashMap::with_max_entries(MAX_VIEWS, 0);
/// Bumped when a mount syscall ends (and by the agent when the syscall program wakes
/// from a rest): a view learned before is stale.
#[map]
static MOUNT_GENERATION: Array<u64> = Array::with_max_entries(1, 0);

fn generation() -> u64 {
    MOUNT_GENERATION.get(0).copied().unwrap_or(0)
}

/// A mount syscall ended: every view learned before is stale.
pub fn mounts_change() {
    if let Some(g) = MOUNT_GENERATION.get_ptr_mut(0) {
        // SAFETY: a map value; the add is atomic (concurrent mounts on other CPUs).
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                g, 1,
            )
        };
    }
}

/// Where the path of a path syscall (failed lookup, mutation) lies, if watched, read
/// into scratch slot `slot`; the answer is kept in `TARGETS` at the same slot. A loss is
/// counted here, by its reason (`Skip::count`).
///
/// These return Options, not `Step`s: with a reason returned through every exit, the
/// verifier's states no longer merged and `syscall_exit` took over a million
/// instructions to verify (against about 500 thousand).
pub fn path_target(dfd: i32, user_path: u64, slot: u32) -> Option<&'static Target> {
    // One read of user memory tells an absolute path and gives the prefix test its
    // first eight bytes; a short path at the end of a page is read a byte at a time.
    let word = FirstWord::of(user_path);
    let first = if word.known == u64::MAX {
        word.bytes as u8
    } else {
        // SAFETY: user pointer, read with the helper that tolerates faults.
        unsafe { bpf_probe_read_user(user_path as *const u8) }.ok()?
    };
    if first == b'/' {
        return absolute_target(user_path, word, slot);
    }
    let (mount, dentry) = if dfd == AT_FDCWD {
        cwd()?
    } else {
        file_at(dfd as u32)?.place()?
    };
    let located = locate(mount, dentry)?;
    let (_, t) = read_target(user_path, slot)?;
    t.located = Some(located);
    Some(t)
}

/// Reads a user path into scratch slot `slot`: what an event carries, `len` bytes of
/// the target, which is slot `slot` of `TARGETS`, reset.
fn read_target(user_path: u64, slot: u32) -> Option<(&'static PathBuf, &'static mut Target)> {
    let buf = SCRATCH.get_ptr_mut(slot)?;
    // SAFETY: per-CPU scratch owned by this program run; the user pointer is read with
    // the fault-tolerant helper.
    let buf = unsafe { &mut *buf };
    let len = match unsafe { bpf_probe_read_user_str_bytes(user_path as *const u8, &mut buf.bytes) }
    {
        Ok(s) => s.len(),
        Err(_) => {
            Skip::PathUnreadable.count();
            return None;
        }
    };
    if len == 0 {
        return None;
    }
    let t = target(slot, None)?;
    t.len = len as u32;
    if len >= MAX_PATH - 1 {
        // Sent all the same, cut and flagged.
        t.flags |= ev::PATH_TRUNCATED;
        count(counter::PATH_TRUNCATED);
    }
    Some((buf, t))
}

/// The first eight bytes of a user path, for a test against the prefixes' first words
/// before the whole path is copied. They may not be readable at once (a short path at
/// the end of a page): then `known` is 0 and every prefix may match. (Not an Option: the
/// verifier refuses the undefined payload of a None that LLVM may pass along.)
#[derive(Clone, Copy)]
struct FirstWord {
    bytes: u64,
    /// All ones if the bytes were read, else 0.
    known: u64,
}

impl FirstWord {
    fn of(user_path: u64) -> Self {
        // SAFETY: user pointer, read with the helper that tolerates faults.
        match unsafe { bpf_probe_read_user(user_path as *const u64) } {
            Ok(bytes) => Self {
                bytes,
                known: u64::MAX,
            },
            Err(_) => Self { bytes: 0, known: 0 },
        }
    }

    /// Whether a path starting with it may lie under `w`.
    fn may_lie_under(self, w: &Watched) -> bool {
        w.may_hold(self.bytes, self.known)
    }
}

/// An absolute path means what it means to the agent in the agent's own namespace and
/// root, and in the namespaces it made for jobs; elsewhere (a container) it means what
/// that namespace's mounts say, which the agent learns from its mountinfo.
fn absolute_target(user_path: u64, word: FirstWord, slot: u32) -> Option<&'static Target> {
    let nsproxy = nsproxy()?;
    let home = HOME.get(0)?;
    let at_home = nsproxy.0 == home.nsproxy;
    // One read for most processes on the node (they share the agent's nsproxy).
    let key = if at_home {
        None
    } else {
        Some(namespace_of(nsproxy)?)
    };
    // SAFETY: plain lookup.
    let own = key.is_none_or(|(k, _)| unsafe { KNOWN_NAMESPACES.get(&k) }.is_some());
    if own {
        if !any_watched(|w| word.may_lie_under(w)) {
            return None;
        }
        let (path, t) = read_target(user_path, slot)?;
        if !any_watched(|w| w.holds(path)) {
            return None;
        }
        // A chroot (in a user namespace, anyone can) keeps the nsproxy: check the root.
        if at_home && root_dentry()? != home.root {
            Skip::ForeignNamespace.count();
            return None;
        }
        return Some(t);
    }
    let (key, inum) = key?;
    let generation = generation();
    let view = ViewRef {
        key,
        generation,
        inum,
    };
    // SAFETY: plain lookups.
    match unsafe { VIEWS.get(&key) } {
        Some(v) if v.generation == generation => {
            if !v
                .prefixes
                .iter()
                .any(|w| w.is_set() && word.may_lie_under(w))
            {
                return None;
            }
            let (path, t) = read_target(user_path, slot)?;
            if !v.prefixes.iter().any(|w| w.is_set() && w.holds(path)) {
                return None;
            }
            t.view = Some(view);
            Some(t)
        }
        _ => {
            Skip::ForeignNamespace.count();
            if unsafe { ASKED.get(&key) } != Some(&generation) {
                let _ = ASKED.insert(&key, &generation, 0);
                let ask = target(slot, None)?;
                ask.view = Some(view);
                let h = Header::new(kind::LEARN_VIEW, (bpf_get_current_pid_tgid() >> 32) as u32);
                emit(&h, Some(ask), 0);
            }
            None
        }
    }
}

/// Whether any watched tree passes `test`.
fn any_watched(test: impl Fn(&Watched) -> bool) -> bool {
    for i in 0..MAX_WATCHED {
        let Some(w) = WATCHED.get(i) else {
            return false;
        };
        if w.len == 0 {
            return false;
        }
        if test(w) {
            return true;
        }
    }
    false
}
