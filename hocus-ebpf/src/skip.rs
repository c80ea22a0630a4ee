//! Why a program run ends early, and the per-CPU counters of what could not be observed
//! or delivered. Almost every run on the node ends at `Skip::Unwatched`, which costs
//! nothing more; a reason that means something was lost names the counter it bumps
//! (`hocus_common::counter`), so that a loss is never silent.
//!
//! The hooks' steps return a `Step` and end with `finish`. The functions deep below them
//! that the verifier walks at every call site (the walk up the directories, reading a
//! path) return Options and count a loss where it happens, with `Skip::count`
//! (`paths::path_target` says why).

use aya_ebpf::{macros::map, maps::PerCpuArray};
use hocus_common::counter;

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Why a program run stopped before its end.
#[derive(Clone, Copy)]
pub enum Skip {
    /// Nothing hocus watches: a syscall it does not trace, a process it does not follow,
    /// a descriptor or path outside the watched trees, a syscall whose result changed
    /// nothing, or a kernel object that reads as null. Counted nowhere.
    Unwatched,
    /// A 32-bit syscall: its number and registers mean something else, so it is never
    /// read as a 64-bit one. Counted nowhere.
    Compat,
    /// A path a process passed could not be read from its memory.
    PathUnreadable,
    /// A name longer than the walk up a file's directories can hold.
    PathTruncated,
    /// A file deeper below its root than the kernel side walks.
    PathTooDeep,
    /// An absolute path from a mount namespace or chroot that is not the agent's or a
    /// job's, whose view is not learned yet: what it names is unknown.
    ForeignNamespace,
}

impl Skip {
    /// The counter it bumps, if it lost anything.
    fn counter(self) -> Option<u32> {
        match self {
            Skip::Unwatched | Skip::Compat => None,
            Skip::PathUnreadable => Some(counter::PATH_UNREADABLE),
            Skip::PathTruncated => Some(counter::PATH_TRUNCATED),
            Skip::PathTooDeep => Some(counter::PATH_TOO_DEEP),
            Skip::ForeignNamespace => Some(counter::FOREIGN_NAMESPACE),
        }
    }
}

/// What a step of a program run gives: its value, or why the run ends here.
pub type Step<T = ()> = Result<T, Skip>;

/// `?` on a kernel read or a map lookup that may come back empty: the run ends there,
/// as `Skip::Unwatched`.
pub trait OrSkip<T> {
    fn or_skip(self) -> Step<T>;
}

impl<T> OrSkip<T> for Option<T> {
    #[inline(always)]
    fn or_skip(self) -> Step<T> {
        self.ok_or(Skip::Unwatched)
    }
}

/// Ends a program run: counts what it lost, if anything.
#[inline(always)]
pub fn finish(step: Step) {
    if let Err(skip) = step {
        if let Some(c) = skip.counter() {
            count(c);
        }
    }
}

impl Skip {
    /// Counts a loss where the run goes on (or cannot return its reason).
    pub fn count(self) {
        finish(Err(self));
    }
}

pub fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer while this program runs on this CPU.
        unsafe { *c += 1 };
    }
}
