//! Where a file or directory lies: under which root (a watched tree, the cache's copies
//! and snapshots, a snapshot's overlay in a job) and at which path below it, found by
//! walking its dentries up, whatever mount or namespace it was reached through.

use aya_ebpf::{
    helpers::generated,
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use hocus_common::{
    MAX_OVERLAY_ROOTS, MAX_PATH, MAX_ROOTS, MAX_SUPERBLOCKS, Superblock, SuperblockSlot, filter,
    superblock,
};

use crate::{
    kernel::files::{Dentry, Mount},
    skip::Skip,
};

/// How many directories up from a file the kernel side walks to find its root.
const WALK_DEPTH: usize = 40;
/// Longest name of one directory entry.
const NAME_MAX: usize = 255;

/// The directories files are placed under: dentry address to `Event::root` (the roots,
/// then the roots of snapshot overlays in jobs).
#[map]
static ROOTS: HashMap<u64, u32> =
    HashMap::with_max_entries(MAX_ROOTS as u32 + MAX_OVERLAY_ROOTS, 0);
/// The superblocks those directories are on.
#[map]
static SUPERBLOCKS: HashMap<u64, Superblock> = HashMap::with_max_entries(MAX_SUPERBLOCKS, 0);
/// `SUPERBLOCKS` by slot (`filter::superblock_slot`), kept by the agent: every open on
/// the node asks, and almost every answer is "none" or the slot's one superblock.
#[map]
static SUPERBLOCK_SLOTS: Array<SuperblockSlot> =
    Array::with_max_entries(filter::SUPERBLOCK_SLOTS, 0);
/// Where a walk up the directories writes its path, backwards from `MAX_PATH`; twice
/// as long so that the verifier sees every write land inside it.
#[map]
pub static WALK: PerCpuArray<WalkBuf> = PerCpuArray::with_max_entries(1, 0);

#[repr(C, align(8))]
pub struct WalkBuf {
    pub bytes: [u8; 2 * MAX_PATH],
}

/// Where a file or directory lies: under root `root`, at the path in `WALK` from `start`
/// to `MAX_PATH` (`/a/b`, empty for the root itself).
#[derive(Clone, Copy)]
pub struct Located {
    pub root: u32,
    pub start: u32,
}

/// Places a dentry, reached through `mount`, under one of `ROOTS` by walking up its
/// parents, whatever mount or namespace it was reached through: a tree bound elsewhere
/// in a container is still the tree, a look-alike mounted at the same path is another
/// superblock. Every open on the node comes here: most leave at the superblock test.
///
/// An Option, not a `Step`, as in `paths`: a loss is counted here, by its reason.
pub fn locate(mount: Mount, dentry: Dentry) -> Option<Located> {
    let slot = SUPERBLOCK_SLOTS.get(filter::superblock_slot(mount.sb))?;
    let known = match slot.count {
        0 => return None,
        1 if slot.address == mount.sb => slot.superblock,
        // SAFETY: plain value copy.
        _ => unsafe { *SUPERBLOCKS.get(&mount.sb)? },
    };
    // Only the cache is on this disk: what matters is reached through hocus's binds
    // (mounts rooted inside the cache), not through the disk's own mount.
    if known.flags & (superblock::WATCHED | superblock::SNAPSHOT_OVERLAY) == 0
        && mount.root == known.root
    {
        return None;
    }
    let buf = WALK.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch owned by this program run.
    let buf = unsafe { &mut *buf };
    let mut pos = MAX_PATH;
    let mut d = dentry;
    for _ in 0..WALK_DEPTH {
        // SAFETY: plain value copy. One lookup rather than a comparison per root: the
        // verifier then follows one "found" path per step, not one per root. A typed
        // dentry is a key like its address (the loader is privileged).
        if let Some(&root) = unsafe { ROOTS.get(&d.0) } {
            return Some(Located {
                root,
                start: pos as u32,
            });
        }
        let (parent, len, name) = d.up()?;
        if parent.0 == d.0 {
            return None; // the filesystem's root, above every watched tree
        }
        let len = len as usize;
        if len == 0 || len > NAME_MAX || len + 2 > pos {
            Skip::PathTruncated.count();
            return None;
        }
        pos -= len;
        // The helper's size must be bounded in its own register. LLVM drops a mask it
        // knows changes nothing (the test above), and the verifiers before 6.13 or so do
        // not carry that test's bound over to the register the size ends up in: a
        // volatile read hides what LLVM knows, so the mask stays.
        // SAFETY: a read of a local.
        let size = unsafe { core::ptr::read_volatile(&len) } & NAME_MAX;
        // SAFETY: the destination is inside `buf` (pos < MAX_PATH, size <= NAME_MAX, the
        // buffer is 2 * MAX_PATH); the source is read with the fault-tolerant helper.
        unsafe {
            generated::bpf_probe_read_kernel(
                buf.bytes.as_mut_ptr().add(pos & (MAX_PATH - 1)).cast(),
                size as u32,
                name as *const _,
            );
        }
        pos -= 1;
        buf.bytes[pos & (MAX_PATH - 1)] = b'/';
        d = parent;
    }
    Skip::PathTooDeep.count();
    None
}
