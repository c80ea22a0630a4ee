//! Events to the agent: the ring buffer, what an event says (`Header`) and where it
//! happened (`Target`: under a root, at the walk's path; or the process's own path,
//! read into a per-CPU scratch slot).

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel_buf, generated,
    },
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use hocus_common::{
    Event, MAX_PATH, NamespaceKey, PathBuf, RING_BYTES, ROOT_NONE, ROOT_VIEW, counter, kind,
    ranges::RangeRead,
};

use crate::{
    follow::JOBS,
    locate::{Located, WALK},
    skip::count,
};

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// Wake the agent only once this much is waiting; it also polls on a short timer. An
/// import storm then costs a handful of wakeups instead of one per event.
const WAKEUP_BYTES: u64 = 256 << 10;

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BYTES, 0);
/// Two path buffers per CPU (rename has two paths); too big for the 512-byte stack.
#[map]
pub static SCRATCH: PerCpuArray<PathBuf> = PerCpuArray::with_max_entries(2, 0);
/// Where the path in each scratch slot lies (`paths::path_target`). Kept here, not on
/// the stack: the verifier allows 512 bytes for a program and every function it calls
/// together, and before 6.13 or so it adds up the frames of `syscall_exit`, the path
/// functions and the walk, two Targets among them, to more.
#[map]
pub static TARGETS: PerCpuArray<Target> = PerCpuArray::with_max_entries(2, 0);
#[map]
static NEXT_ID: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The parts of an event that do not come from the path.
pub struct Header {
    pub kind: u8,
    pub tgid: u32,
    pub file_id: u64,
    pub bytes: u64,
    pub open_flags: u32,
}

impl Header {
    pub fn new(kind: u8, tgid: u32) -> Self {
        Self {
            kind,
            tgid,
            file_id: 0,
            bytes: 0,
            open_flags: 0,
        }
    }
}

/// Where an event happened: under a root (`located`, the path in `WALK`), and the
/// process's path in a scratch slot (`len` bytes; absolute when not located).
pub struct Target {
    pub flags: u32,
    pub located: Option<Located>,
    /// An absolute path in another namespace's view, or a view to learn.
    pub view: Option<ViewRef>,
    pub len: u32,
}

/// Slot `slot` of `TARGETS`, reset: under `located` if given, with no path of the
/// process's and no view.
pub fn target(slot: u32, located: Option<Located>) -> Option<&'static mut Target> {
    let t = TARGETS.get_ptr_mut(slot)?;
    // SAFETY: per-CPU scratch owned by this program run.
    let t = unsafe { &mut *t };
    t.flags = 0;
    t.located = located;
    t.view = None;
    t.len = 0;
    Some(t)
}

/// A mount namespace whose view of the watched trees the agent holds (or is asked to
/// learn), as of `generation`.
#[derive(Clone, Copy)]
pub struct ViewRef {
    pub key: NamespaceKey,
    pub generation: u64,
    pub inum: u32,
}

/// A new open file's id, unique across CPUs through the CPU number on top.
pub fn next_id() -> u64 {
    let Some(n) = NEXT_ID.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: per-CPU slot owned by this program run.
    unsafe {
        *n += 1;
        ((bpf_get_smp_processor_id() as u64) << 48) | *n
    }
}

/// Sends an event, about where `t` says (None: an open file or a process, no path); the
/// path is scratch slot `slot`'s. A full ring buffer is counted, with what kind of event
/// it lost.
pub fn emit(h: &Header, t: Option<&Target>, slot: u32) {
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        count(counter::LOST_RING_FULL);
        match h.kind {
            kind::OPEN => count(counter::LOST_OPENS),
            kind::MISSING => count(counter::LOST_FAILED_LOOKUPS),
            _ => {}
        }
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` points at a reserved ring buffer slot of `size_of::<Event>()` bytes; it
    // is written field by field because an Event does not fit on the BPF stack.
    unsafe {
        (*e).kind = h.kind;
        (*e).flags = t.map_or(0, |t| t.flags);
        (*e).tgid = h.tgid;
        (*e).uid = bpf_get_current_uid_gid() as u32;
        (*e).time_ns = bpf_ktime_get_ns();
        (*e).file_id = h.file_id;
        (*e).bytes = h.bytes;
        (*e).open_flags = h.open_flags;
        (*e).path_len = t.map_or(0, |t| t.len);
        (*e).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        (*e).job = JOBS.get(&tgid).copied().unwrap_or(0);
        (*e).root = ROOT_NONE;
        (*e).base_len = 0;
        (*e).namespace = NamespaceKey::default();
        (*e).generation = 0;
        (*e).ns_inum = 0;
        let (view, located, len) = t.map_or((None, None, 0), |t| (t.view, t.located, t.len));
        if let Some(v) = view {
            (*e).root = ROOT_VIEW;
            (*e).namespace = v.key;
            (*e).generation = v.generation;
            (*e).ns_inum = v.inum;
        }
        if let Some(l) = located {
            (*e).root = l.root;
            let start = l.start as usize & (MAX_PATH - 1);
            let len = (MAX_PATH - start) & (MAX_PATH - 1);
            (*e).base_len = len as u32;
            if let Some(walk) = WALK.get_ptr(0) {
                generated::bpf_probe_read_kernel(
                    (*e).base.as_mut_ptr().cast(),
                    len as u32,
                    (*walk).bytes.as_ptr().add(start).cast(),
                );
            }
        }
        if len > 0 {
            match SCRATCH.get_ptr(slot) {
                Some(buf) => {
                    let _ = bpf_probe_read_kernel_buf(buf as *const u8, &mut (*e).path);
                }
                None => (*e).path_len = 0,
            }
        }
    }
    let pending = EVENTS.query(BPF_RB_AVAIL_DATA);
    entry.submit(if h.kind == kind::WAKE || pending >= WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    });
    count(counter::EVENTS_SENT);
}

/// A followed file is closed, having read `bytes`, the last of them in `run` (0: none).
pub fn closed(file_id: u64, bytes: u64, run: u64) {
    if run != 0 {
        range(file_id, run);
    }
    let h = Header {
        file_id,
        bytes,
        ..Header::new(kind::CLOSE, 0)
    };
    emit(&h, None, 0);
}

/// Open file `file_id` read the run of grains `run` (`ranges`). The agent is not woken
/// for it: a run matters at the close or the next poll, not at once.
pub fn range(file_id: u64, run: u64) {
    let Some(mut entry) = EVENTS.reserve::<RangeRead>(0) else {
        count(counter::LOST_RING_FULL);
        return;
    };
    entry.write(RangeRead {
        kind: kind::RANGE,
        _pad: [0; 7],
        file_id,
        run,
    });
    entry.submit(BPF_RB_NO_WAKEUP);
    count(counter::EVENTS_SENT);
}
